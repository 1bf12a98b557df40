/**
 * Roll back on failure: checkpoint before a risky step; when it fails, get the known-good state
 * back, first as a new sandbox restored from the snapshot (as the seed does), then in place with
 * `rollback`, which keeps the sandbox's id.
 *
 * Seed scenario: "Checkpoints & Rollback" (roll back to a snapshot; also "restore to a
 * known-good state on failure").
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandbox, Snapshot } from "sandlot";

const sandbox = await Sandbox.create({ timeoutMs: 300_000 });
let snap: Snapshot | undefined;
try {
  await sandbox.commands.run("echo 'state-ok' > /tmp/state.txt", { check: true });
  snap = await sandbox.snapshot();

  const failed = await sandbox.commands.run("rm /tmp/state.txt && exit 1");
  if (failed.exitCode === 0) throw new Error("the risky step was meant to fail");
  console.log(`risky step failed (exit ${failed.exitCode}); /tmp/state.txt is gone`);

  // As a new sandbox from the checkpoint:
  await snap.wait();
  const rolled = await snap.restore();
  try {
    const r = await rolled.commands.run("cat /tmp/state.txt");
    console.log(`restored ${rolled.sandboxId}: ${r.stdout.trim()}`);
    if (r.stdout.trim() !== "state-ok") throw new Error("the restore lost the state");
  } finally {
    await rolled.destroy();
  }

  // Or in place: the same sandbox, same id, back at the checkpoint.
  await sandbox.rollback(snap);
  const r = await sandbox.commands.run("cat /tmp/state.txt");
  console.log(`rolled back ${sandbox.sandboxId} in place: ${r.stdout.trim()}`);
  if (r.stdout.trim() !== "state-ok") throw new Error("the rollback lost the state");
} finally {
  // kill() answers false for a sandbox that is already gone, so cleanup needs no guard.
  await sandbox.kill();
  await snap?.remove();
}
