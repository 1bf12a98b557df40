/**
 * The {@link Sandlot} client object: one connection (URL, key, fetch) shared by everything made
 * through it.
 *
 * @module
 */

import { InvalidArgumentError } from "./errors.js";
import { Api, seg, type ConnectionOptions } from "./http.js";
import {
  toHostInfo,
  toSandboxInfo,
  toTemplateInfo,
  type Health,
  type HostInfo,
  type SandboxInfo,
  type Schemas,
  type SnapshotInfo,
  type TemplateInfo,
} from "./models.js";
import {
  Sandbox,
  Snapshot,
  createRequest,
  createTimeout,
  deleteSnapshot,
  getSnapshotInfo,
  killSandbox,
  listSandboxes,
  listSnapshots,
  restoreSnapshot,
  type RestoreOptions,
  type SandboxCreateOptions,
} from "./sandbox.js";

/** `client.sandboxes`. */
export class Sandboxes {
  /** @internal */
  constructor(private readonly api: Api) {}

  /** Start a sandbox; see {@link Sandbox.create}. */
  async create(options: SandboxCreateOptions = {}): Promise<Sandbox> {
    const data = await this.api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: "/v1/sandboxes",
      json: createRequest(options),
      timeoutMs: createTimeout(options),
    });
    return new Sandbox(this.api, toSandboxInfo(data));
  }

  /** Attach to an existing sandbox. @throws {NotFoundError} if it is unknown or gone. */
  async connect(sandboxId: string): Promise<Sandbox> {
    return new Sandbox(this.api, await this.getInfo(sandboxId));
  }

  /** The {@link SandboxInfo} of `sandboxId`. */
  async getInfo(sandboxId: string): Promise<SandboxInfo> {
    return toSandboxInfo(await this.api.call<Schemas["SandboxRecord"]>({ method: "GET", path: `/v1/sandboxes/${seg(sandboxId)}` }));
  }

  /** Sandboxes whose metadata contains every pair of `metadata`; see {@link Sandbox.list}. */
  async list(options: { metadata?: Record<string, string>; includeStopped?: boolean } = {}): Promise<SandboxInfo[]> {
    return listSandboxes(this.api, options);
  }

  /** Stop `sandboxId`; `false` if it was already gone. */
  async kill(sandboxId: string): Promise<boolean> {
    return killSandbox(this.api, sandboxId);
  }

  /** Pause `sandboxId` (see {@link Sandbox.pause}). */
  async pause(sandboxId: string, options: { memory?: boolean } = {}): Promise<SandboxInfo> {
    return toSandboxInfo(await this.api.call<Schemas["SandboxRecord"]>({
      method: "POST",
      path: `/v1/sandboxes/${seg(sandboxId)}/pause`,
      ...(options.memory === undefined ? {} : { json: { memory: options.memory } }),
    }));
  }

  /** Resume a paused sandbox; the running sandbox. */
  async resume(sandboxId: string, options: { timeoutMs?: number; reboot?: boolean } = {}): Promise<Sandbox> {
    const sandbox = new Sandbox(this.api, await this.getInfo(sandboxId));
    return sandbox.resume(options);
  }
}

/** `client.snapshots`. */
export class Snapshots {
  /** @internal */
  constructor(private readonly api: Api) {}

  /** Look a snapshot up by id or name. @throws {NotFoundError} if there is none. */
  async get(nameOrId: string): Promise<Snapshot> {
    return new Snapshot(this.api, await getSnapshotInfo(this.api, nameOrId));
  }

  /** Every snapshot that is not deleted, optionally only those of `sandboxId`. */
  async list(options: { sandboxId?: string } = {}): Promise<SnapshotInfo[]> {
    return listSnapshots(this.api, options.sandboxId);
  }

  /** Delete a snapshot by id or name; `false` if there was none. */
  async delete(nameOrId: string): Promise<boolean> {
    return deleteSnapshot(this.api, nameOrId);
  }

