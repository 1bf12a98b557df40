/**
 * Running commands in a sandbox: to completion, in the background, or as an async iterable of
 * their output.
 *
 * @module
 */

import { CommandExitError, InvalidArgumentError, NotFoundError, SandboxError, SandlotError, errorFromPayload } from "./errors.js";
import { Api, COMMAND_TIMEOUT_SLACK_MS, seg, strMap, type ApiRequest } from "./http.js";
import { commandResult, toProcessInfo, type CommandResult, type OutputChunk, type ProcessInfo, type Schemas } from "./models.js";

/** Called with each chunk of text a command writes, as it arrives. */
export type OutputCallback = (data: string) => void;

/** Options of {@link Commands.start} (and of every way to run a command). */
export interface StartOptions {
  /**
   * Kill the command's whole process group after this many ms (the server enforces it and the
   * SDK throws {@link CommandTimeoutError}). `0` or `null`: no limit. Default: 60 000 for
   * `run` and `stream`, none for `start`.
   *
   * A command that prints nothing for a long time is followed all the same: the server sends a
   * keepalive line every 30 s of silence (Node's `fetch` gives up on an answer that sends
   * nothing for 5 minutes).
   */
  timeoutMs?: number | null;
  /** Extra environment variables. */
  env?: Record<string, string>;
  /** Working directory (absolute guest path). */
  cwd?: string;
  /** The guest user to run as (default: the template's, i.e. an image's `USER`, else `root`). */
  user?: string;
  /** Written to the process's stdin, which is then closed. */
  stdin?: string | Uint8Array;
}

/** Options of {@link Commands.run}. */
export interface RunOptions extends StartOptions {
  /** Called with each chunk of stdout text as it arrives. */
  onStdout?: OutputCallback;
  /** Called with each chunk of stderr text as it arrives. */
  onStderr?: OutputCallback;
  /** Throw {@link CommandExitError} if the command exits non-zero. */
  check?: boolean;
  /**
   * A thin alias of {@link Commands.start}, kept for E2B users: answer at once with a
   * {@link CommandHandle} (the callbacks and `check` then apply to `handle.wait()` only if
   * passed there). Prefer `start`.
   */
  background?: boolean;
}

/** Options of {@link CommandHandle.wait}. */
export interface WaitOptions {
  onStdout?: OutputCallback;
  onStderr?: OutputCallback;
  /** Throw {@link CommandExitError} if the command exits non-zero. */
  check?: boolean;
}

const DEFAULT_RUN_TIMEOUT_MS = 60_000;

/** Folds a command's NDJSON events into a {@link CommandResult}. @internal */
class CommandFold {
  pid: number | undefined;
  private exitCode: number | undefined;
  private error: SandlotError | undefined;
  private readonly stdout: string[] = [];
  private readonly stderr: string[] = [];

  constructor(
    private readonly cmd: string,
    private readonly options: WaitOptions = {},
  ) {}

  /** Handle one event; returns the output chunk it carried, if any. */
  feed(event: Record<string, unknown>): OutputChunk | undefined {
    switch (event.type) {
      case "start":
        this.pid = typeof event.pid === "number" ? event.pid : undefined;
        return undefined;
      case "stdout":
      case "stderr": {
        const data = String(event.data ?? "");
        const stream = event.type;
        (stream === "stdout" ? this.stdout : this.stderr).push(data);
        const callback = stream === "stdout" ? this.options.onStdout : this.options.onStderr;
        callback?.(data);
        return { stream, data };
      }
      case "exit":
        this.exitCode = typeof event.exit_code === "number" ? event.exit_code : -1;
        return undefined;
      case "error":
        this.error = errorFromPayload(event.error);
        return undefined;
      default:
        return undefined;
    }
  }

  /** The finished result; throws the stream's error, or {@link CommandExitError} if checking. */
  result(): CommandResult {
    if (this.error) throw this.error;
    if (this.exitCode === undefined) throw new SandboxError("command output ended without an exit code");
    const result = commandResult(this.stdout.join(""), this.stderr.join(""), this.exitCode);
    if (this.options.check && !result.ok) throw new CommandExitError(result, this.cmd);
    return result;
  }
}

