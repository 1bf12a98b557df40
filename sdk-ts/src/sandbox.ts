/**
 * Sandboxes and snapshots.
 *
 * @module
 */

import { Commands } from "./commands.js";
import { Terminals } from "./terminals.js";
import { InvalidArgumentError, NotFoundError, SandlotError, SnapshotFailedError, WaitTimeoutError, errorFromPayload } from "./errors.js";
import { Files } from "./files.js";
import { Api, seconds, seg, strMap, type ConnectionOptions } from "./http.js";
import {
  toSandboxInfo,
  toSandboxMetrics,
  toSnapshotInfo,
  type SandboxMetrics,
  type NetworkRules,
  type SandboxInfo,
  type Schemas,
  type SnapshotInfo,
  type SnapshotState,
} from "./models.js";

/** Options of {@link Sandbox.create}. */
export interface SandboxCreateOptions {
  /** The template to start from (default `"base"`); ignored with `snapshotId`. */
  template?: string;
  /** Restore this snapshot (id or name) instead of starting from a template. */
  snapshotId?: string;
  /**
   * Start from this OCI image instead (`"python:3.12-slim"`, `"registry:5000/team/app@sha256:..."`):
   * the server pulls it and builds a template from it on first use (by digest; minutes for a
   * large image, so the call waits up to {@link IMAGE_BUILD_TIMEOUT_MS}), later creates are
   * restores like any other. @throws {ImageError} for a bad reference,
   * {@link ImageNotFoundError} for an image its registry does not have.
   */
  image?: string;
  /** Memory in MiB; default the template's (or snapshot's). */
  memoryMb?: number;
  /** vCPUs; default the template's (or snapshot's). */
  cpus?: number;
  /** Environment of every command. */
  env?: Record<string, string>;
  /** The sandbox is killed this many ms after creation unless extended (default 300 000). */
  timeoutMs?: number;
  /** Free-form labels; {@link Sandbox.list} filters by them. */
  metadata?: Record<string, string>;
  /** Outbound network access with DNS (default `true`). */
  internet?: boolean;
  /** Egress allow/deny rules. */
  network?: NetworkRules;
  /** At its timeout: `"kill"` (default) or `"pause"` (its whole state kept; `resume` brings
   * it back). */
  onTimeout?: "kill" | "pause";
  /** A pause at its timeout keeps memory and processes (default `true`); `false`: its
   * filesystem only, and the resume boots it from its disk. */
  pauseMemory?: boolean;
  /** A paused sandbox resumes by itself on the next command, file operation or fork. */
  autoResume?: boolean;
}

/** Options of {@link Sandbox.createSnapshot}. */
export interface SnapshotOptions {
  /** A unique name (`name` or `name:tag`) to restore it by. */
  name?: string;
  /** Keep memory and processes (default `true`); `false`: the filesystem only. */
  memory?: boolean;
}

/** Overrides of {@link Snapshot.restoreWith}. */
export interface RestoreOptions {
  /** Recorded as the new sandbox's `name` metadata. */
  name?: string;
  /** Memory in MiB; may only grow the snapshot's. */
  memoryMb?: number;
  cpus?: number;
  /** Merged into the environment of later commands. */
  env?: Record<string, string>;
  /** The new sandbox's lifetime in ms. */
  timeoutMs?: number;
  metadata?: Record<string, string>;
  internet?: boolean;
  network?: NetworkRules;
  onTimeout?: "kill" | "pause";
  pauseMemory?: boolean;
  autoResume?: boolean;
}

/** Options of {@link Sandbox.setNetwork}; an omitted setting stays as it is. */
export interface NetworkUpdate {
  internet?: boolean;
  allowOut?: string[];
  denyOut?: string[];
}

function wireNetwork(rules: NetworkRules | undefined): Schemas["NetworkSpec"] | null {
  if (!rules) return null;
  return { allow_out: rules.allowOut ?? [], deny_out: rules.denyOut ?? [] };
}

/** How long a create from an image may take: the first one pulls and builds it. */
const IMAGE_BUILD_TIMEOUT_MS = 1_800_000;

/** @internal The HTTP timeout of a create: the connection's, or longer for an image. */
export function createTimeout(options: SandboxCreateOptions): number | undefined {
  return options.image ? IMAGE_BUILD_TIMEOUT_MS : undefined;
}

