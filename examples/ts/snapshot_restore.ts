/**
 * Snapshot and restore: do the expensive setup once, snapshot it, destroy the sandbox, and
 * later restore the snapshot by id into a new sandbox that already has everything.
 *
 * Seed scenario: "Checkpoints & Rollback" (snapshot and restore; also "warm start").
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandlot, Sandbox } from "sandlot";

const client = new Sandlot();

const sandbox = await Sandbox.create({ timeoutMs: 300_000 });
let snapshotId: string;
try {
  // The "install": a module the later runs import instead of building it again.
  await sandbox.files.write("/opt/lib/numlib.py", "VERSION = '1.26.4'\ndef mean(xs):\n    return sum(xs) / len(xs)\n");
  await sandbox.commands.run("python3 -c 'import sys; sys.path.insert(0, \"/opt/lib\"); import numlib'", { check: true });
  const snap = await sandbox.snapshot();
  await snap.wait();
  snapshotId = snap.snapshotId;
} finally {
  await sandbox.destroy();
}
console.log(`snapshot ${snapshotId} of ${sandbox.sandboxId}; the sandbox is destroyed`);

// Later, anywhere that shares the server's store:
const restored = await client.snapshots.restore(null, snapshotId);
try {
  const r = await restored.commands.run(
    "python3 -c 'import sys; sys.path.insert(0, \"/opt/lib\"); import numlib; print(numlib.VERSION, numlib.mean([1, 2, 3]))'",
    { timeoutMs: 30_000 },
  );
  console.log(r.stdout.trim());
  if (r.stdout.trim() !== "1.26.4 2.0") throw new Error(`unexpected output: ${r.stdout}`);
} finally {
  await restored.destroy();
  await client.snapshots.delete(snapshotId);
}