  /**
   * Restore `snapshotId` (id or name) into a new, independent sandbox: N restores, N sandboxes.
   *
   * `sandboxId` does not change the target: a restore always makes a new sandbox. When given,
   * it must be the sandbox the snapshot was taken from ({@link InvalidArgumentError} otherwise);
   * pass `null` to skip that check.
   */
  async restore(sandboxId: string | null, snapshotId: string, options: RestoreOptions = {}): Promise<Sandbox> {
    if (sandboxId !== null && sandboxId !== undefined) {
      const info = await getSnapshotInfo(this.api, snapshotId);
      if (info.sandboxId !== null && info.sandboxId !== sandboxId) {
        throw new InvalidArgumentError(`snapshot ${info.snapshotId} was taken from ${info.sandboxId}, not ${sandboxId}`);
      }
    }
    return restoreSnapshot(this.api, snapshotId, options);
  }
}

/** `client.templates`. Templates are built on the server host with `sandlot template build`. */
export class Templates {
  /** @internal */
  constructor(private readonly api: Api) {}

  /** The templates the server can start sandboxes from. */
  async list(): Promise<TemplateInfo[]> {
    const data = await this.api.call<Schemas["TemplateList"]>({ method: "GET", path: "/v1/templates" });
    return (data?.templates ?? []).map(toTemplateInfo);
  }

  /** The template called `name`. */
  async get(name: string): Promise<TemplateInfo> {
    return toTemplateInfo(await this.api.call<Schemas["TemplateInfo"]>({ method: "GET", path: `/v1/templates/${seg(name)}` }));
  }
}

/** `client.hosts`: the hosts of a deployment (one, unless servers share a database). */
export class Hosts {
  /** @internal */
  constructor(private readonly api: Api) {}

  /** Every host, with its state, capacity and load. */
  async list(): Promise<HostInfo[]> {
    const data = await this.api.call<Schemas["HostList"]>({ method: "GET", path: "/v1/hosts" });
    return (data?.hosts ?? []).map(toHostInfo);
  }

  /** No new sandboxes go to the host; those it runs run to their end. */
  async drain(hostId: string): Promise<HostInfo> {
    return toHostInfo(await this.api.call<Schemas["HostInfo"]>({ method: "POST", path: `/v1/hosts/${seg(hostId)}/drain` }));
  }

  /** A drained host takes new sandboxes again. */
  async activate(hostId: string): Promise<HostInfo> {
    return toHostInfo(await this.api.call<Schemas["HostInfo"]>({ method: "POST", path: `/v1/hosts/${seg(hostId)}/activate` }));
  }
}

/**
 * A connection to a sandlot server. `apiUrl`/`apiKey` default to env `SANDLOT_URL` (else
 * `http://127.0.0.1:7070`) and `SANDLOT_API_KEY`.
 *
 * ```ts
 * const client = new Sandlot();
 * const sbx = await client.sandboxes.create();
 * const copy = await client.snapshots.restore(sbx.sandboxId, (await sbx.snapshot()).snapshotId);
 * ```
 */
export class Sandlot {
  readonly sandboxes: Sandboxes;
  readonly snapshots: Snapshots;
  readonly templates: Templates;
  readonly hosts: Hosts;
  private readonly api: Api;

  constructor(options: ConnectionOptions = {}) {
    this.api = new Api(options);
    this.sandboxes = new Sandboxes(this.api);
    this.snapshots = new Snapshots(this.api);
    this.templates = new Templates(this.api);
    this.hosts = new Hosts(this.api);
  }

  /** The server's base URL. */
  get apiUrl(): string {
    return this.api.apiUrl;
  }

  /** `GET /health`: `{status: "ok", version, pool}`. */
  async health(): Promise<Health> {
    return this.api.call<Health>({ method: "GET", path: "/health" });
  }
}
