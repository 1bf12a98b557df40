/**
 * The data objects the SDK returns, in camelCase, converted from the REST types generated from
 * openapi.yaml (`src/generated/openapi.ts`). Unknown fields are ignored, so a newer server can
 * add fields without breaking older clients.
 *
 * @module
 */

import type { components } from "./generated/openapi.js";

/** The wire shapes of the REST API, generated from openapi.yaml. */
export type Schemas = components["schemas"];

/** `starting`, `running`, `paused` (its whole state kept; `resume` brings it back), `stopped` or `failed`. */
export type SandboxState = Schemas["SandboxState"];

/** `creating` -> `uploading` -> `ready`, or `failed` (see `error`) or `deleted`. */
export type SnapshotState = Schemas["SnapshotState"];

/** Egress rules of a sandbox, enforced outside the guest. */
export interface NetworkRules {
  /** Destinations (CIDRs or host names) the sandbox may reach; everything else is denied. */
  allowOut?: string[];
  /** Destinations the sandbox may not reach. */
  denyOut?: string[];
}

/** A sandbox as the server describes it. */
export interface SandboxInfo {
  sandboxId: string;
  state: SandboxState;
  /** The template it descends from. */
  template: string | null;
  /** The snapshot it was restored from, if any. */
  snapshotId: string | null;
  /** The parent of a fork child. */
  forkedFrom: string | null;
  memoryMb: number;
  cpus: number;
  env: Record<string, string>;
  metadata: Record<string, string>;
  createdAt: Date | null;
  /** When the sandbox will be killed unless its timeout is extended. */
  expiresAt: Date | null;
  /** Its lifetime in seconds, as last set. */
  timeout: number | null;
  internet: boolean;
  network: NetworkRules | null;
  generation: string | null;
  /** The QEMU process id on the server host. */
  pid: number | null;
  /** Why the sandbox failed, if it did. */
  error: string | null;
  /** The id of the host that runs it (several hosts: `client.hosts.list()`). */
  host: string | null;
  /** At its timeout: killed, or paused. */
  onTimeout: "kill" | "pause";
  /** Whether a pause at its timeout keeps memory (`false`: its filesystem only). */
  pauseMemory: boolean;
  /** Whether a paused sandbox resumes by itself on its next use. */
  autoResume: boolean;
}

/** A snapshot as the server describes it. */
export interface SnapshotInfo {
  snapshotId: string;
  name: string | null;
  state: SnapshotState;
  /** Why the snapshot failed, if it did. */
  error: string | null;
  /** The sandbox it was taken from. */
  sandboxId: string | null;
  template: string | null;
  memoryMb: number | null;
  cpus: number | null;
  createdAt: Date | null;
  readyAt: Date | null;
  /** The snapshot's whole logical size (RAM, device state, disk layer). */
  sizeBytes: number | null;
  /** What it added to the store (compressed chunks no other image held). */
  storedBytes: number | null;
  /** How long the sandbox was stopped for the capture. */
  pauseMs: number | null;
  captureMs: number | null;
  /** `false`: the filesystem only; sandboxes made from it boot from that disk. */
  memory: boolean;
}

/** A built template on the server. */
export interface TemplateInfo {
  name: string;
  hash: string;
  memoryMb: number;
  cpus: number;
  env: Record<string, string>;
  workdir: string | null;
  builtAt: Date | null;
  /** The pinned image reference (or Dockerfile) it was built from; `null` for a spec's. */
  image: string | null;
  /** The user commands run as by default (an image's `USER`); `null`: root. */
  user: string | null;
  /** The image's ENTRYPOINT and CMD, recorded (not run: docs/images.md). */
  entrypoint: string[];
  cmd: string[];
}

/** A process started by a command. */
export interface ProcessInfo {
  pid: number;
  cmd: string;
  user: string;
  running: boolean;
  exitCode: number | null;
  /** Seconds since the epoch, as the guest saw it. */
  startedAt: number;
  /** It runs on a terminal (`sbx.pty`). */
  pty: boolean;
}

/** A file system entry in a sandbox. */
export interface EntryInfo {
  name: string;
  path: string;
  type: "file" | "dir" | "symlink" | "other";
  size: number;
  mode: number;
  owner: string;
  /** Seconds since the epoch. */
  mtime: number;
  /** Where a symlink points. */
  target: string | null;
  /** User metadata given when it was written (`files.write(path, data, { metadata })`). */
  metadata: Record<string, string> | null;
}

/** The outcome of a finished command. */
export interface CommandResult {
  stdout: string;
  stderr: string;
  /** The exit code; 128 + N for a command killed by signal N. */
  exitCode: number;
  /** `exitCode === 0`. */
  ok: boolean;
}

/** One piece of a command's output, as the async iterables yield it. */
export interface OutputChunk {
  stream: "stdout" | "stderr";
  data: string;
}

/** The server's `/health` answer. */
export interface Health {
  status: string;
  version?: string;
  pool?: Record<string, Record<string, number>>;
  [key: string]: unknown;
}

function date(value: string | null | undefined): Date | null {
  return value ? new Date(value) : null;
}

function network(value: Schemas["NetworkSpec"] | null | undefined): NetworkRules | null {
  if (!value) return null;
  return { allowOut: value.allow_out ?? [], denyOut: value.deny_out ?? [] };
}

