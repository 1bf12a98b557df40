// Sandboxes on a real server and real VMs: create, connect, list, info, timeouts, ports,
// network, pause/resume, kill, `await using`, the Sandlot client, and the errors the server
// sends for them.
import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import {
  AuthenticationError,
  InvalidArgumentError,
  InvalidStateError,
  NotFoundError,
  Sandbox,
  Sandlot,
  Snapshot,
} from "sandlot";
import { Cleanup, noServer } from "./helpers.js";

describe("sandboxes", { skip: noServer }, () => {
  const cleanup = new Cleanup();
  const suite = randomUUID();
  let sbx: Sandbox;

  before(async () => {
    sbx = cleanup.sandbox(
      await Sandbox.create({
        template: "base",
        env: { GREETING: "hello" },
        metadata: { suite, role: "main" },
        timeoutMs: 600_000,
        cpus: 1,
      }),
    );
  });
  after(() => cleanup.run());

  it("create: env, metadata, timeout, resources", async () => {
    assert.match(sbx.sandboxId, /^sb-/);
    assert.equal(sbx.info.state, "running");
    assert.equal(sbx.info.template, "base");
    assert.equal(sbx.info.metadata.suite, suite);
    assert.equal(sbx.info.timeout, 600);
    assert.equal(sbx.info.cpus, 1);
    const { stdout } = await sbx.commands.run("echo $GREETING");
    assert.equal(stdout, "hello\n");
  });

  it("connect, getInfo, isRunning", async () => {
    const again = await Sandbox.connect(sbx.sandboxId);
    assert.equal(again.sandboxId, sbx.sandboxId);
    const info = await again.getInfo();
    assert.equal(info.state, "running");
    assert.deepEqual(info.env.GREETING, "hello");
    assert.equal(await again.isRunning(), true);
    assert.equal((await again.commands.run("cat /proc/sys/kernel/hostname")).exitCode, 0);
  });

  it("list filters by metadata", async () => {
    const mine = await Sandbox.list({ metadata: { suite } });
    assert.deepEqual(
      mine.map((s) => s.sandboxId),
      [sbx.sandboxId],
    );
    assert.deepEqual(await Sandbox.list({ metadata: { suite, role: "other" } }), []);
    const all = await Sandbox.list();
    assert.ok(all.some((s) => s.sandboxId === sbx.sandboxId));
  });

  it("setTimeout moves the deadline", async () => {
    await sbx.setTimeout(1_200_000);
    const info = await sbx.getInfo();
    assert.ok(info.expiresAt);
    const left = info.expiresAt.getTime() - Date.now();
    assert.ok(left > 1_100_000 && left <= 1_201_000, `expires in ${left} ms`);
  });

  it("getHost reaches a port in the sandbox", async () => {
    const server = await sbx.commands.start("mkdir -p /srv/www && echo served > /srv/www/index.html && cd /srv/www && exec python3 -m http.server 8080");
    try {
      const host = await sbx.getHost(8080);
      assert.match(host, /^[\w.-]+:\d+$/);
      let body = "";
      for (let i = 0; i < 50 && body !== "served\n"; i++) {
        try {
          body = await (await fetch(`http://${host}/index.html`)).text();
        } catch {
          await new Promise((r) => setTimeout(r, 200));
        }
      }
      assert.equal(body, "served\n");
    } finally {
      await server.kill();
    }
  });

  it("setNetwork changes the egress rules", async () => {
    await sbx.setNetwork({ denyOut: ["203.0.113.0/24"] });
    let info = await sbx.getInfo();
    assert.deepEqual(info.network?.denyOut, ["203.0.113.0/24"]);
    await sbx.setNetwork({ internet: false });
    info = await sbx.getInfo();
    assert.equal(info.internet, false);
    await sbx.setNetwork({ internet: true, denyOut: [] });
    assert.equal((await sbx.getInfo()).internet, true);
  });

  it("pause keeps everything; resume brings it back under the same id", async () => {
    await sbx.files.write("/root/kept.txt", "before pause");
    const sleeper = await sbx.commands.start("sleep 3000");
    await sbx.pause();
    assert.equal(sbx.info.state, "paused");
    assert.equal(await sbx.isRunning(), false);
    await sbx.resume({ timeoutMs: 600_000 });
    assert.equal(sbx.info.state, "running");
    assert.equal(await sbx.files.read("/root/kept.txt"), "before pause");
    assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid), "the process survived");
    await sleeper.kill();
    await assert.rejects(sbx.resume(), InvalidStateError);
  });

  it("a filesystem-only pause keeps the files; the resume boots from the disk", async () => {
    await sbx.files.write("/root/disk.txt", "on disk");
    const sleeper = await sbx.commands.start("sleep 3000");
    await sbx.pause({ memory: false });
    assert.equal(sbx.info.state, "paused");
    await sbx.resume();
    assert.equal(await sbx.files.read("/root/disk.txt"), "on disk");
    assert.ok(!(await sbx.commands.list()).some((p) => p.pid === sleeper.pid), "booted afresh");
    const snap = await sbx.createSnapshot({ memory: false });
    assert.equal(snap.info.memory, false);
    assert.equal((await snap.wait()).info.state, "ready");
    assert.equal(await Snapshot.delete(snap.snapshotId), true);
  });

  it("kill: true once, then false; gone afterwards", async () => {
    const short = cleanup.sandbox(await Sandbox.create({ metadata: { suite, role: "short" } }));
    assert.equal(await short.kill(), true);
    assert.equal(await short.kill(), false);
    assert.equal(await short.isRunning(), false);
    // A killed sandbox is still described (state "stopped"), but nothing runs in it.
    assert.equal((await short.getInfo()).state, "stopped");
    await assert.rejects(short.commands.run("true"), NotFoundError);
  });

  it("await using kills the sandbox at the end of the scope", async () => {
    let id: string;
    {
      await using scoped = await Sandbox.create({ metadata: { suite, role: "scoped" } });
      id = scoped.sandboxId;
      assert.equal((await scoped.commands.run("echo in scope")).stdout, "in scope\n");
    }
    const after = await Sandbox.connect(id);
    assert.equal(after.info.state, "stopped");
    assert.equal(await after.isRunning(), false);
  });

  it("the Sandlot client: sandboxes, templates, health", async () => {
    const client = new Sandlot();
    const health = await client.health();
    assert.equal(health.status, "ok");
    const templates = await client.templates.list();
    assert.ok(templates.some((t) => t.name === "base"));
    const base = await client.templates.get("base");
    assert.ok(base.memoryMb > 0 && base.hash);
    const made = cleanup.sandbox(await client.sandboxes.create({ metadata: { suite, role: "client" } }));
    assert.equal((await client.sandboxes.getInfo(made.sandboxId)).state, "running");
    assert.equal((await client.sandboxes.connect(made.sandboxId)).sandboxId, made.sandboxId);
    assert.deepEqual(
      (await client.sandboxes.list({ metadata: { suite, role: "client" } })).map((s) => s.sandboxId),
      [made.sandboxId],
    );
    const paused = await client.sandboxes.pause(made.sandboxId);
    assert.equal(paused.state, "paused");
    const resumed = await client.sandboxes.resume(made.sandboxId);
    assert.equal(resumed.info.state, "running");
    assert.equal(await client.sandboxes.kill(made.sandboxId), true);
    const stopped = await client.sandboxes.list({ metadata: { suite, role: "client" }, includeStopped: true });
    assert.equal(stopped[0]?.state, "stopped");
  });

  it("getMetrics: the host's samples; hosts: this one", async () => {
    await sbx.commands.run("timeout 2 sh -c 'while :; do :; done'; true");
    const metrics = await sbx.getMetrics();
    assert.ok(metrics.length > 0);
    const last = metrics[metrics.length - 1];
    assert.ok(last.timestamp instanceof Date && last.memTotal > 0 && last.diskTotal > 0);
    assert.ok(metrics.every((m) => m.cpuUsedPct >= 0 && m.cpuUsedPct <= 100));
    assert.deepEqual(await sbx.getMetrics({ start: new Date(Date.now() + 3_600_000) }), []);
    const hosts = await new Sandlot().hosts.list();
    assert.equal(hosts.length, 1);
    assert.equal(hosts[0].state, "active");
    assert.equal((await sbx.getInfo()).host, hosts[0].id);
  });

  it("errors: wrong key, unknown ids, invalid input", async () => {
    await assert.rejects(Sandbox.list({ apiKey: "sl_wrong" }), AuthenticationError);
    await assert.rejects(Sandbox.connect("sb-doesnotexist"), NotFoundError);
    await assert.rejects(Sandbox.create({ template: "no-such-template" }), NotFoundError);
    await assert.rejects(Sandbox.create({ memoryMb: 1 << 20 }), InvalidArgumentError);
    await assert.rejects(new Sandlot().templates.get("no-such-template"), NotFoundError);
  });
});
