// Behaviour E2B clients rely on, as E2B has it, through the unmodified e2b npm package:
// listing order and pagination, removing a missing path, symlink entries, recursive watches,
// a command stream cut by a kill, snapshot names, the default pause, the envd version.
// tests/ts/test_ts_sdk.py sets E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY and runs it.
import { after, describe, it } from "node:test";
import assert from "node:assert/strict";

const [major, minor] = process.versions.node.split(".").map(Number);
const e2b = await import(major > 20 || (major === 20 && minor >= 19) ? "e2b" : "e2b/dist/index.mjs");
const { Sandbox, TimeoutError } = e2b;

const configured = ["E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"].every((name) => process.env[name]);
const skip = configured ? false : "E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY must point at a sandlot server";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function allPages(opts) {
  const pages = Sandbox.list({ ...opts, limit: 1 });
  const seen = [];
  while (pages.hasNext) {
    const items = await pages.nextItems();
    assert.ok(items.length <= 1);
    seen.push(...items.map((s) => s.sandboxId));
  }
  return seen;
}

describe("the e2b npm package sees E2B's behaviour", { skip }, () => {
  const made = [];
  after(async () => {
    await Promise.allSettled(made.map((s) => s.kill()));
  });

  it("lists newest first, across states and pages", async () => {
    const metadata = { suite: `js-order-${Date.now()}` };
    for (let i = 0; i < 3; i++) {
      made.push(await Sandbox.create("base", { metadata, timeoutMs: 600_000 }));
      await sleep(50);
    }
    const [oldest, middle, newest] = made.slice(-3).map((s) => s.sandboxId);
    assert.equal(await made[made.length - 2].pause(), true);
    assert.deepEqual(await allPages({ query: { metadata } }), [newest, middle, oldest]);
    assert.deepEqual(await allPages({ query: { metadata, state: ["running", "paused"] } }), [newest, middle, oldest]);
    assert.deepEqual(await allPages({ query: { metadata, state: ["running"] } }), [newest, oldest]);
    assert.deepEqual(await allPages({ query: { metadata, state: ["paused"] } }), [middle]);
    assert.deepEqual(await allPages({ query: { metadata }, order: "asc" }), [oldest, middle, newest]);
  });

  it("files: a missing path removes, symlinks as envd, recursive watches", async () => {
    const sbx = await Sandbox.create("base", { timeoutMs: 600_000 });
    made.push(sbx);
    assert.equal((await sbx.getInfo()).envdVersion, "0.6.4");
    await sbx.files.remove("not/there");

    await sbx.commands.run("mkdir -p ln/dir && echo hi > ln/t.txt && cd ln && ln -s t.txt rel && ln -s /home/user/ln/dir absdir && ln -s nowhere broken");
    const rel = await sbx.files.getInfo("ln/rel");
    assert.equal(rel.type, "file");
    assert.equal(rel.symlinkTarget, "/home/user/ln/t.txt");
    const absdir = await sbx.files.getInfo("ln/absdir");
    assert.equal(absdir.type, "dir");
    assert.equal(absdir.symlinkTarget, "/home/user/ln/dir");
    const broken = await sbx.files.getInfo("ln/broken");
    assert.equal(broken.type, undefined);
    assert.equal(broken.symlinkTarget, "/home/user/ln/broken");

    await sbx.files.makeDir("w");
    const events = [];
    const handle = await sbx.files.watchDir("w", (e) => events.push(`${e.type} ${e.name}`), { recursive: true, allowNetworkMounts: true });
    await sbx.files.makeDir("w/later/deeper");
    await sleep(500);
    await sbx.files.write("w/later/deeper/f.txt", "content");
    const deadline = Date.now() + 10_000;
    while (!events.includes("write later/deeper/f.txt") && Date.now() < deadline) await sleep(100);
    await handle.stop();
    assert.ok(events.includes("create later"), events.join(", "));
    assert.ok(events.includes("create later/deeper"), events.join(", "));
    const created = events.indexOf("create later/deeper/f.txt");
    assert.ok(created >= 0 && events.indexOf("write later/deeper/f.txt") > created, events.join(", "));
  });

  it("snapshots: names starting with snap-, filters, newest first", async () => {
    const sbx = await Sandbox.create("base", { timeoutMs: 600_000 });
    made.push(sbx);
    const v1 = await sbx.createSnapshot({ name: "snap-js:v1" });
    const v2 = await sbx.createSnapshot({ name: "team/snap-js:v2" });
    try {
      assert.deepEqual(v1.names, ["snap-js:v1"]);
      const ids = async (name) => new Set((await Sandbox.listSnapshots({ name }).nextItems()).map((s) => s.snapshotId));
      assert.deepEqual(await ids("snap-js"), new Set([v1.snapshotId, v2.snapshotId]));
      assert.deepEqual(await ids("snap-js:v2"), new Set([v2.snapshotId]));
      const listed = (await sbx.listSnapshots().nextItems()).map((s) => s.snapshotId);
      assert.ok(listed.indexOf(v2.snapshotId) < listed.indexOf(v1.snapshotId), "newest first");
      const child = await Sandbox.create("snap-js:v1", { timeoutMs: 300_000 });
      await child.kill();
    } finally {
      await Sandbox.deleteSnapshot(v1.snapshotId);
      await Sandbox.deleteSnapshot(v2.snapshotId);
    }
  });

  it("pause without keepMemory: full memory, not running", async () => {
    const sbx = await Sandbox.create("base", { timeoutMs: 600_000 });
    made.push(sbx);
    const sleeper = await sbx.commands.run("sleep 600", { background: true });
    assert.equal(await sbx.pause(), true);
    assert.equal(await sbx.isRunning(), false);
    assert.equal((await sbx.getInfo()).state, "paused");
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 });
    assert.ok((await back.commands.list()).some((p) => p.pid === sleeper.pid));
  });

  it("a command stream of a killed sandbox ends as the SDK knows a killed sandbox", async () => {
    const sbx = await Sandbox.create("base", { timeoutMs: 600_000 });
    made.push(sbx);
    const handle = await sbx.commands.run("sleep 600", { background: true });
    const waited = handle.wait().then(() => null, (e) => e);
    await sleep(1000);
    assert.equal(await Sandbox.kill(sbx.sandboxId), true);
    const err = await waited;
    assert.ok(err instanceof TimeoutError, String(err));
    assert.match(err.message, /was not found/);
  });
});