/** @internal */
export function toSandboxInfo(raw: Schemas["SandboxRecord"]): SandboxInfo {
  return {
    sandboxId: raw.sandbox_id,
    state: raw.state ?? "running",
    template: raw.template ?? null,
    snapshotId: raw.snapshot_id ?? null,
    forkedFrom: raw.forked_from ?? null,
    memoryMb: raw.memory_mb,
    cpus: raw.cpus,
    env: raw.env ?? {},
    metadata: raw.metadata ?? {},
    createdAt: date(raw.created_at),
    expiresAt: date(raw.expires_at),
    timeout: raw.timeout ?? null,
    internet: raw.internet ?? true,
    network: network(raw.network),
    generation: raw.generation || null,
    pid: raw.pid ?? null,
    error: raw.error ?? null,
    host: raw.host ?? null,
    onTimeout: raw.on_timeout ?? "kill",
    pauseMemory: raw.pause_memory ?? true,
    autoResume: raw.auto_resume ?? false,
  };
}

/** A sample of a sandbox's use, taken by its host: `cpuUsedPct` is of its own vCPUs,
 * `memUsed` the memory that is its own on the host, `diskUsed` the bytes its own disk layers
 * hold. */
export interface SandboxMetrics {
  timestamp: Date;
  cpuCount: number;
  cpuUsedPct: number;
  memUsed: number;
  memTotal: number;
  diskUsed: number;
  diskTotal: number;
}

/** @internal */
export function toSandboxMetrics(raw: Schemas["SandboxMetric"]): SandboxMetrics {
  return {
    timestamp: new Date(raw.timestamp * 1000),
    cpuCount: raw.cpu_count,
    cpuUsedPct: raw.cpu_used_pct,
    memUsed: raw.mem_used,
    memTotal: raw.mem_total,
    diskUsed: raw.disk_used,
    diskTotal: raw.disk_total,
  };
}

/** A host of the deployment: `state` is `active`, `draining` (no new sandboxes), `lost`
 * (stopped heartbeating) or `stopped`. */
export interface HostInfo {
  id: string;
  url: string;
  state: Schemas["HostState"];
  cores: number;
  memoryMb: number;
  memoryFreeMb: number;
  diskFreeMb: number;
  cacheFreeMb: number;
  slots: number;
  sandboxes: number;
  heartbeatAgeS: number;
}

/** @internal */
export function toHostInfo(raw: Schemas["HostInfo"]): HostInfo {
  return {
    id: raw.id,
    url: raw.url,
    state: raw.state,
    cores: raw.cores ?? 0,
    memoryMb: raw.memory_mb ?? 0,
    memoryFreeMb: raw.memory_free_mb ?? 0,
    diskFreeMb: raw.disk_free_mb ?? 0,
    cacheFreeMb: raw.cache_free_mb ?? 0,
    slots: raw.slots ?? 0,
    sandboxes: raw.sandboxes ?? 0,
    heartbeatAgeS: raw.heartbeat_age_s ?? 0,
  };
}

/** @internal */
export function toSnapshotInfo(raw: Schemas["SnapshotRecord"]): SnapshotInfo {
  return {
    snapshotId: raw.snapshot_id,
    name: raw.name ?? null,
    state: raw.state ?? "creating",
    error: raw.error ?? null,
    sandboxId: raw.sandbox_id ?? null,
    template: raw.template ?? null,
    memoryMb: raw.memory_mb ?? null,
    cpus: raw.cpus ?? null,
    createdAt: date(raw.created_at),
    readyAt: date(raw.ready_at),
    sizeBytes: raw.size_bytes ?? null,
    storedBytes: raw.stored_bytes ?? null,
    pauseMs: raw.pause_ms ?? null,
    captureMs: raw.capture_ms ?? null,
    memory: raw.memory ?? true,
  };
}

/** @internal */
export function toTemplateInfo(raw: Schemas["TemplateInfo"]): TemplateInfo {
  return {
    name: raw.name,
    hash: raw.hash,
    memoryMb: raw.memory_mb,
    cpus: raw.cpus,
    env: raw.env ?? {},
    workdir: raw.workdir ?? null,
    builtAt: date(raw.built_at),
    image: raw.image ?? null,
    user: raw.user ?? null,
    entrypoint: raw.entrypoint ?? [],
    cmd: raw.cmd ?? [],
  };
}

/** @internal */
export function toProcessInfo(raw: Schemas["ProcessInfo"]): ProcessInfo {
  return {
    pid: raw.pid,
    cmd: raw.cmd,
    user: raw.user,
    running: raw.running,
    exitCode: raw.exit_code ?? null,
    startedAt: raw.started_at,
    pty: raw.pty ?? false,
  };
}

/** @internal */
export function toEntryInfo(raw: Schemas["FileInfo"]): EntryInfo {
  return {
    name: raw.name,
    path: raw.path,
    type: raw.type as EntryInfo["type"],
    size: raw.size,
    mode: raw.mode,
    owner: raw.owner,
    mtime: raw.mtime,
    target: raw.target ?? null,
    metadata: raw.metadata ?? null,
  };
}

/** @internal */
export function commandResult(stdout: string, stderr: string, exitCode: number): CommandResult {
  return { stdout, stderr, exitCode, ok: exitCode === 0 };
}
