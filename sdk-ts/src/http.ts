/**
 * The one place the SDK sends HTTP requests: configuration, timeouts, error mapping, and the
 * NDJSON event streams of commands. Everything else builds requests and converts answers.
 *
 * @module
 */

import { SandlotError, InvalidArgumentError, errorFromResponse } from "./errors.js";

/** Where the server is and how to talk to it. Every static method and constructor takes these. */
export interface ConnectionOptions {
  /** The server's URL; default env `SANDLOT_URL`, else `http://127.0.0.1:7070`. */
  apiUrl?: string;
  /** An API key (`sandlot keys create`); default env `SANDLOT_API_KEY`. */
  apiKey?: string;
  /**
   * HTTP timeout of ordinary calls in ms (default 120 000: creating a sandbox restores a VM).
   * Commands get their own timeout plus slack; file transfers and output streams get none.
   */
  requestTimeoutMs?: number;
  /** A `fetch` to send requests with instead of the global one (tests, proxies, instrumentation). */
  fetch?: typeof fetch;
}

/** The default server URL. */
export const DEFAULT_URL = "http://127.0.0.1:7070";
const DEFAULT_REQUEST_TIMEOUT_MS = 120_000;
/** Extra time on top of a command's own timeout, so the server's timeout error arrives first. */
export const COMMAND_TIMEOUT_SLACK_MS = 30_000;

type Query = Record<string, string | number | boolean | null | undefined>;
type Body = string | Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array>;

/** A REST call. `timeoutMs`: `undefined` = the connection's request timeout, `null` = none. */
export interface ApiRequest {
  method: string;
  path: string;
  query?: Query;
  json?: unknown;
  body?: Body;
  /** Extra request headers. */
  headers?: Record<string, string>;
  timeoutMs?: number | null;
}

function env(name: string): string | undefined {
  const value = typeof process !== "undefined" ? process.env[name] : undefined;
  return value ? value : undefined;
}

/** A cancellable deadline for one request, including the reading of its body. */
class Deadline {
  readonly controller = new AbortController();
  timedOut = false;
  private timer: ReturnType<typeof setTimeout> | undefined;

  constructor(ms: number | null) {
    if (ms !== null && ms > 0) {
      this.timer = setTimeout(() => {
        this.timedOut = true;
        this.controller.abort();
      }, ms);
      // A pending deadline must not keep the process alive on its own.
      (this.timer as { unref?: () => void }).unref?.();
    }
  }

  clear(): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = undefined;
  }
}

/**
 * Server URL, API key and `fetch`. Every request goes through {@link Api.send}, which maps
 * transport failures and error answers to the classes in `errors.ts`.
 * @internal
 */
export class Api {
  readonly apiUrl: string;
  readonly apiKey: string | undefined;
  readonly requestTimeoutMs: number;
  private readonly fetchImpl: typeof fetch;

  constructor(options: ConnectionOptions = {}) {
    this.apiUrl = (options.apiUrl || env("SANDLOT_URL") || DEFAULT_URL).replace(/\/+$/, "");
    this.apiKey = options.apiKey !== undefined ? options.apiKey || undefined : env("SANDLOT_API_KEY");
    this.requestTimeoutMs = options.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS;
    const impl = options.fetch ?? globalThis.fetch;
    if (typeof impl !== "function") {
      throw new SandlotError("no fetch available: use Node 18 or later, or pass options.fetch");
    }
    this.fetchImpl = impl;
  }

  private url(req: ApiRequest): string {
    let url: URL;
    try {
      url = new URL(this.apiUrl + req.path);
    } catch (cause) {
      throw new InvalidArgumentError(`invalid sandlot URL ${JSON.stringify(this.apiUrl)}`, { cause });
    }
    for (const [key, value] of Object.entries(req.query ?? {})) {
      if (value !== undefined && value !== null) url.searchParams.set(key, String(value));
    }
    return url.toString();
  }

  private transportError(cause: unknown, deadline: Deadline): SandlotError {
    if (cause instanceof SandlotError) return cause;
    if (deadline.timedOut) {
      return new SandlotError(`request to the sandlot server at ${this.apiUrl} timed out`, { cause });
    }
    const inner = (cause as { cause?: { code?: string; message?: string } })?.cause;
    if (inner?.code === "ECONNREFUSED" || inner?.code === "ENOTFOUND") {
      return new SandlotError(`cannot connect to the sandlot server at ${this.apiUrl}: ${inner.message}`, {
        cause,
      });
    }
    const detail = inner?.message ?? (cause as Error)?.message ?? String(cause);
    return new SandlotError(`connection to the sandlot server at ${this.apiUrl} failed: ${detail}`, { cause });
  }

