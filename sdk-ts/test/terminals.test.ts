// Terminals on a real VM: sbx.pty runs a shell on a pseudo-terminal; input, size, the exit
// status, reconnecting to it, and the errors.
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { InvalidArgumentError, NotFoundError, Sandbox, type Terminal } from "sandlot";
import { Cleanup, noServer } from "./helpers.js";

/** Follows a terminal's output; `expect` waits until it has drawn `pattern`. */
function follow(term: Terminal) {
  let drawn = "";
  const done = term.wait({ onData: (data) => (drawn += data) });
  const expect = async (pattern: RegExp, timeoutMs = 60_000) => {
    const deadline = Date.now() + timeoutMs;
    while (!pattern.test(drawn)) {
      if (Date.now() > deadline) assert.fail(`${pattern} not drawn; got ${JSON.stringify(drawn.slice(-2000))}`);
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  };
  return { done, expect };
}

describe("terminals", { skip: noServer }, () => {
  const cleanup = new Cleanup();
  let sbx: Sandbox;

  before(async () => {
    sbx = cleanup.sandbox(await Sandbox.create({ timeoutMs: 600_000 }));
  });
  after(() => cleanup.run());

  it("a shell on a terminal: input, its size, a resize, the exit status", async () => {
    const term = await sbx.pty.create({ cols: 90, rows: 20, env: { MARK: "ts" } });
    const screen = follow(term);
    await screen.expect(/root@sandlot:.*# /); // a shell starting up drops what was typed ahead
    await term.sendInput("echo $((6*7))-$MARK-$TERM; stty size\r");
    await screen.expect(/42-ts-xterm-256color/);
    await screen.expect(/20 90/);
    const listed = (await sbx.commands.list()).find((p) => p.pid === term.pid);
    assert.equal(listed?.pty, true);
    await term.resize(120, 40);
    await term.sendInput("stty size; exit 4\r");
    const result = await screen.done;
    assert.equal(result.exitCode, 4);
    assert.match(result.stdout, /40 120/);
  });

  it("connect replays the output and takes input", async () => {
    const term = await sbx.pty.create({ cmd: "read x; echo got-$x" });
    await term.sendInput("later\r");
    const result = await sbx.pty.connect(term.pid).wait();
    assert.equal(result.exitCode, 0);
    assert.match(result.stdout, /got-later/);
  });

  it("errors: a bad size, a process without a terminal, an unknown pid", async () => {
    await assert.rejects(sbx.pty.create({ cols: 0 }), InvalidArgumentError);
    const plain = await sbx.commands.start("sleep 30");
    try {
      await assert.rejects(sbx.pty.resize(plain.pid, 80, 24), (e: Error) => e instanceof InvalidArgumentError && /no terminal/.test(e.message));
    } finally {
      await plain.kill();
    }
    await assert.rejects(sbx.pty.resize(999_999, 80, 24), NotFoundError);
  });
});
