/**
 * The sandlot TypeScript SDK: sandboxes (QEMU microVMs), their commands and files, snapshots,
 * restores, forks and rollbacks, against a sandlot server's REST API.
 *
 * ```ts
 * import { Sandbox } from "sandlot";
 *
 * await using sbx = await Sandbox.create({ env: { MODE: "test" } });
 * await sbx.commands.run("pip install --user rich", { timeoutMs: 300_000 });
 * const snap = await sbx.createSnapshot({ name: "with-rich" });
 * const children = await sbx.fork(3);
 * await snap.wait();
 * const restored = await snap.restoreWith({ memoryMb: 1024, env: { MODE: "prod" } });
 * ```
 *
 * Configured by env `SANDLOT_URL` / `SANDLOT_API_KEY`, or the {@link ConnectionOptions} every
 * entry point takes. Every error is a {@link SandlotError}.
 *
 * @packageDocumentation
 */

export { Hosts, Sandlot, Sandboxes, Snapshots, Templates } from "./client.js";
export { ForkList, Sandbox, Snapshot } from "./sandbox.js";
export type { NetworkUpdate, RestoreOptions, SandboxCreateOptions, SnapshotOptions } from "./sandbox.js";
export { CommandHandle, CommandOutput, Commands } from "./commands.js";
export type { OutputCallback, RunOptions, StartOptions, WaitOptions } from "./commands.js";
export { DEFAULT_SHELL, Terminal, Terminals } from "./terminals.js";
export type { TerminalOptions, TerminalSize } from "./terminals.js";
export { Files } from "./files.js";
export type { ReadFormat, WriteData } from "./files.js";
export { DEFAULT_URL } from "./http.js";
export type { ConnectionOptions } from "./http.js";
export type {
  CommandResult,
  EntryInfo,
  Health,
  HostInfo,
  NetworkRules,
  OutputChunk,
  ProcessInfo,
  SandboxInfo,
  SandboxMetrics,
  SandboxState,
  Schemas,
  SnapshotInfo,
  SnapshotState,
  TemplateInfo,
} from "./models.js";
export {
  AuthenticationError,
  PermissionDeniedError,
  BuildError,
  BuildStepError,
  CapacityError,
  CommandExitError,
  CommandTimeoutError,
  ConflictError,
  ERRORS,
  type ErrorClass,
  GuestError,
  HostUnavailableError,
  ImageError,
  ImageNotFoundError,
  InvalidArgumentError,
  InvalidStateError,
  NotFoundError,
  PayloadTooLargeError,
  SandboxError,
  SandlotError,
  SnapshotFailedError,
  StorageError,
  VmmError,
  WaitTimeoutError,
  errorFromPayload,
  errorFromResponse,
} from "./errors.js";
