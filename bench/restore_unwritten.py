"""A restore right after a snapshot is ready, while its RAM file is still being written (issue
25, item 5), side by side in one run with the way it went before and with a restore once the
file is written:

    python bench/restore_unwritten.py [--runs 5] [--ballast-mib 128] [--json FILE]

Two servers (pool off), one with `SANDLOT_RESTORE_UNWRITTEN=off` (a restore waits for the
file, as every one did before). On each, a sandbox holding `--ballast-mib` MiB of random data
in a process (memory changed since its restore: what the snapshot's RAM file adds to its
source's). Per run, on each server in turn: a snapshot, `wait()`, and at once a restore to its
first command (`true`); then, once the RAM file is written (the cache entry's `.ok`), another
restore to its first command. The server's log gives how long the file took to write.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pause import start_holder  # noqa: E402
from _server import BenchServer  # noqa: E402
from _stats import ms_since  # noqa: E402
from sandlot import Sandbox  # noqa: E402

TIMEOUT = 1800
WROTE = re.compile(r"wrote the RAM files of (\S+) in ([\d.]+) ms( \(restores started)?")


def _first_command(server: BenchServer, snapshot_id: str) -> tuple[float, Sandbox]:
    t0 = time.monotonic()
    sbx = Sandbox.create(snapshot_id=snapshot_id, timeout=TIMEOUT, **server.client_kwargs())
    sbx.commands.run("true", check=True, timeout=600)
    return ms_since(t0), sbx


def _wrote(server: BenchServer, key: str) -> tuple[float, bool] | None:
    for line in server.log_path.read_text().splitlines():
        m = WROTE.search(line)
        if m and m.group(1) == key:
            return float(m.group(2)), bool(m.group(3))
    return None


def _ram_written(server: BenchServer, key: str) -> None:
    ok = server.shm_root / "hot" / key / ".ok"
    deadline = time.monotonic() + 120
    while not ok.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the RAM file of {key} was not written within 120 s")
        time.sleep(0.05)


def _one_run(server: BenchServer, source: Sandbox) -> dict:
    source.commands.run("true", check=True)
    snap = source.create_snapshot().wait(timeout=600)
    right_after, one = _first_command(server, snap.snapshot_id)
    _ram_written(server, snap.snapshot_id)
    written, two = _first_command(server, snap.snapshot_id)
    wrote = _wrote(server, snap.snapshot_id)
    for sbx in (one, two):
        sbx.kill()
    snap.remove()
    return {"right_after_ready_ms": round(right_after), "after_the_file_ms": round(written),
            "ram_file_ms": round(wrote[0]) if wrote else None,
            "took_the_pages": bool(wrote and wrote[1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ballast-mib", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandlot-unwritten-bench-"))
    # on: the default; off: SANDLOT_RESTORE_UNWRITTEN=off, a restore waits for the file (before)
    servers = {mode: BenchServer.in_dir(root / mode, f"u{time.monotonic_ns() % 10000}{mode}",
                                        extra_env={"SANDLOT_POOL_SIZE": "0",
                                                   "SANDLOT_RESTORE_UNWRITTEN": mode})
               for mode in ("on", "off")}
    rows: list[dict] = []
    try:
        sources = {}
        for mode, server in servers.items():
            server.start(timeout=120)
            sources[mode] = Sandbox.create(timeout=TIMEOUT, **server.client_kwargs())
            start_holder(sources[mode], args.ballast_mib)
        for run in range(args.runs):
            for mode, server in servers.items():  # side by side, alternating
                row = {"run": run, "mode": mode, **_one_run(server, sources[mode])}
                rows.append(row)
                print(json.dumps(row), flush=True)
        for source in sources.values():
            source.kill()
    finally:
        for server in servers.values():
            server.close()
        shutil.rmtree(root, ignore_errors=True)

    def p50(mode: str, key: str) -> float | None:
        values = [r[key] for r in rows if r["mode"] == mode and r[key] is not None]
        return statistics.median(values) if values else None

    summary: dict = {"runs": args.runs, "ballast_mib": args.ballast_mib}
    for mode in servers:
        for key in ("right_after_ready_ms", "after_the_file_ms", "ram_file_ms"):
            summary[f"{key}_p50_{mode}"] = p50(mode, key)
        summary[f"took_the_pages_{mode}"] = sum(
            r["took_the_pages"] for r in rows if r["mode"] == mode)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
