"""Warm start: do the expensive install once, snapshot it, and start every later sandbox from
that snapshot: the libraries are already there, and so is the warmed-up interpreter state.

Seed scenarios: "Snapshots" (warm start from a snapshot after an expensive install) and
"Checkpoints & Rollback" (snapshot, destroy the sandbox, restore later).
Run against a server: SANDLOT_URL and SANDLOT_API_KEY in the environment.
The install is simulated locally (a venv, a package and a "model" file), not downloaded.
"""

import secrets
import sys
import time

from sandlot import Sandbox, Snapshot

INSTALL = """
set -e
python3 -m venv --without-pip /opt/venv
site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/fastcalc" /opt/models
cat > "$site/fastcalc/__init__.py" <<'PY'
__version__ = "2.1.0"
def mean(xs):
    return sum(xs) / len(xs)
PY
/opt/venv/bin/python -m compileall -q "$site/fastcalc"
head -c 16M /dev/urandom > /opt/models/model.bin
sha256sum /opt/models/model.bin | cut -d' ' -f1 > /opt/models/model.sha256
"""

CHECK = ("/opt/venv/bin/python -c 'import fastcalc; print(fastcalc.__version__, "
         "fastcalc.mean([1, 2, 3]))'; [ \"$(sha256sum /opt/models/model.bin | cut -d' ' -f1)\" = "
         "\"$(cat /opt/models/model.sha256)\" ] && echo model-ok")


def main() -> int:
    name = f"warm-start-{secrets.token_hex(3)}"
    # One-time setup.
    setup = Sandbox.create(timeout=300)
    try:
        t = time.perf_counter()
        setup.commands.run(INSTALL, timeout=300, check=True)
        install_s = time.perf_counter() - t
        snap = setup.create_snapshot(name=name)
        snap.wait(timeout=120)
    finally:
        setup.kill()
    print(f"installed in {install_s:.1f} s; snapshot {snap.snapshot_id} named {name!r}")

    # Later (any process that knows the name): a fast warm start for every run.
    try:
        saved = Snapshot.get(name)
        for run in range(3):
            t = time.perf_counter()
            with Sandbox.create(snapshot_id=saved.snapshot_id, timeout=120) as agent:
                start_s = time.perf_counter() - t
                out = agent.commands.run(CHECK).stdout.split()
                print(f"run {run}: sandbox ready in {start_s * 1000:.0f} ms -> {out}")
                if out != ["2.1.0", "2.0", "model-ok"]:
                    return 1
        return 0
    finally:
        Snapshot.delete(name)


if __name__ == "__main__":
    sys.exit(main())