  /**
   * Send `req`; throw the sandlot error for any failure. The returned body is unread: the
   * caller reads it and then calls `done` (which clears the deadline).
   */
  async send(req: ApiRequest): Promise<{ response: Response; done: () => void; deadline: Deadline }> {
    const deadline = new Deadline(req.timeoutMs === undefined ? this.requestTimeoutMs : req.timeoutMs);
    const headers: Record<string, string> = { ...req.headers, "User-Agent": "sandlot-typescript" };
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    let body: Body | undefined = req.body;
    if (req.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(req.json);
    } else if (body !== undefined && !(body instanceof Blob)) {
      headers["Content-Type"] = "application/octet-stream";
    }
    const init: RequestInit & { duplex?: "half" } = {
      method: req.method,
      headers,
      body: body as RequestInit["body"],
      signal: deadline.controller.signal,
    };
    // A streamed request body needs half duplex (fetch's rule for ReadableStream bodies).
    if (body instanceof ReadableStream) init.duplex = "half";
    let response: Response;
    try {
      response = await this.fetchImpl(this.url(req), init);
    } catch (cause) {
      deadline.clear();
      throw this.transportError(cause, deadline);
    }
    if (!response.ok) {
      let text = "";
      try {
        text = await response.text();
      } catch {
        // the status alone still says what went wrong
      } finally {
        deadline.clear();
      }
      throw errorFromResponse(response.status, text, this.apiKey !== undefined);
    }
    return { response, done: () => deadline.clear(), deadline };
  }

  /** Send `req` and return its parsed JSON body (`undefined` for an empty body). */
  async call<T = unknown>(req: ApiRequest): Promise<T> {
    const { response, done, deadline } = await this.send(req);
    let text: string;
    try {
      text = await response.text();
    } catch (cause) {
      throw this.transportError(cause, deadline);
    } finally {
      done();
    }
    if (!text) return undefined as T;
    try {
      return JSON.parse(text) as T;
    } catch (cause) {
      throw new SandlotError(`server sent invalid JSON: ${JSON.stringify(text.slice(0, 100))}`, { cause });
    }
  }

  /** Send `req` and yield each line of its NDJSON answer, parsed. */
  async *events(req: ApiRequest): AsyncGenerator<Record<string, unknown>, void, undefined> {
    const { response, done, deadline } = await this.send(req);
    const body = response.body;
    if (!body) {
      done();
      return;
    }
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    try {
      for (;;) {
        let chunk: { done: boolean; value?: string };
        try {
          chunk = await reader.read();
        } catch (cause) {
          throw this.transportError(cause, deadline);
        }
        if (chunk.done) break;
        buffer += chunk.value;
        let newline: number;
        while ((newline = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, newline).trim();
          buffer = buffer.slice(newline + 1);
          if (line) yield parseEvent(line);
        }
      }
      if (buffer.trim()) yield parseEvent(buffer.trim());
    } finally {
      done();
      // Stop the download if the consumer left early; a finished stream ignores this.
      reader.cancel().catch(() => undefined);
    }
  }

  /** Send `req` and return its body as a byte stream (no timeout; cancel it to stop early). */
  async stream(req: ApiRequest): Promise<ReadableStream<Uint8Array>> {
    const { response, done, deadline } = await this.send({ ...req, timeoutMs: req.timeoutMs ?? null });
    const body = response.body;
    if (!body) {
      done();
      return new ReadableStream<Uint8Array>({ start: (c) => c.close() });
    }
    const reader = body.getReader();
    const transportError = (cause: unknown) => this.transportError(cause, deadline);
    return new ReadableStream<Uint8Array>({
      async pull(controller) {
        try {
          const { done: finished, value } = await reader.read();
          if (finished) {
            done();
            controller.close();
          } else {
            controller.enqueue(value);
          }
        } catch (cause) {
          done();
          controller.error(transportError(cause));
        }
      },
      async cancel(reason) {
        done();
        await reader.cancel(reason);
      },
    });
  }
}

function parseEvent(line: string): Record<string, unknown> {
  try {
    const event = JSON.parse(line) as unknown;
    if (event && typeof event === "object") return event as Record<string, unknown>;
  } catch (cause) {
    throw new SandlotError(`server sent a bad command event: ${JSON.stringify(line.slice(0, 100))}`, { cause });
  }
  throw new SandlotError(`server sent a bad command event: ${JSON.stringify(line.slice(0, 100))}`);
}

/** A URL path segment for an id or name; rejects empty ones. @internal */
export function seg(value: string): string {
  if (typeof value !== "string" || !value) {
    throw new InvalidArgumentError(`expected a non-empty id, got ${JSON.stringify(value)}`);
  }
  return encodeURIComponent(value);
}

/** Seconds for the REST API from a millisecond option (rounded up; `null`/`undefined` kept). @internal */
export function seconds(ms: number | null | undefined): number | null | undefined {
  if (ms === null || ms === undefined) return ms;
  if (typeof ms !== "number" || !Number.isFinite(ms) || ms < 0) {
    throw new InvalidArgumentError(`a timeout must be a number of ms >= 0, got ${String(ms)}`);
  }
  return Math.ceil(ms / 1000);
}

/** Coerce a string map (env, metadata), rejecting what is not an object. @internal */
export function strMap(value: Record<string, unknown> | undefined | null, what: string): Record<string, string> | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== "object" || Array.isArray(value)) {
    throw new InvalidArgumentError(`${what} must be an object of strings`);
  }
  return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, String(v)]));
}
