// What the key may see, kept current by GET /v1/events (lists reloaded when it (re)opens).

import { ApiError, call, events } from "./api";

export type Sandbox = {
  sandbox_id: string; state: string; template: string | null; snapshot_id: string | null;
  memory_mb: number; cpus: number; created_at: string; expires_at: string | null;
  timeout: number; forked_from: string | null; host: string | null; error: string | null;
  metadata: Record<string, string>; on_timeout: string;
};
export type Snapshot = {
  snapshot_id: string; name: string | null; state: string; sandbox_id: string | null;
  template: string | null; size_bytes: number | null; stored_bytes: number | null;
  memory: boolean; created_at: string; error: string | null;
};
export type Template = { name: string; hash: string; memory_mb: number; cpus: number };

export const store = {
  sandboxes: new Map<string, Sandbox>(),
  snapshots: new Map<string, Snapshot>(),
  templates: [] as Template[],
  live: false,
};

const listeners = new Set<() => void>();
let scheduled = false;

export function onChange(fn: () => void): () => void {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

function changed(): void {
  if (scheduled) return;
  scheduled = true;
  requestAnimationFrame(() => {
    scheduled = false;
    for (const fn of [...listeners]) fn();
  });
}

export async function reload(): Promise<void> {
  const [sb, sn, tp] = await Promise.all([
    call<{ sandboxes: Sandbox[] }>("GET", "/v1/sandboxes?all=true"),
    call<{ snapshots: Snapshot[] }>("GET", "/v1/snapshots"),
    call<{ templates: Template[] }>("GET", "/v1/templates"),
  ]);
  store.sandboxes = new Map(sb.sandboxes.map((s) => [s.sandbox_id, s]));
  store.snapshots = new Map(sn.snapshots.map((s) => [s.snapshot_id, s]));
  store.templates = tp.templates;
  changed();
}

let stop: AbortController | null = null;

/** Follow the event stream until `close()`; reconnects (and reloads) when it drops. */
export async function follow(): Promise<void> {
  close();
  const ctl = new AbortController();
  stop = ctl;
  while (!ctl.signal.aborted) {
    try {
      for await (const ev of events(ctl.signal)) {
        if (ev.event === "ready" || ev.event === "reload") {
          await reload();
          store.live = true;
        } else if (ev.event === "sandbox") {
          store.sandboxes.set(ev.data.sandbox_id, ev.data);
        } else if (ev.event === "snapshot") {
          if (ev.data.state === "deleted") store.snapshots.delete(ev.data.snapshot_id);
          else store.snapshots.set(ev.data.snapshot_id, ev.data);
        }
        changed();
      }
    } catch (e) {
      // a key revoked meanwhile: back to the sign-in (main.ts); else dropped, try again
      if (e instanceof ApiError && e.status === 401) throw e;
    }
    store.live = false;
    changed();
    if (!ctl.signal.aborted) await new Promise((r) => setTimeout(r, 2000));
  }
}

export function close(): void {
  stop?.abort();
  stop = null;
}
