"""Parallel experiments: prepare once, fork the sandbox into children, run a different
hyper-parameter in each child at the same time, and compare. The parent keeps running.

Seed scenarios: "Fork" (parallel experiments) and "Checkpoints & Rollback" (fork for parallel
hypotheses).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

from sandlot import Sandbox

# A toy "training run": gradient descent on (w - 3)^2 with a given learning rate.
TRAIN = """
import sys
lr = float(sys.argv[1].split("=")[1])
w = 0.0
for _ in range(50):
    w -= lr * 2 * (w - 3)
print(f"{abs(w - 3):.6f}")
"""


def main() -> int:
    parent = Sandbox.create(timeout=300)
    children = []
    try:
        parent.files.write("/work/train.py", TRAIN)
        parent.commands.run("python3 -m compileall -q /work", check=True)  # the "setup"
        rates = ["0.001", "0.01", "0.1"]
        children = parent.fork(count=len(rates))
        if children.errors:
            print(f"some children failed to start: {children.errors}", file=sys.stderr)
            return 1

        def train(child: Sandbox, lr: str) -> float:
            out = child.commands.run(f"python3 /work/train.py --lr={lr}", timeout=60, check=True)
            return float(out.stdout)

        with ThreadPoolExecutor(len(children)) as pool:
            errors = dict(zip(rates, pool.map(train, children, rates), strict=True))
        for lr, error in errors.items():
            print(f"lr={lr}: error {error:.6f}")
        best = min(errors, key=errors.get)
        print(f"best learning rate: {best}")
        if best != "0.1" or not parent.commands.run("true").ok:
            return 1
        return 0
    finally:
        for child in children:
            child.kill()
        parent.kill()


if __name__ == "__main__":
    sys.exit(main())
