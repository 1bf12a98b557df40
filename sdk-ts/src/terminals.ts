/**
 * Terminals in a sandbox: a shell, or any command, on a pseudo-terminal.
 *
 * @module
 */

import { InvalidArgumentError } from "./errors.js";
import { Api, seg } from "./http.js";
import { CommandHandle, Commands, type OutputCallback } from "./commands.js";
import type { CommandResult, Schemas } from "./models.js";

/** An interactive login shell: what {@link Terminals.create} runs by default. */
export const DEFAULT_SHELL = "/bin/bash -i -l";

/** A terminal's size in characters. */
export interface TerminalSize {
  cols: number;
  rows: number;
}

/** Options of {@link Terminals.create}. */
export interface TerminalOptions extends Partial<TerminalSize> {
  /** What to run on the terminal (default {@link DEFAULT_SHELL}). */
  cmd?: string;
  /** Extra environment variables (`TERM` is `xterm-256color` unless given). */
  env?: Record<string, string>;
  /** Working directory (absolute guest path). */
  cwd?: string;
  /** The guest user to run as (default `root`). */
  user?: string;
  /** Kill it after this many ms; `0` or `null` (the default): no limit. */
  timeoutMs?: number | null;
}

function size(cols: unknown, rows: unknown): TerminalSize {
  for (const [name, value] of [["cols", cols], ["rows", rows]] as const) {
    if (typeof value !== "number" || !Number.isInteger(value) || value < 1 || value > 4096) {
      throw new InvalidArgumentError(`a terminal's ${name} must be an integer from 1 to 4096, got ${String(value)}`);
    }
  }
  return { cols: cols as number, rows: rows as number };
}

/**
 * A process on a terminal: type into it, resize it, follow what it draws. A terminal merges
 * stdout and stderr as a real one does: all its output comes as `stdout` chunks (control
 * sequences, `\r\n` line ends and the echo of what was typed included).
 *
 * ```ts
 * const term = await sbx.pty.create({ cols: 120, rows: 40 });
 * const done = term.wait({ onData: (data) => process.stdout.write(data) });
 * await term.sendInput("ls -la\r");
 * await term.sendInput("exit\r");
 * console.log((await done).exitCode);
 * ```
 */
export class Terminal extends CommandHandle {
  /** @internal */
  constructor(private readonly terminalApi: Api, sandboxId: string, pid: number, cmd = "") {
    super(terminalApi, sandboxId, pid, cmd);
  }

  /** Type `data`: `"\r"` is Enter, `"\x03"` Ctrl-C, `"\x04"` Ctrl-D. */
  async sendInput(data: string | Uint8Array): Promise<void> {
    await this.sendStdin(data);
  }

  /** Set the terminal's size; its foreground program gets SIGWINCH. */
  async resize(cols: number, rows: number): Promise<void> {
    await new Terminals(this.terminalApi, this.sandboxId).resize(this.pid, cols, rows);
  }

  /**
   * Follow the terminal's output (replayed from its start) until its process exits; `onData`
   * gets each chunk. The result's `stdout` is all the output.
   */
  override async wait(options: { onData?: OutputCallback; onStdout?: OutputCallback } = {}): Promise<CommandResult> {
    return super.wait({ onStdout: options.onData ?? options.onStdout });
  }
}

/** `sbx.pty`: processes on pseudo-terminals, such as an interactive shell. */
export class Terminals {
  /** @internal */
  constructor(
    private readonly api: Api,
    private readonly sandboxId: string,
  ) {}

  /**
   * Start `cmd` (an interactive login shell by default) on a new terminal, 80 x 24 unless
   * given; answers at once. When its process exits, what it left in the background loses the
   * terminal (SIGHUP).
   */
  async create(options: TerminalOptions = {}): Promise<Terminal> {
    const cmd = options.cmd ?? DEFAULT_SHELL;
    const start = { ...options, timeoutMs: options.timeoutMs ?? null, pty: size(options.cols ?? 80, options.rows ?? 24) };
    const handle = await new Commands(this.api, this.sandboxId).start(cmd, start);
    return new Terminal(this.api, this.sandboxId, handle.pid, cmd);
  }

  /** A handle for a terminal started earlier (see `sbx.commands.list()`, `pty: true`). */
  connect(pid: number): Terminal {
    return new Terminal(this.api, this.sandboxId, pid);
  }

  /** Type `data` into terminal `pid`. */
  async sendInput(pid: number, data: string | Uint8Array): Promise<void> {
    await new Commands(this.api, this.sandboxId).sendStdin(pid, data);
  }

  /** Set terminal `pid`'s size. */
  async resize(pid: number, cols: number, rows: number): Promise<void> {
    await this.api.call({
      method: "POST",
      path: `/v1/sandboxes/${seg(this.sandboxId)}/commands/${Math.trunc(pid)}/resize`,
      json: size(cols, rows) satisfies Schemas["TerminalSize"],
    });
  }

  /** Signal (default 9) the process group on terminal `pid`; `false` if it had already exited. */
  async kill(pid: number, signal = 9): Promise<boolean> {
    return new Commands(this.api, this.sandboxId).kill(pid, signal);
  }
}
