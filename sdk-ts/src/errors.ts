/**
 * sandlot's error tree, the same as the Python SDK's (`sandlot.errors`):
 *
 * ```text
 * SandlotError                      connection failures too (the cause is kept)
 * ├── InvalidArgumentError   400    bad input: the caller's fault, retrying won't help
 * │   └── ImageError            400  an image reference, registry answer or Dockerfile
 * │       │                          sandlot cannot use
 * │       └── BuildStepError    400  a Dockerfile instruction failed (its output attached)
 * ├── AuthenticationError    401    missing or wrong API key
 * │   └── PermissionDeniedError 403  a valid key that may not make the call (an admin's)
 * ├── NotFoundError          404    unknown sandbox, snapshot, template, process or path
 * │   └── ImageNotFoundError    404  no such image (repository or tag) in its registry
 * ├── ConflictError          409    a name already taken
 * ├── InvalidStateError      409    the object is not in a state that allows the call
 * ├── CommandTimeoutError    504    a command ran past its timeout and was killed
 * ├── SandboxError           502    the sandbox failed (guest agent or VMM)
 * │   ├── GuestError                the in-guest agent failed or went away
 * │   ├── VmmError                  QEMU failed to start, load or answer
 * │   └── SnapshotFailedError       a snapshot being waited on ended failed or deleted
 * ├── StorageError           500    snapshot data missing, corrupt, or not writable
 * ├── BuildError             500    a template build step failed
 * ├── CommandExitError              `check: true` and the command exited non-zero
 * └── WaitTimeoutError              a client-side wait (e.g. `Snapshot.wait`) ran out of time
 * ```
 *
 * The server answers every error with `{"error": {"type", "message"}}`; the SDK throws the
 * class named by `type` (see {@link errorFromPayload}).
 *
 * @module
 */

import type { CommandResult } from "./models.js";

/** Root of every error the SDK throws. `status` is the HTTP status the server answered with. */
export class SandlotError extends Error {
  /** The HTTP status of the answer, or of the class when the error came from elsewhere. */
  status: number;

  constructor(message = "", options?: { cause?: unknown; status?: number }) {
    super(message, options?.cause !== undefined ? { cause: options.cause } : undefined);
    this.name = new.target.name;
    this.status = options?.status ?? (new.target as unknown as { defaultStatus: number }).defaultStatus;
  }

  /** The status a class stands for when no HTTP answer says otherwise. */
  static defaultStatus = 500;
}

/** Bad input: the caller's fault; retrying won't help. */
export class InvalidArgumentError extends SandlotError {
  static override defaultStatus = 400;
}

/** A request body over the server's size limit. */
export class PayloadTooLargeError extends InvalidArgumentError {
  static override defaultStatus = 413;
}

/** An OCI image or Dockerfile sandlot cannot use: a malformed reference, a registry that
 * refuses (credentials, TLS), an image without the files a sandbox needs. */
export class ImageError extends InvalidArgumentError {
  static override defaultStatus = 400;
}

/** A Dockerfile instruction failed; the message names it and ends with its output. */
export class BuildStepError extends ImageError {
  static override defaultStatus = 400;
}

/** A missing or wrong API key. */
export class AuthenticationError extends SandlotError {
  static override defaultStatus = 401;
}

/** A valid key that may not make the call (an operator's, made with a tenant's key). */
export class PermissionDeniedError extends AuthenticationError {
  static override defaultStatus = 403;
}

/** An unknown sandbox, snapshot, template, process or path. */
export class NotFoundError extends SandlotError {
  static override defaultStatus = 404;
}

/** The registry has no such repository or tag (or will not say, without credentials). */
export class ImageNotFoundError extends NotFoundError {
  static override defaultStatus = 404;
}

/** A name already taken. */
export class ConflictError extends SandlotError {
  static override defaultStatus = 409;
}

/** The object is not in a state that allows the call (e.g. resuming a running sandbox). */
export class InvalidStateError extends SandlotError {
  static override defaultStatus = 409;
}

/** A command ran past its timeout; the server killed its whole process group. */
export class CommandTimeoutError extends SandlotError {
  static override defaultStatus = 504;
}

/** The sandbox failed: its guest agent or its VMM. */
export class SandboxError extends SandlotError {
  static override defaultStatus = 502;
}

/** The in-guest agent failed or went away. */
export class GuestError extends SandboxError {}

/** QEMU failed to start, load or answer. */
export class VmmError extends SandboxError {}

/** The host has no room for it now (it keeps a reserve of memory and disk): free something,
 * try again later, or use another host. */
export class CapacityError extends SandlotError {
  static override defaultStatus = 503;
}

/** The host that runs the sandbox did not answer (several hosts); if it stays silent, its
 * sandboxes are reported `lost`. */
