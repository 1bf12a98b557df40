// The REST API (/v1) with the signed-in key, kept in sessionStorage (never in a URL).

const KEY = "sandlot.key";

export class ApiError extends Error {
  constructor(public status: number, public type: string, message: string) {
    super(message);
  }
}

export function key(): string | null {
  return sessionStorage.getItem(KEY);
}

export function setKey(value: string | null): void {
  if (value) sessionStorage.setItem(KEY, value);
  else sessionStorage.removeItem(KEY);
}

function headers(extra: Record<string, string> = {}, k = key()): Record<string, string> {
  return { authorization: `Bearer ${k ?? ""}`, ...extra };
}

async function failure(r: Response): Promise<ApiError> {
  let type = "Error";
  let message = `${r.status} ${r.statusText}`;
  try {
    const body = await r.json();
    if (body?.error?.message) {
      type = body.error.type ?? type;
      message = body.error.message;
    }
  } catch {
    /* not JSON: the status line says it */
  }
  return new ApiError(r.status, type, message);
}

export async function raw(method: string, path: string, init: RequestInit = {},
                          k?: string): Promise<Response> {
  const r = await fetch(path, {
    method, ...init,
    headers: headers((init.headers as Record<string, string>) ?? {}, k ?? key()),
  });
  if (!r.ok) throw await failure(r);
  return r;
}

export async function call<T = any>(method: string, path: string, body?: unknown,
                                    k?: string): Promise<T> {
  const init: RequestInit = {};
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers = { "content-type": "application/json" };
  }
  const r = await raw(method, path, init, k);
  if (r.status === 204) return undefined as T;
  return (await r.json()) as T;
}

/** Lines of an NDJSON or SSE body as they come; ends when the body does. */
export async function* lines(r: Response, sep = "\n"): AsyncGenerator<string> {
  const reader = r.body!.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let i: number;
    while ((i = buf.indexOf(sep)) >= 0) {
      yield buf.slice(0, i);
      buf = buf.slice(i + sep.length);
    }
  }
  if (buf.trim()) yield buf;
}

/** Server-sent events of GET /v1/events, read with fetch (so the key goes in a header). */
export async function* events(signal: AbortSignal): AsyncGenerator<{ event: string; data: any }> {
  const r = await raw("GET", "/v1/events", { signal });
  for await (const block of lines(r, "\n\n")) {
    let event = "message";
    const data: string[] = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event: ")) event = line.slice(7);
      else if (line.startsWith("data: ")) data.push(line.slice(6));
    }
    if (data.length) yield { event, data: JSON.parse(data.join("\n")) };
  }
}
