/**
 * Sandboxes from an OCI image: prepare once, snapshot and restore, fork children for
 * parallel variants, roll back on failure. The first create from an image pulls it and
 * builds a template from it (by digest); later creates, forks and restores are restores.
 *
 * Seed scenario: "Checkpoints & Rollback" (`create({ image: 'python:3.12-slim' })`).
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment; the image is
 * SANDLOT_EXAMPLE_IMAGE (default python:3.12-slim; the tests use one in a local registry).
 */
import { Sandlot, Sandbox } from "sandlot";

const IMAGE = process.env.SANDLOT_EXAMPLE_IMAGE ?? "python:3.12-slim";
const client = new Sandlot();
// The seed's `pip install numpy pandas`, without a package index: a module later runs import.
const LIB = "VERSION = '1.26.4'\ndef evaluate(variant):\n    return variant * 10\n";
const py = (expr: string) =>
  `python3 -c 'import sys; sys.path.insert(0, "/tmp/lib"); import lib; print(${expr})'`;

// Snapshot and restore.
const sandbox = await Sandbox.create({ image: IMAGE, timeoutMs: 600_000 });
let snapshotId: string;
try {
  console.log(`sandbox ${sandbox.sandboxId} from ${IMAGE} (template ${sandbox.info.template})`);
  await sandbox.files.write("/tmp/lib/lib.py", LIB);
  await sandbox.commands.run(py("lib.VERSION"), { check: true });
  const snap = await sandbox.snapshot();
  await snap.wait();
  snapshotId = snap.snapshotId;
} finally {
  await sandbox.destroy();
}
const restored = await client.snapshots.restore(null, snapshotId);
try {
  const r = await restored.commands.run(py("lib.VERSION"), { timeoutMs: 30_000 });
  console.log(`restored: lib ${r.stdout.trim()}`);
  if (r.stdout.trim() !== "1.26.4") throw new Error(`unexpected output: ${r.stdout}`);

  // Fork for parallel hypotheses: each child starts from the prepared state.
  const children = await restored.fork(3);
  try {
    const results = await Promise.all(
      children.map((child, i) => child.commands.run(py(`lib.evaluate(${i})`), { timeoutMs: 30_000 })),
    );
    results.forEach((r, i) => console.log(`variant ${i}: ${r.stdout.trim()}`));
    if (results.some((r, i) => r.stdout.trim() !== String(i * 10))) throw new Error("bad variant output");
  } finally {
    await Promise.all(children.map((c) => c.destroy()));
  }

  // Roll back to the snapshot after a failing step.
  await restored.commands.run("echo 'state-ok' > /tmp/state.txt", { check: true });
  const checkpoint = await restored.snapshot();
  await checkpoint.wait();
  const failed = await restored.commands.run("rm /tmp/state.txt && exit 1");
  if (failed.exitCode !== 0) {
    await restored.rollback(checkpoint);
    const r = await restored.commands.run("cat /tmp/state.txt");
    console.log(`after the rollback: ${r.stdout.trim()}`);
    if (r.stdout.trim() !== "state-ok") throw new Error("rollback did not restore the file");
  }
  await client.snapshots.delete(checkpoint.snapshotId);
} finally {
  await restored.destroy();
  await client.snapshots.delete(snapshotId);
}