export class HostUnavailableError extends SandlotError {
  static override defaultStatus = 503;
}

/** Snapshot data missing, corrupt, or not writable. */
export class StorageError extends SandlotError {
  static override defaultStatus = 500;
}

/** A template build step failed. */
export class BuildError extends SandlotError {
  static override defaultStatus = 500;
}

/** A snapshot that was being waited on ended in state `failed` or `deleted`. */
export class SnapshotFailedError extends SandboxError {
  /** The snapshot's id. */
  readonly snapshotId: string | undefined;

  constructor(message = "", options?: { snapshotId?: string; cause?: unknown }) {
    super(message, options);
    this.snapshotId = options?.snapshotId;
  }
}

/** A client-side wait ran past its timeout; the server-side operation may still finish. */
export class WaitTimeoutError extends SandlotError {
  static override defaultStatus = 504;
}

/** A command run with `check: true` exited with a non-zero code. */
export class CommandExitError extends SandlotError {
  /** The command's whole result. */
  readonly result: CommandResult;

  constructor(result: CommandResult, cmd = "") {
    const tail = result.stderr.trim().split("\n").slice(-1)[0];
    let message = cmd
      ? `command ${JSON.stringify(cmd)} exited with code ${result.exitCode}`
      : `command exited with code ${result.exitCode}`;
    if (tail) message += `: ${tail}`;
    super(message);
    this.result = result;
  }

  /** The command's exit code. */
  get exitCode(): number {
    return this.result.exitCode;
  }

  /** Everything the command wrote to stdout. */
  get stdout(): string {
    return this.result.stdout;
  }

  /** Everything the command wrote to stderr. */
  get stderr(): string {
    return this.result.stderr;
  }
}

/** The constructor of a class of the error tree. */
export type ErrorClass = new (message?: string, options?: { cause?: unknown; status?: number }) => SandlotError;

/** The classes the server names in an error body's `type`, by name. */
export const ERRORS: Readonly<Record<string, ErrorClass>> = Object.freeze({
  SandlotError,
  InvalidArgumentError,
  PayloadTooLargeError,
  AuthenticationError,
  PermissionDeniedError,
  NotFoundError,
  ConflictError,
  InvalidStateError,
  CommandTimeoutError,
  SandboxError,
  GuestError,
  VmmError,
  CapacityError,
  HostUnavailableError,
  StorageError,
  BuildError,
  ImageError,
  BuildStepError,
  ImageNotFoundError,
  SnapshotFailedError: SnapshotFailedError as unknown as ErrorClass,
  WaitTimeoutError,
});

const STATUS_FALLBACK: Record<number, ErrorClass> = {
  400: InvalidArgumentError,
  401: AuthenticationError,
  403: PermissionDeniedError,
  404: NotFoundError,
  409: ConflictError,
  413: PayloadTooLargeError,
  422: InvalidArgumentError,
  500: SandlotError,
  502: SandboxError,
  503: CapacityError,
  504: CommandTimeoutError,
};

/**
 * Build the error class named by an error body's `{"type", "message"}` (a server's `error`
 * object, or one in a command stream or fork answer). An unknown `type` falls back to the class
 * of the HTTP `status`, then to {@link SandlotError}.
 */
export function errorFromPayload(payload: unknown, status?: number): SandlotError {
  const body = (payload && typeof payload === "object" ? payload : {}) as Record<string, unknown>;
  const type = typeof body.type === "string" ? body.type : undefined;
  const message = String(body.message || type || "unknown error");
  const cls =
    (type !== undefined && Object.prototype.hasOwnProperty.call(ERRORS, type) ? ERRORS[type] : undefined) ??
    (status !== undefined ? STATUS_FALLBACK[status] : undefined) ??
    SandlotError;
  return new cls(message, status !== undefined ? { status } : undefined);
}

/** Turn an HTTP error answer (status and body text) into the sandlot error it names. */
export function errorFromResponse(status: number, text: string, hasKey = true): SandlotError {
  let payload: unknown;
  try {
    payload = JSON.parse(text);
  } catch {
    payload = undefined;
  }
  let error: SandlotError;
  const inner = (payload as { error?: unknown } | undefined)?.error;
  if (inner && typeof inner === "object") {
    error = errorFromPayload(inner, status);
  } else {
    const cls = STATUS_FALLBACK[status] ?? SandlotError;
    const snippet = text.trim().slice(0, 200);
    error = new cls(`HTTP ${status}${snippet ? `: ${snippet}` : ""}`, { status });
  }
  if (error instanceof AuthenticationError && !hasKey) {
    error.message += " (no API key: pass apiKey or set SANDLOT_API_KEY)";
  }
  return error;
}