/** @internal */
export function createRequest(options: SandboxCreateOptions): Schemas["CreateSandbox"] {
  return {
    template: options.snapshotId || options.image ? null : options.template ?? "base",
    snapshot_id: options.snapshotId ?? null,
    image: options.image ?? null,
    memory_mb: options.memoryMb ?? null,
    cpus: options.cpus ?? null,
    env: strMap(options.env, "env") ?? {},
    timeout: seconds(options.timeoutMs ?? 300_000) ?? null,
    metadata: strMap(options.metadata, "metadata") ?? {},
    internet: options.internet ?? true,
    network: wireNetwork(options.network),
    on_timeout: options.onTimeout ?? "kill",
    pause_memory: options.pauseMemory ?? true,
    auto_resume: options.autoResume ?? false,
  };
}

/** @internal */
export function restoreRequest(options: RestoreOptions): Schemas["RestoreBody"] {
  return {
    name: options.name ?? null,
    memory_mb: options.memoryMb ?? null,
    cpus: options.cpus ?? null,
    env: strMap(options.env, "env") ?? null,
    timeout: seconds(options.timeoutMs) ?? null,
    metadata: strMap(options.metadata, "metadata") ?? null,
    internet: options.internet ?? true,
    network: wireNetwork(options.network),
    on_timeout: options.onTimeout ?? "kill",
    pause_memory: options.pauseMemory ?? true,
    auto_resume: options.autoResume ?? false,
  };
}

function forkList(api: Api, data: Schemas["ForkResult"] | undefined): ForkList {
  const children = (data?.sandboxes ?? []).map((raw) => new Sandbox(api, toSandboxInfo(raw)));
  const errors = [...(data?.errors ?? [])]
    .sort((a, b) => a.index - b.index)
    .map((item) => {
      const error = errorFromPayload(item.error);
      error.message = `fork child ${item.index}: ${error.message}`;
      return error;
    });
  if (errors.length > 0 && children.length === 0) throw errors[0];
  return ForkList.of_(children, errors, data?.pause_ms ?? null);
}

/** @internal */
export function snapshotRef(snapshot: Snapshot | SnapshotInfo | string): string {
  const ref = typeof snapshot === "string" ? snapshot : snapshot?.snapshotId;
  if (typeof ref !== "string" || !ref) {
    throw new InvalidArgumentError("expected a snapshot, a snapshot id or a name");
  }
  return ref;
}

/**
 * The children of a fork: an array of the sandboxes that started, with `errors` holding one
 * error per child that failed to (its message names the child's index) and `pauseMs`, how long
 * the parent was paused for their capture.
 */
export class ForkList extends Array<Sandbox> {
  /** One error per child that failed to start. */
  errors: SandlotError[] = [];
  /** How long the parent was paused for the capture, in ms. */
  pauseMs: number | null = null;

  // Array methods (map, filter, ...) return plain arrays.
  static override get [Symbol.species](): ArrayConstructor {
    return Array;
  }

  /** @internal */
  static of_(children: Sandbox[], errors: SandlotError[], pauseMs: number | null): ForkList {
    const list = new ForkList();
    list.push(...children);
    list.errors = errors;
    list.pauseMs = pauseMs;
    return list;
  }
}

/**
 * A running microVM sandbox.
 *
 * ```ts
 * await using sbx = await Sandbox.create({ env: { MODE: "test" } });
 * const { stdout } = await sbx.commands.run("echo hi");
 * ```
 *
 * Leaving the `await using` scope kills the sandbox (so does {@link Sandbox.kill}).
 */
export class Sandbox {
  /** The sandbox's id (`sb-...`). */
  readonly sandboxId: string;
  /** Run commands and manage their processes. */
  readonly commands: Commands;
  /** Terminals: an interactive shell, or any command, on a pseudo-terminal. */
  readonly pty: Terminals;
  /** The sandbox's file system. */
  readonly files: Files;
  private _info: SandboxInfo;

  /** @internal */
  constructor(
    private readonly api: Api,
    info: SandboxInfo,
  ) {
    this._info = info;
    this.sandboxId = info.sandboxId;
    this.commands = new Commands(api, info.sandboxId);
    this.pty = new Terminals(api, info.sandboxId);
    this.files = new Files(api, info.sandboxId);
  }

