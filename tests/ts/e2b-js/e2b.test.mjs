// The unmodified e2b npm package (pinned in package.json) against a sandlot server, pointed at
// it by its own settings only: E2B_API_URL=<server>/e2b, E2B_SANDBOX_URL=<server>/e2b/envd,
// E2B_API_KEY=<a sandlot key>. tests/ts/test_ts_sdk.py sets them and runs `node --test` here.
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";

// e2b's CommonJS entry (its `main`, which `import "e2b"` also resolves to: the package has no
// `exports` map) require()s an ES-only dependency (chalk 5), which Node loads only from 20.19 on.
// Older Node (Debian 12 ships 18) loads the package's own ES build directly.
const [major, minor] = process.versions.node.split(".").map(Number);
const e2b = await import(major > 20 || (major === 20 && minor >= 19) ? "e2b" : "e2b/dist/index.mjs");
const { Sandbox, CommandExitError, TimeoutError, NotFoundError } = e2b;

const configured = ["E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"].every((name) => process.env[name]);
const skip = configured ? false : "E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY must point at a sandlot server";

describe("the e2b npm package against sandlot", { skip }, () => {
  const made = [];
  let sbx;

  before(async () => {
    sbx = await Sandbox.create("base", { envs: { A: "1" }, metadata: { job: "e2b-js" }, timeoutMs: 600_000 });
    made.push(sbx);
  });
  after(async () => {
    await Promise.allSettled(made.map((s) => s.kill()));
  });

  it("create: envs, metadata, info, isRunning, setTimeout, list", async () => {
    assert.match(sbx.sandboxId, /^sb-/);
    const info = await sbx.getInfo();
    assert.equal(info.sandboxId, sbx.sandboxId);
    assert.equal(info.templateId, "base");
    assert.equal(info.metadata.job, "e2b-js");
    assert.equal(await sbx.isRunning(), true);
    await sbx.setTimeout(900_000);
    const later = await sbx.getInfo();
    assert.ok(later.endAt.getTime() - Date.now() > 800_000);
    const listed = await Sandbox.list({ query: { metadata: { job: "e2b-js" } } }).nextItems();
    assert.ok(listed.some((s) => s.sandboxId === sbx.sandboxId));
    assert.equal((await sbx.commands.run("echo $A")).stdout, "1\n");
  });

  it("commands: streaming callbacks, exit codes, timeouts, cwd, user", async () => {
    const out = [];
    const err = [];
    const result = await sbx.commands.run("for i in 1 2 3; do echo $i; echo e$i >&2; sleep 0.2; done", {
      onStdout: (d) => out.push(d),
      onStderr: (d) => err.push(d),
    });
    assert.equal(result.stdout, "1\n2\n3\n");
    assert.equal(out.join(""), "1\n2\n3\n");
    assert.equal(err.join(""), "e1\ne2\ne3\n");
    assert.ok(out.length >= 3, "output arrived in pieces, as it was written");
    const failed = await sbx.commands.run("echo bad >&2; exit 3").catch((e) => e);
    assert.ok(failed instanceof CommandExitError);
    assert.equal(failed.exitCode, 3);
    assert.equal(failed.stderr, "bad\n");
    await assert.rejects(sbx.commands.run("sleep 30", { timeoutMs: 1000 }), TimeoutError);
    assert.equal((await sbx.commands.run("pwd", { cwd: "/tmp" })).stdout, "/tmp\n");
    assert.equal((await sbx.commands.run("whoami")).stdout, "user\n");
    assert.equal((await sbx.commands.run("whoami", { user: "root" })).stdout, "root\n");
  });

  it("commands: background handles, list, kill, stdin", async () => {
    const handle = await sbx.commands.run("echo started; sleep 0.3; echo done", { background: true });
    assert.ok(handle.pid > 0);
    const done = await handle.wait();
    assert.equal(done.stdout, "started\ndone\n");

    const sleeper = await sbx.commands.run("sleep 600", { background: true });
    assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid));
    assert.equal(await sbx.commands.kill(sleeper.pid), true);
    await assert.rejects(sleeper.wait(), CommandExitError);

    const cat = await sbx.commands.run("cat", { background: true, stdin: true });
    await sbx.commands.sendStdin(cat.pid, "via stdin\n");
    await sbx.commands.closeStdin(cat.pid);
    assert.equal((await cat.wait()).stdout, "via stdin\n");
  });

  it("pty: a shell on a terminal, input, resize, exit", async () => {
    const decoder = new TextDecoder();
    let drawn = "";
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (drawn += decoder.decode(d, { stream: true })) });
    const drawnOnce = async (pattern) => {
      const deadline = Date.now() + 60_000;
      while (!pattern.test(drawn) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
      assert.match(drawn, pattern);
    };
    await drawnOnce(/[$#] $/); // the prompt: a shell starting up drops what was typed ahead of it
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode("stty size; echo $((6*7))js\r"));
    await drawnOnce(/42js/);
    assert.match(drawn, /24 80/);
    await sbx.pty.resize(term.pid, { cols: 100, rows: 40 });
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode("stty size; exit\r"));
    const result = await term.wait();
    assert.equal(result.exitCode, 0);
    assert.match(drawn, /40 100/);
  });

  it("files: text, bytes, streams, list, exists, info, rename, makeDir, remove", async () => {
    const written = await sbx.files.write("data/in.txt", "hello");
    assert.equal(written.path, "/home/user/data/in.txt");
    assert.equal(await sbx.files.read("data/in.txt"), "hello");
    const bytes = new Uint8Array(1 << 20).map((_, i) => (i * 31) & 0xff);
    await sbx.files.write("/tmp/blob.bin", bytes.buffer);
    const back = await sbx.files.read("/tmp/blob.bin", { format: "bytes" });
    assert.equal(createHash("sha256").update(back).digest("hex"), createHash("sha256").update(bytes).digest("hex"));
    const stream = await sbx.files.read("/tmp/blob.bin", { format: "stream" });
    let total = 0;
    for await (const chunk of stream) total += chunk.length;
    assert.equal(total, bytes.length);
    await sbx.files.write([
      { path: "many/a.txt", data: "a" },
      { path: "many/b.txt", data: "b" },
    ]);
    assert.deepEqual((await sbx.files.list("many")).map((e) => e.name).sort(), ["a.txt", "b.txt"]);
    assert.equal(await sbx.files.exists("many/a.txt"), true);
    assert.equal(await sbx.files.exists("many/none"), false);
    assert.equal((await sbx.files.getInfo("many/b.txt")).size, 1);
    assert.equal(await sbx.files.makeDir("made/deep"), true);
    await sbx.files.rename("many/a.txt", "made/deep/a.txt");
    assert.equal(await sbx.files.read("made/deep/a.txt"), "a");
    await sbx.files.remove("many");
    assert.equal(await sbx.files.exists("many"), false);
    await assert.rejects(sbx.files.read("no/such/file"), NotFoundError);
  });

  it("snapshots: create, create a sandbox from one, list, delete", async () => {
    await sbx.files.write("/tmp/snap.txt", "in the snapshot");
    const snap = await sbx.createSnapshot();
    assert.match(snap.snapshotId, /^snap-/);
    await sbx.files.write("/tmp/snap.txt", "after the snapshot");
    const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 });
    made.push(child);
    assert.equal(await child.files.read("/tmp/snap.txt"), "in the snapshot");
    assert.equal((await child.commands.run("echo $A")).stdout, "1\n");
    await child.kill();
    const mine = await sbx.listSnapshots().nextItems();
    assert.ok(mine.some((s) => s.snapshotId === snap.snapshotId));
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true);
  });

  it("fork: one capture, independent children", async () => {
    await sbx.files.write("/tmp/fork.txt", "parent");
    const forks = await sbx.fork({ count: 2 });
    assert.equal(forks.length, 2);
    for (const [i, child] of forks.entries()) {
      assert.ok(child instanceof Sandbox, String(child));
      made.push(child);
      assert.equal(await child.files.read("/tmp/fork.txt"), "parent");
      await child.files.write("/tmp/fork.txt", `child ${i}`);
    }
    assert.equal(await sbx.files.read("/tmp/fork.txt"), "parent");
    await Promise.all(forks.map((c) => c.kill()));
  });

  it("pause and connect: the same sandbox, where it was", async () => {
    const sleeper = await sbx.commands.run("sleep 3000", { background: true });
    await sbx.pause();
    assert.equal((await sbx.getInfo()).state, "paused");
    const back = await Sandbox.connect(sbx.sandboxId);
    assert.equal(back.sandboxId, sbx.sandboxId);
    assert.equal(await back.files.read("/tmp/fork.txt"), "parent");
    assert.ok((await back.commands.list()).some((p) => p.pid === sleeper.pid));
  });

  it("kill", async () => {
    assert.equal(await sbx.kill(), true);
    assert.equal(await sbx.isRunning(), false);
  });
});
