"""Snapshot/fork stress: a bounded loop of fork(N) and snapshot + restores of a sandbox that is
busy in the kernel, against a server of its own. It counts children and restores that failed to
start, and the server's "restoring again" warnings (a restored guest that did not answer).

    .venv/bin/python bench/stress.py [--rounds 20] [--fork 8] [--restores 4]

This loop found the precopy page loss (docs/design.md, "Snapshots"); it prints no timings.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import BenchServer  # noqa: E402
from sandlot import Sandbox  # noqa: E402

BUSY = ("python3 -c 'import os, time; b = bytearray(os.urandom(50 << 20)); time.sleep(3600)' "
        ">/dev/null 2>&1 & sleep 0.2")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--fork", type=int, default=8, help="children per fork")
    p.add_argument("--restores", type=int, default=4, help="restores per snapshot")
    args = p.parse_args(argv)
    server = BenchServer.make(Path(tempfile.mkdtemp(prefix="sandlot-stress-")))
    server.start()
    failures = 0
    t0 = time.monotonic()
    try:
        kw = server.client_kwargs()
        parent = Sandbox.create(**kw, timeout=3600)
        for round_ in range(1, args.rounds + 1):
            parent.commands.run(BUSY)  # a new busy process each round
            kids = parent.fork(args.fork)
            failures += len(kids.errors)
            for err in kids.errors:
                print(f"round {round_}: fork child failed: {str(err)[:300]}", flush=True)
            for kid in kids:
                if not kid.commands.run("cat /run/sandlot/generation").ok:
                    failures += 1
                kid.kill()
            parent.commands.run(BUSY)
            snap = parent.create_snapshot()
            snap.wait(timeout=300)
            for _ in range(args.restores):
                try:
                    restored = snap.restore()
                except Exception as e:  # noqa: BLE001 - counted and shown
                    failures += 1
                    print(f"round {round_}: restore failed: {str(e)[:300]}", flush=True)
                    continue
                if not restored.commands.run("true").ok:
                    failures += 1
                restored.kill()
            snap.remove()
            parent.commands.run("pkill -f 'os.urandom' || true")
            print(f"round {round_}/{args.rounds}: {failures} failures so far", flush=True)
    finally:
        server.close()
        warnings = sum("restoring again" in line for line in open(server.log_path))
    print(f"{args.rounds} rounds in {time.monotonic() - t0:.0f} s: {failures} failed starts, "
          f"{warnings} guests restored a second time (server log: {server.log_path})")
    return 1 if failures or warnings else 0


if __name__ == "__main__":
    raise SystemExit(main())
