// Commands on a real VM: results, streaming callbacks, async iterables, stdin, env, cwd, user,
// timeouts, background handles, list and kill.
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { CommandExitError, CommandHandle, CommandTimeoutError, InvalidArgumentError, NotFoundError, Sandbox, type OutputChunk } from "sandlot";
import { Cleanup, noServer } from "./helpers.js";

describe("commands", { skip: noServer }, () => {
  const cleanup = new Cleanup();
  let sbx: Sandbox;

  before(async () => {
    sbx = cleanup.sandbox(await Sandbox.create({ env: { FROM_SANDBOX: "yes" }, timeoutMs: 600_000 }));
  });
  after(() => cleanup.run());

  it("run returns stdout, stderr and the exit code", async () => {
    const result = await sbx.commands.run("echo out; echo err >&2; exit 3");
    assert.deepEqual(result, { stdout: "out\n", stderr: "err\n", exitCode: 3, ok: false });
    assert.equal((await sbx.commands.run("true")).ok, true);
  });

  it("onStdout/onStderr get each chunk while the command runs", async () => {
    const events: [string, string, number][] = [];
    const started = Date.now();
    const result = await sbx.commands.run("echo one; sleep 1.5; echo two >&2; sleep 0.2; echo three", {
      onStdout: (d) => events.push(["out", d, Date.now() - started]),
      onStderr: (d) => events.push(["err", d, Date.now() - started]),
    });
    const finished = Date.now() - started;
    assert.deepEqual(
      events.map(([s, d]) => [s, d]),
      [
        ["out", "one\n"],
        ["err", "two\n"],
        ["out", "three\n"],
      ],
    );
    assert.ok(finished - events[0][2] >= 1000, `the first chunk came ${finished - events[0][2]} ms before the end`);
    assert.equal(result.stdout, "one\nthree\n");
    assert.equal(result.stderr, "two\n");
  });

  it("stream() is an async iterable of the output, in order, then the result", async () => {
    const output = sbx.commands.stream("for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.1; done; exit 4");
    const chunks: OutputChunk[] = [];
    for await (const chunk of output) chunks.push(chunk);
    assert.equal(
      chunks.filter((c) => c.stream === "stdout").map((c) => c.data).join(""),
      "1\n2\n3\n",
    );
    assert.equal(
      chunks.filter((c) => c.stream === "stderr").map((c) => c.data).join(""),
      "e1\ne2\ne3\n",
    );
    assert.equal(output.result?.exitCode, 4);
    assert.ok(output.pid && output.pid > 0);
    await assert.rejects(async () => {
      for await (const _ of output) void _;
    }, InvalidArgumentError);
  });

  it("stream() throws the command's timeout from the loop", async () => {
    const seen: string[] = [];
    await assert.rejects(async () => {
      for await (const chunk of sbx.commands.stream("echo before; sleep 30", { timeoutMs: 1500 })) seen.push(chunk.data);
    }, CommandTimeoutError);
    assert.deepEqual(seen, ["before\n"]);
  });

  it("stdin (text and bytes), env, cwd, user", async () => {
    assert.equal((await sbx.commands.run("cat", { stdin: "piped in" })).stdout, "piped in");
    assert.equal((await sbx.commands.run("wc -c", { stdin: new Uint8Array([104, 105, 10]) })).stdout.trim(), "3");
    const env = await sbx.commands.run("echo $FROM_SANDBOX $ONLY_HERE", { env: { ONLY_HERE: "x y" } });
    assert.equal(env.stdout, "yes x y\n");
    assert.equal((await sbx.commands.run("pwd", { cwd: "/tmp" })).stdout, "/tmp\n");
    assert.equal((await sbx.commands.run("id -un")).stdout, "root\n");
    assert.equal((await sbx.commands.run("id -un", { user: "user" })).stdout, "user\n");
  });

  it("timeoutMs kills the command: CommandTimeoutError", async () => {
    const started = Date.now();
    await assert.rejects(sbx.commands.run("sleep 30", { timeoutMs: 1000 }), CommandTimeoutError);
    assert.ok(Date.now() - started < 20_000);
    assert.ok(!(await sbx.commands.list()).some((p) => p.cmd === "sleep 30"), "the process group was killed");
  });

  it("check: true throws CommandExitError with the result", async () => {
    const error = await sbx.commands.run("echo nope >&2; exit 7", { check: true }).catch((e) => e);
    assert.ok(error instanceof CommandExitError);
    assert.equal(error.exitCode, 7);
    assert.equal(error.stderr, "nope\n");
  });

  it("background: a handle with pid, wait() and kill()", async () => {
    const handle = await sbx.commands.run("echo started; sleep 0.5; echo done", { background: true });
    assert.ok(handle instanceof CommandHandle);
    assert.ok(handle.pid > 0);
    const seen: string[] = [];
    const result = await handle.wait({ onStdout: (d) => seen.push(d) });
    assert.equal(result.stdout, "started\ndone\n");
    assert.equal(seen.join(""), "started\ndone\n");
    assert.equal(result.exitCode, 0);

    const sleeper = await sbx.commands.start("sleep 600");
    assert.equal(await sleeper.kill(), true);
    const killed = await sleeper.wait();
    assert.equal(killed.exitCode, 137);
    assert.equal(await sleeper.kill(), false);
  });

  it("a background handle is an async iterable of its output, replayed from the start", async () => {
    // stdout and stderr are two pipes: their order holds only across a pause.
    const handle = await sbx.commands.start("echo a; sleep 0.3; echo b >&2; sleep 0.3; echo c");
    const chunks: OutputChunk[] = [];
    for await (const chunk of handle) chunks.push(chunk);
    assert.deepEqual(
      chunks.map((c) => `${c.stream}:${c.data}`).join(""),
      "stdout:a\nstderr:b\nstdout:c\n",
    );
    const output = handle.output();
    assert.equal((await output.wait()).stdout, "a\nc\n");
  });

  it("sendStdin feeds a background process; eof closes its stdin", async () => {
    const cat = await sbx.commands.start("cat");
    await cat.sendStdin("line one\n");
    await cat.sendStdin(new TextEncoder().encode("line two\n"), { eof: true });
    const result = await cat.wait();
    assert.equal(result.stdout, "line one\nline two\n");
  });

  it("list, connect and kill by pid", async () => {
    const handle = await sbx.commands.start("sleep 600", { timeoutMs: 120_000 });
    const listed = await sbx.commands.list();
    const info = listed.find((p) => p.pid === handle.pid);
    assert.ok(info, "listed");
    assert.equal(info.cmd, "sleep 600");
    assert.equal(info.running, true);
    assert.equal(info.user, "root");
    const again = sbx.commands.connect(handle.pid);
    assert.equal(await sbx.commands.kill(handle.pid, 15), true);
    assert.equal((await again.wait()).exitCode, 143);
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === handle.pid));
    assert.equal(await sbx.commands.kill(999_999), false);
  });

  it("errors: bad cwd and unknown sandbox", async () => {
    await assert.rejects(sbx.commands.run("true", { cwd: "/no/such/dir" }), (e: Error) => e instanceof NotFoundError || e instanceof InvalidArgumentError);
    const other = await Sandbox.create();
    await other.kill();
    await assert.rejects(other.commands.run("true"), NotFoundError);
    await assert.rejects(other.commands.start("true"), NotFoundError);
  });
});
