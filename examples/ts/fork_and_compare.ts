/**
 * Fork and compare: checkpoint a baseline, restore it into one branch per approach, run each
 * experiment, compare, keep the winner and destroy the losers.
 *
 * Seed scenario: "Snapshot & fork" (the fork-and-compare pattern; also "Branch sandbox state").
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandlot, type Sandbox, type Snapshot } from "sandlot";

// The "experiment": fit a scale factor to a dataset with one of three approaches.
const EXPERIMENT = `
import json, sys
data = [float(x) for x in open("/work/data.txt").read().split()]
mean = sum(data) / len(data)
approach = sys.argv[1]
factor = {"x": 1.0, "y": 10 / mean, "z": 3.0}[approach]
loss = abs(factor * mean - 10)
json.dump({"approach": approach, "loss": loss}, open("/work/result.json", "w"))
print(loss)
`;

const client = new Sandlot();
const base = await client.sandboxes.create({ timeoutMs: 300_000 });
const branches = new Map<string, Sandbox>();
let snap: Snapshot | undefined;
try {
  // Step 2: the expensive setup, once; then checkpoint it.
  await base.files.write("/work/data.txt", Array.from({ length: 100 }, (_, i) => i + 1).join(" "));
  await base.files.write("/work/experiment.py", EXPERIMENT);
  snap = await base.snapshot();
  await snap.wait();
  console.log(`baseline ${base.sandboxId} checkpointed as ${snap.snapshotId}`);

  // Step 3: one restore per branch; each is an independent sandbox.
  for (const approach of ["x", "y", "z"]) {
    branches.set(approach, await client.snapshots.restore(base.sandboxId, snap.snapshotId));
  }

  // Step 4: run every branch's experiment at once and collect the metric.
  const losses = new Map<string, number>();
  await Promise.all(
    [...branches].map(async ([approach, sbx]) => {
      const out = await sbx.commands.run(`python3 /work/experiment.py ${approach}`, { check: true, timeoutMs: 60_000 });
      losses.set(approach, Number(out.stdout));
      console.log(`branch ${approach} (${sbx.sandboxId}): loss ${Number(out.stdout).toFixed(3)}`);
    }),
  );

  // Step 5: keep the winner, destroy the losers.
  const [winner] = [...losses].sort((a, b) => a[1] - b[1])[0];
  for (const [approach, sbx] of branches) {
    if (approach !== winner) {
      await sbx.kill();
      branches.delete(approach);
    }
  }
  const kept = branches.get(winner)!;
  const result = JSON.parse(await kept.files.read("/work/result.json"));
  console.log(`winner: ${winner} in ${kept.sandboxId}; losers destroyed`);
  if (winner !== "y" || result.approach !== "y") throw new Error(`unexpected winner ${winner}`);
  // The baseline never saw any branch's work.
  if (await base.files.exists("/work/result.json")) throw new Error("a branch's result leaked into the baseline");
} finally {
  await Promise.all([...branches.values()].map((s) => s.kill()));
  await base.kill();
  await snap?.remove();
}