/**
 * A command's output as an async iterable of {@link OutputChunk}s, in the order written:
 *
 * ```ts
 * const output = sbx.commands.stream("make test");
 * for await (const { stream, data } of output) process[stream].write(data);
 * console.log(output.result?.exitCode);
 * ```
 *
 * Iteration throws what the command ended with on the server (e.g. {@link CommandTimeoutError});
 * once it is over, `result` holds the {@link CommandResult}. Breaking out of the loop stops
 * following the output (a streamed `run` then no longer has a client; the server lets the
 * process finish). It can be iterated once.
 */
export class CommandOutput implements AsyncIterable<OutputChunk> {
  /** The result, once the output has been read to the end. */
  result: CommandResult | undefined;
  private readonly fold: CommandFold;
  private started = false;

  /** @internal */
  constructor(
    private readonly source: () => AsyncGenerator<Record<string, unknown>, void, undefined>,
    cmd: string,
    options: WaitOptions = {},
  ) {
    this.fold = new CommandFold(cmd, options);
  }

  /** The process id, once the server has sent it. */
  get pid(): number | undefined {
    return this.fold.pid;
  }

  async *[Symbol.asyncIterator](): AsyncIterator<OutputChunk> {
    if (this.started) throw new InvalidArgumentError("a command's output can be iterated only once");
    this.started = true;
    for await (const event of this.source()) {
      const chunk = this.fold.feed(event);
      if (chunk) yield chunk;
    }
    this.result = this.fold.result();
  }

  /** Read the output to the end (or what is left of it) and return the result. */
  async wait(): Promise<CommandResult> {
    if (!this.started) {
      for await (const _chunk of this) {
        // the callbacks, if any, see every chunk
      }
    }
    if (this.result === undefined) {
      throw new InvalidArgumentError("this output's iteration was stopped before the command ended");
    }
    return this.result;
  }
}

/**
 * A command started in the background: wait for it, feed its stdin, kill it, or iterate over
 * its output (`for await (const chunk of handle)`, replayed from its start).
 */
export class CommandHandle implements AsyncIterable<OutputChunk> {
  /** @internal */
  constructor(
    private readonly api: Api,
    /** The sandbox the command runs in. */
    readonly sandboxId: string,
    /** The process id in the sandbox. */
    readonly pid: number,
    /** The command line, if known. */
    readonly cmd = "",
  ) {}

  /** The output, replayed from the command's start and followed until it exits. */
  output(options: WaitOptions = {}): CommandOutput {
    const req: ApiRequest = {
      method: "GET",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/commands/${this.pid}/stream`,
      timeoutMs: null,
    };
    return new CommandOutput(() => this.api.events(req), this.cmd, options);
  }

  [Symbol.asyncIterator](): AsyncIterator<OutputChunk> {
    return this.output()[Symbol.asyncIterator]();
  }

  /**
   * Follow the command's output until it exits and return its result. The callbacks get every
   * chunk (replayed from the start). Throws what the server reports, e.g.
   * {@link CommandTimeoutError} if it ran past its timeout.
   */
  async wait(options: WaitOptions = {}): Promise<CommandResult> {
    return this.output(options).wait();
  }

  /** Send `signal` (default 9) to the command's process group; `false` if it had already exited. */
  async kill(signal = 9): Promise<boolean> {
    return new Commands(this.api, this.sandboxId).kill(this.pid, signal);
  }

  /** Write `data` to the command's stdin; `eof: true` closes stdin afterwards. */
  async sendStdin(data: string | Uint8Array, options: { eof?: boolean } = {}): Promise<void> {
    await new Commands(this.api, this.sandboxId).sendStdin(this.pid, data, options);
  }
}

function text(data: string | Uint8Array | undefined): string | undefined {
  if (data === undefined || typeof data === "string") return data;
  return new TextDecoder().decode(data);
}

/** `sbx.commands`: run commands and manage the processes they start. */
export class Commands {
  /** @internal */
  constructor(
    private readonly api: Api,
    private readonly sandboxId: string,
  ) {}

  private request(cmd: string, options: StartOptions & { pty?: { cols: number; rows: number } }, background: boolean, defaultTimeoutMs: number | null): ApiRequest {
    if (typeof cmd !== "string" || !cmd) throw new InvalidArgumentError("cmd must be a non-empty string");
    const timeoutMs = options.timeoutMs === undefined ? defaultTimeoutMs : options.timeoutMs;
    if (timeoutMs !== null && (typeof timeoutMs !== "number" || !(timeoutMs >= 0))) {
      throw new InvalidArgumentError(`timeoutMs must be a number >= 0, got ${String(timeoutMs)}`);
    }
    return {
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/commands`,
      json: {
        cmd,
        env: strMap(options.env, "env") ?? {},
        cwd: options.cwd ?? null,
        user: options.user ?? null,
        timeout: timeoutMs ? timeoutMs / 1000 : null,
        stdin: text(options.stdin) ?? null,
        background,
        ...(options.pty ? { pty: options.pty } : {}),
      } satisfies Schemas["ExecRequest"],
      // The HTTP deadline outlives the command's own, so the server's timeout error arrives first.
      timeoutMs: background ? undefined : timeoutMs ? timeoutMs + COMMAND_TIMEOUT_SLACK_MS : null,
    };
  }