  /** The last {@link SandboxInfo} the server sent ({@link Sandbox.getInfo} fetches a fresh one). */
  get info(): SandboxInfo {
    return this._info;
  }

  /**
   * Start a sandbox from a template (default `"base"`), or restore one from `snapshotId`. A
   * create is a restore of the template's boot snapshot (often a claim from a warm pool), never
   * a boot. The server is `apiUrl`/`apiKey`, defaulting to env `SANDLOT_URL`/`SANDLOT_API_KEY`.
   */
  static async create(options: SandboxCreateOptions & ConnectionOptions = {}): Promise<Sandbox> {
    const api = new Api(options);
    const data = await api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: "/v1/sandboxes",
      json: createRequest(options),
      timeoutMs: createTimeout(options),
    });
    return new Sandbox(api, toSandboxInfo(data));
  }

  /** Attach to an existing sandbox. @throws {NotFoundError} if it is unknown or gone. */
  static async connect(sandboxId: string, options: ConnectionOptions = {}): Promise<Sandbox> {
    const api = new Api(options);
    const data = await api.call<Schemas["SandboxRecord"]>({ method: "GET", path: `/v1/sandboxes/${seg(sandboxId)}` });
    return new Sandbox(api, toSandboxInfo(data));
  }

  /**
   * Running and paused sandboxes whose metadata contains every pair of `metadata`
   * (`includeStopped`: stopped ones too).
   */
  static async list(
    options: { metadata?: Record<string, string>; includeStopped?: boolean } & ConnectionOptions = {},
  ): Promise<SandboxInfo[]> {
    return listSandboxes(new Api(options), options);
  }

  /** Fetch the sandbox's current {@link SandboxInfo}. */
  async getInfo(): Promise<SandboxInfo> {
    const data = await this.api.call<Schemas["SandboxRecord"]>({ method: "GET", path: `/v1/sandboxes/${seg(this.sandboxId)}` });
    this._info = toSandboxInfo(data);
    return this._info;
  }

  /** The sandbox's CPU, memory and disk use over time, sampled by its host (every 5 s by
   * default, the last hour kept), between `start` and `end`. */
  async getMetrics(options: { start?: Date; end?: Date } = {}): Promise<SandboxMetrics[]> {
    const query: Record<string, string> = {};
    if (options.start) query.start = String(options.start.getTime() / 1000);
    if (options.end) query.end = String(options.end.getTime() / 1000);
    const data = await this.api.call<Schemas["MetricList"]>({
      method: "GET",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/metrics`,
      query,
    });
    return (data?.metrics ?? []).map(toSandboxMetrics);
  }

  /** `true` if the sandbox exists and is `running`. */
  async isRunning(): Promise<boolean> {
    try {
      return (await this.getInfo()).state === "running";
    } catch (error) {
      if (error instanceof NotFoundError) return false;
      throw error;
    }
  }

  /** Kill the sandbox `timeoutMs` from now instead of at its current deadline. */
  async setTimeout(timeoutMs: number): Promise<void> {
    const timeout = seconds(timeoutMs);
    if (timeout === undefined || timeout === null) throw new InvalidArgumentError("timeoutMs is required");
    const data = await this.api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/timeout`,
      json: { timeout } satisfies Schemas["TimeoutBody"],
    });
    this._info = toSandboxInfo(data);
  }

  /** `host:port` at which the server's host reaches `port` inside the sandbox. */
  async getHost(port: number): Promise<string> {
    if (!Number.isInteger(port) || port < 1 || port > 65535) {
      throw new InvalidArgumentError(`port must be an integer in 1..65535, got ${String(port)}`);
    }
    const data = await this.api.call<Schemas["ExposedPort"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/ports`,
      json: { port } satisfies Schemas["PortBody"],
    });
    return String(data.address);
  }

  /** Change the egress rules of the running sandbox (an omitted setting stays as it is). */
  async setNetwork(update: NetworkUpdate): Promise<void> {
    const data = await this.api.call<Schemas["SandboxRecord"]>({
      method: "PUT",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/network`,
      json: {
        internet: update.internet ?? null,
        allow_out: update.allowOut ?? null,
        deny_out: update.denyOut ?? null,
      } satisfies Schemas["NetworkBody"],
    });
    this._info = toSandboxInfo(data);
  }

  /** Stop the sandbox. `true` if this call killed it, `false` if it was already gone. */
  async kill(): Promise<boolean> {
    return killSandbox(this.api, this.sandboxId);
  }

  /** Alias of {@link Sandbox.kill}. */
  async destroy(): Promise<boolean> {
    return this.kill();
  }

  /** Kills the sandbox at the end of an `await using` scope. */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.kill();
  }

  /**
   * Snapshot the sandbox: memory, CPU and device state, disk. The sandbox pauses for
   * milliseconds and keeps running. Resolves once its state is captured, so the snapshot holds
   * the sandbox as it was at this call and nothing done after it; compressing and storing go on
   * in the background (state `uploading`; {@link Snapshot.wait} waits until it is `ready`).
   * With `memory: false` only its filesystem is kept (synced first, no pause, smaller):
   * sandboxes made from it boot from that disk, without its processes.
   *
   * @throws {SnapshotFailedError} if the capture fails.
   */
  async createSnapshot(options: SnapshotOptions = {}): Promise<Snapshot> {
    const data = await this.api.call<Schemas["SnapshotRecord"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/snapshots`,
      json: { name: options.name ?? null, memory: options.memory ?? true } satisfies Schemas["SnapshotBody"],
    });
    const snap = new Snapshot(this.api, toSnapshotInfo(data));
    // The server answers before the capture has begun (it runs in the background), so a
    // command sent right after could land in the snapshot: wait until it is captured.
    let delay = 10;
    while (snap.state === "creating") {
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 200);
      await snap.refresh();
    }
    if (snap.state === "failed" || snap.state === "deleted") {
      throw new SnapshotFailedError(`snapshot ${snap.snapshotId} failed: ${snap.error ?? snap.state}`, {
        snapshotId: snap.snapshotId,
      });
    }
    return snap;
  }

  /** Alias of {@link Sandbox.createSnapshot}. */
  async snapshot(options: SnapshotOptions = {}): Promise<Snapshot> {
    return this.createSnapshot(options);
  }

  /**
   * Start `count` (default 1) copy-on-write copies of this running sandbox; it is untouched.
   * Each child succeeds or fails on its own: the list holds those that started and its
   * `errors` the failures. If every child failed, the first error is thrown.
   *
   * ```ts
   * const [child] = await sbx.fork();
   * ```
   */
  async fork(count = 1): Promise<ForkList> {
    if (!Number.isInteger(count) || count < 1) {
      throw new InvalidArgumentError(`count must be a positive integer, got ${String(count)}`);
    }
    const data = await this.api.call<Schemas["ForkResult"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/fork`,
      json: { count } satisfies Schemas["ForkBody"],
    });
    return forkList(this.api, data);
  }

  /**
   * Keep the sandbox's whole state (memory, processes, files) and stop its VM; {@link
   * Sandbox.resume} brings it back exactly where it was, under the same id. With `memory:
   * false` only its files are kept, and the resume boots it from its disk (default: as the
   * sandbox was created, `pauseMemory`). Returns once the state is stored.
   */
  async pause(options: { memory?: boolean } = {}): Promise<void> {
    const data = await this.api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/pause`,
      ...(options.memory === undefined
        ? {}
        : { json: { memory: options.memory } satisfies Schemas["PauseBody"] }),
    });
    this._info = toSandboxInfo(data);
  }

  /**
   * Bring a paused sandbox back (with a new lifetime `timeoutMs` if given); returns this.
   * With `reboot: true` it boots from its disk as it was at the pause instead of resuming
   * its memory.
   */
  async resume(options: { timeoutMs?: number; reboot?: boolean } = {}): Promise<this> {
    const data = await this.api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/resume`,
      json: {
        timeout: seconds(options.timeoutMs) ?? null,
        reboot: options.reboot ?? false,
      } satisfies Schemas["ResumeBody"],
    });
    this._info = toSandboxInfo(data);
    return this;
  }

  /** Reset this sandbox to `snapshot` (object, id or name); it keeps its id. Returns this. */
  async rollback(snapshot: Snapshot | SnapshotInfo | string): Promise<this> {
    const data = await this.api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/rollback`,
      json: { snapshot_id: snapshotRef(snapshot) } satisfies Schemas["RollbackBody"],
    });
    this._info = toSandboxInfo(data);
    return this;
  }
}

/** How long the server may hold one snapshot wait request, in seconds. */
const LONG_POLL_S = 30;

/** A snapshot of a sandbox (memory, devices and disk), restorable into new sandboxes. */
export class Snapshot {
  private _info: SnapshotInfo;

  /** @internal */
  constructor(
    private readonly api: Api,
    info: SnapshotInfo,
  ) {
    this._info = info;
  }

  /** The last {@link SnapshotInfo} the server sent (see {@link Snapshot.refresh}). */
  get info(): SnapshotInfo {
    return this._info;
  }

  /** The snapshot's id (`snap-...`). */
  get snapshotId(): string {
    return this._info.snapshotId;
  }

  /** The snapshot's name, if it has one. */
  get name(): string | null {
    return this._info.name;
  }

  /** `creating`, `uploading`, `ready`, `failed` or `deleted`, as last seen. */
  get state(): SnapshotState {
    return this._info.state;
  }

  /** Why the snapshot failed, if it did. */
  get error(): string | null {
    return this._info.error;
  }

  /** Look a snapshot up by id or name. @throws {NotFoundError} if there is none. */
  static async get(nameOrId: string, options: ConnectionOptions = {}): Promise<Snapshot> {
    const api = new Api(options);
    return new Snapshot(api, await getSnapshotInfo(api, nameOrId));
  }

  /** Every snapshot that is not deleted, optionally only those of `sandboxId`. */
  static async list(options: { sandboxId?: string } & ConnectionOptions = {}): Promise<SnapshotInfo[]> {
    return listSnapshots(new Api(options), options.sandboxId);
  }

  /**
   * Delete the snapshot with this id or name; `false` if there was none. Its stored chunks go
   * at the next store GC once nothing else uses them.
   */
  static async delete(nameOrId: string, options: ConnectionOptions = {}): Promise<boolean> {
    return deleteSnapshot(new Api(options), nameOrId);
  }

  /** Fetch the snapshot's current state; returns this. */
  async refresh(): Promise<this> {
    this._info = await getSnapshotInfo(this.api, this.snapshotId);
    return this;
  }

  /**
   * Wait until the snapshot is `ready`; returns this. The server answers the moment it is (no
   * polling interval to wait out).
   *
   * @param options.timeoutMs give up after this long (default 120 000; `null`: never).
   * @throws {SnapshotFailedError} if it fails or is deleted.
   * @throws {WaitTimeoutError} after `timeoutMs`; the snapshot may still become ready.
   */
  async wait(options: { timeoutMs?: number | null } = {}): Promise<this> {
    const timeoutMs = options.timeoutMs === undefined ? 120_000 : options.timeoutMs;
    const deadline = timeoutMs === null ? null : Date.now() + timeoutMs;
    while (!snapshotDone(this._info)) {
      let step = LONG_POLL_S;
      if (deadline !== null) {
        const left = deadline - Date.now();
        if (left <= 0) {
          throw new WaitTimeoutError(`snapshot ${this.snapshotId} still ${this.state} after ${timeoutMs} ms`);
        }
        step = Math.min(LONG_POLL_S, left / 1000);
      }
      const data = await this.api.call<Schemas["SnapshotRecord"]>({
        method: "POST",
        path: `/v1/snapshots/${seg(this.snapshotId)}/wait`,
        query: { timeout: Math.round(step * 1000) / 1000 },
        timeoutMs: (step + 30) * 1000,
      });
      this._info = toSnapshotInfo(data);
    }
    return this;
  }

  /** Start a new sandbox from this snapshot with its own settings. */
  async restore(options: { name?: string } = {}): Promise<Sandbox> {
    return this.restoreWith(options);
  }

  /** Start a new sandbox from this snapshot, overriding some of its settings. */
  async restoreWith(options: RestoreOptions = {}): Promise<Sandbox> {
    return restoreSnapshot(this.api, this.snapshotId, options);
  }

  /**
   * Start `count` (default 1) independent sandboxes from this snapshot at once, no running
   * parent needed (in a deployment, spread over the hosts with room), each with the settings
   * given. Each child succeeds or fails on its own: the list holds those that started and its
   * `errors` the failures. If every child failed, the first error is thrown.
   *
   * ```ts
   * const children = await snap.fork(8, { env: { TRIAL: "1" } });
   * ```
   */
  async fork(count = 1, options: Omit<RestoreOptions, "name"> = {}): Promise<ForkList> {
    if (!Number.isInteger(count) || count < 1) {
      throw new InvalidArgumentError(`count must be a positive integer, got ${String(count)}`);
    }
    const { name: _name, ...body } = restoreRequest(options);
    const data = await this.api.call<Schemas["ForkResult"]>({
      method: "POST",
      path: `/v1/snapshots/${seg(this.snapshotId)}/fork`,
      json: { ...body, count } satisfies Schemas["SnapshotForkBody"],
    });
    return forkList(this.api, data);
  }

  /** Give the snapshot `name` (it survives its sandbox under it); returns this. @throws {ConflictError} if taken. */
  async saveNamed(name: string): Promise<this> {
    if (typeof name !== "string" || !name) throw new InvalidArgumentError("snapshot name must be a non-empty string");
    const data = await this.api.call<Schemas["SnapshotRecord"]>({
      method: "PATCH",
      path: `/v1/snapshots/${seg(this.snapshotId)}`,
      json: { name },
    });
    this._info = toSnapshotInfo(data);
    return this;
  }

  /** Delete this snapshot; `false` if it was already gone. */
  async remove(): Promise<boolean> {
    return deleteSnapshot(this.api, this.snapshotId);
  }
}

function snapshotDone(info: SnapshotInfo): boolean {
  if (info.state === "ready") return true;
  if (info.state === "failed" || info.state === "deleted") {
    const detail = info.error ?? `snapshot is ${info.state}`;
    throw new SnapshotFailedError(`snapshot ${info.snapshotId} failed: ${detail}`, { snapshotId: info.snapshotId });
  }
  return false;
}

/** @internal */
export async function listSandboxes(
  api: Api,
  options: { metadata?: Record<string, string>; includeStopped?: boolean },
): Promise<SandboxInfo[]> {
  const metadata = strMap(options.metadata, "metadata");
  const data = await api.call<Schemas["SandboxList"]>({
    method: "GET",
    path: "/v1/sandboxes",
    query: {
      metadata: metadata && Object.keys(metadata).length ? JSON.stringify(metadata) : undefined,
      all: options.includeStopped ? "true" : undefined,
    },
  });
  return (data?.sandboxes ?? []).map(toSandboxInfo);
}

/** @internal */
export async function killSandbox(api: Api, sandboxId: string): Promise<boolean> {
  try {
    await api.call({ method: "DELETE", path: `/v1/sandboxes/${seg(sandboxId)}` });
    return true;
  } catch (error) {
    if (error instanceof NotFoundError) return false;
    throw error;
  }
}

/** @internal */
export async function getSnapshotInfo(api: Api, nameOrId: string): Promise<SnapshotInfo> {
  return toSnapshotInfo(await api.call<Schemas["SnapshotRecord"]>({ method: "GET", path: `/v1/snapshots/${seg(nameOrId)}` }));
}

/** @internal */
export async function listSnapshots(api: Api, sandboxId?: string): Promise<SnapshotInfo[]> {
  const data = await api.call<Schemas["SnapshotList"]>({
    method: "GET",
    path: "/v1/snapshots",
    query: { sandbox_id: sandboxId },
  });
  return (data?.snapshots ?? []).map(toSnapshotInfo);
}

/** @internal */
export async function deleteSnapshot(api: Api, nameOrId: string): Promise<boolean> {
  try {
    await api.call({ method: "DELETE", path: `/v1/snapshots/${seg(nameOrId)}` });
    return true;
  } catch (error) {
    if (error instanceof NotFoundError) return false;
    throw error;
  }
}

/** @internal */
export async function restoreSnapshot(api: Api, nameOrId: string, options: RestoreOptions): Promise<Sandbox> {
  const data = await api.call<Schemas["SandboxRecord"]>({
    method: "POST",
    path: `/v1/snapshots/${seg(nameOrId)}/restore`,
    json: restoreRequest(options),
  });
  return new Sandbox(api, toSandboxInfo(data));
}
