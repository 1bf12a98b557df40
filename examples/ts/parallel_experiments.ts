/**
 * Parallel experiments: set up once, then fork three times from the same decision point and
 * train with a different learning rate in each, all at once.
 *
 * Seed scenario: "Fork" (parallel experiments).
 * Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
 */
import { Sandbox } from "sandlot";

const TRAIN = `
import sys
lr = float(sys.argv[1].split("=")[1])
w = float(open("/work/init.txt").read())
for _ in range(50):
    w -= lr * 2 * (w - 3.0)   # gradient of (w - 3)^2
print(f"{lr} {abs(w - 3.0):.6f}")
`;

const sandbox = await Sandbox.create({ timeoutMs: 300_000 });
try {
  await sandbox.commands.run("mkdir -p /work && echo 10.0 > /work/init.txt", { check: true });
  await sandbox.files.write("/work/train.py", TRAIN);
  const [expA, expB, expC] = await Promise.all([sandbox.fork(), sandbox.fork(), sandbox.fork()]).then((lists) =>
    lists.map(([child]) => child),
  );
  try {
    const results = await Promise.all([
      expA.commands.run("python3 /work/train.py --lr=0.001", { check: true }),
      expB.commands.run("python3 /work/train.py --lr=0.01", { check: true }),
      expC.commands.run("python3 /work/train.py --lr=0.1", { check: true }),
    ]);
    const errors = results.map((r) => r.stdout.trim().split(" ").map(Number));
    for (const [lr, err] of errors) console.log(`lr=${lr}: distance to optimum ${err}`);
    const best = errors.reduce((a, b) => (b[1] < a[1] ? b : a));
    console.log(`best learning rate: ${best[0]}`);
    if (best[0] !== 0.1) throw new Error(`unexpected best ${best[0]}`);
  } finally {
    await Promise.all([expA.kill(), expB.kill(), expC.kill()]);
  }
} finally {
  await sandbox.kill();
}
