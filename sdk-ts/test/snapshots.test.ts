// Snapshots, restores, forks and rollbacks on real VMs.
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { ConflictError, InvalidArgumentError, NotFoundError, Sandbox, Sandlot, Snapshot } from "sandlot";
import { Cleanup, noServer } from "./helpers.js";

describe("snapshots", { skip: noServer }, () => {
  const cleanup = new Cleanup();
  const tag = randomUUID().slice(0, 8);
  let sbx: Sandbox;
  let snap: Snapshot;

  before(async () => {
    sbx = cleanup.sandbox(await Sandbox.create({ env: { ORIGIN: "parent" }, timeoutMs: 900_000 }));
    await sbx.files.write("/root/state.txt", "checkpoint");
    // A process whose memory is part of the snapshot: a counter it keeps in RAM only.
    await sbx.files.write(
      "/root/counter.py",
      // written then renamed, so a reader never sees it half written
      "import os, time\nn = 0\nwhile True:\n    n += 1\n    open('/tmp/n.new', 'w').write(str(n))\n    os.rename('/tmp/n.new', '/tmp/n')\n    time.sleep(0.05)\n",
    );
    await sbx.commands.start("python3 /root/counter.py");
    await sbx.commands.run("while [ ! -s /tmp/n ]; do sleep 0.1; done", { timeoutMs: 60_000 });
  });
  after(() => cleanup.run());

  it("createSnapshot answers once captured; wait() until ready; refresh()", async () => {
    snap = cleanup.snapshot(await sbx.createSnapshot({ name: `ts-${tag}` }));
    assert.match(snap.snapshotId, /^snap-/);
    assert.equal(snap.name, `ts-${tag}`);
    assert.ok(["uploading", "ready"].includes(snap.state), snap.state);
    assert.ok((snap.info.pauseMs ?? -1) >= 0);
    assert.equal(await snap.wait({ timeoutMs: 120_000 }), snap);
    assert.equal(snap.state, "ready");
    assert.ok(snap.info.readyAt instanceof Date);
    assert.ok((snap.info.sizeBytes ?? 0) > 0);
    assert.equal((await snap.refresh()).state, "ready");
    assert.equal(snap.info.sandboxId, sbx.sandboxId);
  });

  it("snapshot() is an alias; Snapshot.get by id and name; Snapshot.list", async () => {
    const other = cleanup.snapshot(await sbx.snapshot());
    assert.equal(other.name, null);
    assert.equal((await Snapshot.get(snap.snapshotId)).name, `ts-${tag}`);
    assert.equal((await Snapshot.get(`ts-${tag}`)).snapshotId, snap.snapshotId);
    const mine = await Snapshot.list({ sandboxId: sbx.sandboxId });
    assert.deepEqual(new Set(mine.map((s) => s.snapshotId)), new Set([snap.snapshotId, other.snapshotId]));
    assert.ok((await Snapshot.list()).some((s) => s.snapshotId === snap.snapshotId));
    await other.wait();
    assert.equal(await other.remove(), true);
    assert.equal(await other.remove(), false);
  });

  it("restore: a new sandbox where the snapshot was, files and memory", async () => {
    await sbx.files.write("/root/state.txt", "changed after the snapshot");
    const restored = cleanup.sandbox(await snap.restore());
    assert.notEqual(restored.sandboxId, sbx.sandboxId);
    assert.equal(restored.info.snapshotId, snap.snapshotId);
    assert.equal(await restored.files.read("/root/state.txt"), "checkpoint");
    const a = Number(await restored.files.read("/tmp/n"));
    await new Promise((r) => setTimeout(r, 500));
    const b = Number(await restored.files.read("/tmp/n"));
    assert.ok(b > a, "the in-memory counter kept running after the restore");
    assert.equal((await restored.commands.run("echo $ORIGIN")).stdout, "parent\n");
    await restored.kill();
  });

  it("what is done right after createSnapshot is not in the snapshot", async () => {
    await sbx.files.write("/root/race.txt", "before");
    const quick = cleanup.snapshot(await sbx.createSnapshot());
    await sbx.commands.run("echo after > /root/race.txt");
    await quick.wait();
    const restored = cleanup.sandbox(await quick.restore());
    assert.equal(await restored.files.read("/root/race.txt"), "before");
    await restored.kill();
    await quick.remove();
  });

  it("restoreWith overrides memory, env, metadata and timeout", async () => {
    const restored = cleanup.sandbox(
      await snap.restoreWith({ name: `w-${tag}`, memoryMb: 768, env: { WORKER_ID: "42" }, metadata: { tag }, timeoutMs: 120_000 }),
    );
    assert.equal(restored.info.memoryMb, 768);
    assert.equal(restored.info.metadata.tag, tag);
    assert.equal(restored.info.metadata.name, `w-${tag}`);
    assert.equal(restored.info.timeout, 120);
    assert.equal((await restored.commands.run("echo $WORKER_ID $ORIGIN")).stdout, "42 parent\n");
    await restored.kill();
  });

  it("saveNamed names a snapshot; a taken name is a ConflictError; Snapshot.delete", async () => {
    const named = cleanup.snapshot(await sbx.createSnapshot());
    await named.wait();
    await named.saveNamed(`saved-${tag}`);
    assert.equal(named.name, `saved-${tag}`);
    assert.equal((await Snapshot.get(`saved-${tag}`)).snapshotId, named.snapshotId);
    await assert.rejects(named.saveNamed(`ts-${tag}`), ConflictError);
    assert.equal(await Snapshot.delete(`saved-${tag}`), true);
    assert.equal(await Snapshot.delete(`saved-${tag}`), false);
    await assert.rejects(Snapshot.get(`saved-${tag}`), NotFoundError);
  });

  it("client.snapshots.restore(sandboxId, snapshotId), checked against the source", async () => {
    const client = new Sandlot();
    const restored = cleanup.sandbox(await client.snapshots.restore(sbx.sandboxId, snap.snapshotId));
    assert.equal(await restored.files.read("/root/state.txt"), "checkpoint");
    await restored.kill();
    await assert.rejects(client.snapshots.restore("sb-someoneelse", snap.snapshotId), InvalidArgumentError);
    assert.equal((await client.snapshots.get(snap.snapshotId)).snapshotId, snap.snapshotId);
    assert.ok((await client.snapshots.list({ sandboxId: sbx.sandboxId })).length >= 1);
  });

  it("fork(count): children with the parent's state, independent of it and of each other", async () => {
    await sbx.files.write("/root/fork.txt", "parent");
    const children = await sbx.fork(2);
    children.forEach((c) => cleanup.sandbox(c));
    assert.equal(children.length, 2);
    assert.deepEqual(children.errors, []);
    assert.ok(typeof children.pauseMs === "number");
    for (const [i, child] of children.entries()) {
      assert.equal(child.info.forkedFrom, sbx.sandboxId);
      assert.equal(await child.files.read("/root/fork.txt"), "parent");
      await child.files.write("/root/fork.txt", `child ${i}`);
    }
    assert.equal(await children[0].files.read("/root/fork.txt"), "child 0");
    assert.equal(await children[1].files.read("/root/fork.txt"), "child 1");
    assert.equal(await sbx.files.read("/root/fork.txt"), "parent");
    await Promise.all(children.map((c) => c.kill()));
    const [single] = await sbx.fork();
    cleanup.sandbox(single);
    assert.equal((await single.commands.run("echo $ORIGIN")).stdout, "parent\n");
    await single.kill();
  });

  it("snapshot.fork(count): independent sandboxes from a stored snapshot, with the settings given", async () => {
    const children = await snap.fork(2, { env: { KID: "1" } });
    children.forEach((c) => cleanup.sandbox(c));
    assert.equal(children.length, 2);
    assert.deepEqual(children.errors, []);
    for (const child of children) {
      assert.equal(child.info.snapshotId, snap.snapshotId);
      assert.equal(await child.files.read("/root/state.txt"), "checkpoint");
      assert.equal((await child.commands.run("echo $ORIGIN $KID")).stdout, "parent 1\n");
      // the counter process of the snapshot runs on in each
      await child.commands.run("a=$(cat /tmp/n); sleep 0.5; [ $(cat /tmp/n) -gt $a ]", { timeoutMs: 60_000, check: true });
    }
    await children[0].files.write("/root/state.txt", "changed");
    assert.equal(await children[1].files.read("/root/state.txt"), "checkpoint");
    await Promise.all(children.map((c) => c.kill()));
    await assert.rejects(snap.fork(0), InvalidArgumentError);
  });

  it("rollback(snapshot) resets the sandbox and keeps its id", async () => {
    await sbx.files.write("/root/state.txt", "damaged");
    await sbx.commands.run("rm -rf /root/extra && mkdir /root/extra");
    const same = await sbx.rollback(snap);
    assert.equal(same, sbx);
    assert.equal(sbx.info.sandboxId, sbx.sandboxId);
    assert.equal(await sbx.files.read("/root/state.txt"), "checkpoint");
    assert.equal(await sbx.files.exists("/root/extra"), false);
    await sbx.rollback(`ts-${tag}`); // by name
    await assert.rejects(sbx.rollback("snap-nosuchsnapshot"), NotFoundError);
  });
});
