"""Fork and compare: checkpoint a baseline, restore it into N branches, run a different
experiment in each, compare, keep the winner and destroy the losers.

Seed scenario: "Snapshot & fork" (the fork-and-compare pattern; also "Branch sandbox state").
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import json
import sys

from sandlot import Sandlot

# The "experiment": fit a scale factor to a dataset with one of three approaches.
EXPERIMENT = """
import json, sys
data = [float(x) for x in open("/work/data.txt").read().split()]
mean = sum(data) / len(data)
approach = sys.argv[1]
factor = {"x": 1.0, "y": 10 / mean, "z": 3.0}[approach]
loss = abs(factor * mean - 10)
json.dump({"approach": approach, "loss": loss}, open("/work/result.json", "w"))
print(loss)
"""


def main() -> int:
    with Sandlot() as client:
        base = client.sandboxes.create(timeout=300)
        branches = {}
        snap = None
        try:
            # Step 2: the expensive setup, once; then checkpoint it.
            base.files.write("/work/data.txt", " ".join(str(i) for i in range(1, 101)))
            base.files.write("/work/experiment.py", EXPERIMENT)
            snap = base.create_snapshot()
            snap.wait(timeout=120)
            print(f"baseline {base.sandbox_id} checkpointed as {snap.snapshot_id}")

            # Step 3: one restore per branch; each is an independent sandbox.
            for approach in ("x", "y", "z"):
                branches[approach] = client.snapshots.restore(base.sandbox_id,
                                                              snap.snapshot_id)

            # Step 4: run each branch's experiment and collect the metric.
            losses = {}
            for approach, sbx in branches.items():
                out = sbx.commands.run(f"python3 /work/experiment.py {approach}", check=True)
                losses[approach] = float(out.stdout)
                print(f"branch {approach} ({sbx.sandbox_id}): loss {losses[approach]:.3f}")

            # Step 5: keep the winner, destroy the losers.
            winner = min(losses, key=losses.get)
            for approach in [a for a in branches if a != winner]:
                branches.pop(approach).kill()
            kept = branches[winner]
            result = json.loads(kept.files.read("/work/result.json"))
            print(f"winner: {winner} in {kept.sandbox_id}; losers destroyed")
            if winner != "y" or result["approach"] != "y":
                print(f"unexpected winner {winner} / {result}", file=sys.stderr)
                return 1
            # The baseline never saw any branch's work.
            if base.files.exists("/work/result.json"):
                print("a branch's result leaked into the baseline", file=sys.stderr)
                return 1
            return 0
        finally:
            for sbx in branches.values():
                sbx.kill()
            base.kill()
            if snap is not None:
                snap.remove()


if __name__ == "__main__":
    sys.exit(main())
