"""Sandboxes from an OCI image: prepare once, checkpoint, fork workers, restore with
overrides, roll back. The first create from an image pulls it and builds a template from it
(by digest); every later create, fork and restore is a restore, never a boot.

Seed scenarios: "Snapshots" (`Sandbox::builder("base").image("python:3.12")`, save a named
snapshot, fork workers, restore with overrides) and "Checkpoints & Rollback"
(`create({ image: 'python:3.12-slim' })`, snapshot and restore, fork, roll back).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment; the image is
SANDLOT_EXAMPLE_IMAGE (default python:3.12-slim; the tests use one in a local registry).
"""

import os
import sys
import uuid

from sandlot import Sandbox, Snapshot

IMAGE = os.environ.get("SANDLOT_EXAMPLE_IMAGE", "python:3.12-slim")
# The "pip install -r requirements.txt" of the seeds, without a package index: a module the
# workers import instead of installing it again.
LIB = "VERSION = '1.0'\ndef score(variant):\n    return variant * 7\n"
RUN = "python3 -c 'import sys; sys.path.insert(0, \"/tmp/lib\"); import lib; print({})'"


def main() -> int:
    name = f"after-install-{uuid.uuid4().hex[:6]}"
    base = Sandbox.create(image=IMAGE, timeout=600)
    workers: list[Sandbox] = []
    try:
        print(f"sandbox {base.sandbox_id} from {IMAGE} (template {base.info.template})")
        base.files.write("/tmp/lib/lib.py", LIB)
        base.commands.run(RUN.format("lib.VERSION"), check=True)
        snap = base.create_snapshot(name=name)        # save it under a name
        snap.wait(timeout=300)

        saved = Snapshot.get(name)                      # load it by name, fork workers
        workers = [saved.restore() for _ in range(3)]
        for i, worker in enumerate(workers):
            out = worker.commands.run(RUN.format(f"lib.score({i})"), check=True).stdout
            print(f"worker {i}: {out.strip()}")
            if out.strip() != str(i * 7):
                return 1

        custom = saved.restore_with(memory_mb=768, cpus=2, env={"WORKER_ID": "42"})
        workers.append(custom)
        out = custom.commands.run("echo $WORKER_ID; nproc", check=True).stdout.split()
        print(f"restored with overrides: WORKER_ID={out[0]}, {out[1]} cpus")
        if out != ["42", "2"]:
            return 1

        # Roll back: a step that breaks the state, then back to the checkpoint, same id.
        base.commands.run("rm -rf /tmp/lib")
        base.rollback(snap)
        out = base.commands.run(RUN.format("lib.VERSION")).stdout.strip()
        print(f"after the rollback: lib {out}")
        if out != "1.0":
            return 1
        names = [s.name for s in Snapshot.list()]
        print(f"named snapshots include {name}: {name in names}")
    finally:
        for worker in workers:
            worker.kill()
        base.kill()
        Snapshot.delete(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
