"""Checkpoint before a long task and retry from it: snapshot after the expensive download, run
the training step that may fail (here it corrupts its input, then dies), and retry from the
checkpoint instead of downloading again.

Seed scenario: "Snapshots" (checkpoint long-running tasks).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
"""

import sys

from sandlot import Sandbox

DOWNLOAD = "mkdir -p /data && seq 1 200000 > /data/dataset.txt && wc -l < /data/dataset.txt"

# Fails on the first attempt after truncating its input, as a crashed job might.
TRAIN = """
import os, sys
lines = open("/data/dataset.txt").read().split()
if os.environ.get("ATTEMPT") == "1":
    open("/data/dataset.txt", "w").write("\\n".join(lines[: len(lines) // 3]))
    sys.exit("out of memory at epoch 3")
print(len(lines), sum(int(x) for x in lines))
"""


def main() -> int:
    sbx = Sandbox.create(timeout=300)
    checkpoint = None
    try:
        rows = sbx.commands.run(DOWNLOAD, check=True).stdout.strip()
        sbx.files.write("/data/train.py", TRAIN)
        print(f"downloaded {rows} rows; checkpointing")
        checkpoint = sbx.create_snapshot()
        checkpoint.wait(timeout=120)

        result = sbx.commands.run("python3 /data/train.py", env={"ATTEMPT": "1"})
        print(f"attempt 1: exit {result.exit_code} ({result.stderr.strip()})")
        if result.ok:
            return 1
        # Retry from the checkpoint: a new sandbox, the dataset intact, no new download.
        sbx.kill()
        sbx = checkpoint.restore_with(env={"ATTEMPT": "2"}, timeout=120)
        result = sbx.commands.run("python3 /data/train.py")
        print(f"attempt 2 in {sbx.sandbox_id}: exit {result.exit_code}: {result.stdout.strip()}")
        return 0 if result.stdout.split() == ["200000", str(200000 * 200001 // 2)] else 1
    finally:
        sbx.kill()
        if checkpoint is not None:
            checkpoint.remove()


if __name__ == "__main__":
    sys.exit(main())