  /**
   * Run `cmd` with `/bin/sh -c` and wait for it to finish. Output streams while it runs:
   * `onStdout`/`onStderr` get each text chunk. A non-zero exit is a normal result
   * (`result.ok === false`) unless `check` is set.
   *
   * ```ts
   * const { stdout, exitCode } = await sbx.commands.run("python3 -V", { timeoutMs: 10_000 });
   * ```
   *
   * @throws {CommandTimeoutError} past `timeoutMs` (default 60 s); the process group is killed.
   * @throws {CommandExitError} with `check: true` and a non-zero exit.
   */
  run(cmd: string, options?: RunOptions & { background?: false }): Promise<CommandResult>;
  /** `background: true`: a thin alias of {@link Commands.start}; prefer `start`. */
  run(cmd: string, options: RunOptions & { background: true }): Promise<CommandHandle>;
  async run(cmd: string, options: RunOptions = {}): Promise<CommandResult | CommandHandle> {
    if (options.background) return this.start(cmd, options);
    return this.stream(cmd, options).wait();
  }

  /**
   * Run `cmd` and return its output as an async iterable, without waiting for the answer: the
   * request is sent when iteration starts. See {@link CommandOutput}.
   */
  stream(cmd: string, options: Omit<RunOptions, "background"> = {}): CommandOutput {
    const req = this.request(cmd, options, false, DEFAULT_RUN_TIMEOUT_MS);
    return new CommandOutput(() => this.api.events(req), cmd, options);
  }

  /**
   * Start `cmd` in the background and return a handle at once; the process keeps running when
   * this client goes away. `timeoutMs` defaults to none.
   */
  async start(cmd: string, options: StartOptions = {}): Promise<CommandHandle> {
    const data = await this.api.call<Schemas["Started"]>(this.request(cmd, options, true, null));
    if (!data || typeof data.pid !== "number") {
      throw new SandlotError(`server answered a background command without a pid: ${JSON.stringify(data)}`);
    }
    return new CommandHandle(this.api, this.sandboxId, data.pid, cmd);
  }

  /** A handle for a process started earlier, e.g. one from {@link Commands.list}. */
  connect(pid: number): CommandHandle {
    return new CommandHandle(this.api, this.sandboxId, pid);
  }

  /** The processes commands started that are still running. */
  async list(): Promise<ProcessInfo[]> {
    const data = await this.api.call<Schemas["ProcessList"]>({
      method: "GET",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/commands`,
    });
    return (data?.processes ?? []).map(toProcessInfo);
  }

  /** Send `signal` (default 9) to process `pid`'s group; `false` if it had exited or is unknown. */
  async kill(pid: number, signal = 9): Promise<boolean> {
    try {
      const data = await this.api.call<Schemas["Killed"]>({
        method: "POST",
        path: `/v1/sandboxes/${seg(this.sandboxId)}/commands/${Math.trunc(pid)}/kill`,
        json: { signal: Math.trunc(signal) },
      });
      return Boolean(data?.killed);
    } catch (error) {
      if (error instanceof NotFoundError) return false;
      throw error;
    }
  }

  /** Write `data` to process `pid`'s stdin; `eof: true` closes stdin afterwards. */
  async sendStdin(pid: number, data: string | Uint8Array, options: { eof?: boolean } = {}): Promise<void> {
    await this.api.call({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/commands/${Math.trunc(pid)}/stdin`,
      json: { data: text(data) ?? "", eof: Boolean(options.eof) },
    });
  }
}
