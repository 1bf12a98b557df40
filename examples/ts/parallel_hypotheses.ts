/**
 * Fork for parallel hypotheses: prepare a parent once, fork it into five children and evaluate
 * one variant in each, all at once; destroy the children and the parent in `finally`.
 *
 * Seed scenario: "Checkpoints & Rollback" (fork for parallel hypotheses).
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandbox } from "sandlot";

const EVALUATE = `
import sys
variant = int(sys.argv[1].split("=")[1])
weights = [float(x) for x in open("/work/weights.txt").read().split()]
print(variant, sum(w * (variant + 1) for w in weights))
`;

const parent = await Sandbox.create({ timeoutMs: 300_000 });
try {
  // The expensive preparation, done once in the parent.
  await parent.files.write("/work/weights.txt", "0.5 1.5 2.0");
  await parent.files.write("/work/evaluate.py", EVALUATE);
  const children = await parent.fork(5);
  if (children.errors.length) throw children.errors[0];
  try {
    const results = await Promise.all(
      children.map((child, i) => child.commands.run(`python3 /work/evaluate.py --variant=${i}`, { timeoutMs: 60_000, check: true })),
    );
    const scores = results.map((r) => r.stdout.trim());
    console.log(`forked in ${children.pauseMs?.toFixed(1)} ms of parent pause:`, scores.join(" | "));
    if (scores.join(",") !== "0 4.0,1 8.0,2 12.0,3 16.0,4 20.0") throw new Error(`unexpected scores ${scores}`);
  } finally {
    await Promise.all(children.map((c) => c.destroy()));
  }
} finally {
  await parent.destroy();
}
