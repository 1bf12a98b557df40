"""A restore right after a snapshot is ready, while its RAM file is still being written (issue
25, item 5), side by side in one run with the same restore once the file is written:

    python bench/restore_unwritten.py [--runs 5] [--ballast-mib 128] [--json FILE]

Per run, on one server (pool off): a sandbox holding `--ballast-mib` MiB of random data in a
process (memory changed since its restore: what the snapshot's RAM file adds to its source's),
a snapshot, `wait()`, and at once a restore to its first command (`true`): it starts from the
source's RAM file and the captured pages (runtime/unwritten.py). Then, once the RAM file is
written (the cache entry's `.ok`), another restore to its first command: the path every restore
took before, less the wait. The server's log gives how long the file took to write (what a
restore right after `ready` waited for before this change).
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ballast-mib", type=int, default=128)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandlot-unwritten-bench-"))
    server = BenchServer.in_dir(root / "s", f"u{time.monotonic_ns() % 10000}",
                                extra_env={"SANDLOT_POOL_SIZE": "0"})
    rows: list[dict] = []
    try:
        server.start(timeout=120)
        kw = server.client_kwargs()
        source = Sandbox.create(timeout=TIMEOUT, **kw)
        start_holder(source, args.ballast_mib)
        for run in range(args.runs):
            source.commands.run("true", check=True)
            snap = source.create_snapshot().wait(timeout=600)
            right_after, one = _first_command(server, snap.snapshot_id)
            _ram_written(server, snap.snapshot_id)
            written, two = _first_command(server, snap.snapshot_id)
            wrote = _wrote(server, snap.snapshot_id)
            row = {"run": run, "right_after_ready_ms": round(right_after),
                   "after_the_file_ms": round(written),
                   "ram_file_ms": round(wrote[0]) if wrote else None,
                   "restore_took_the_pages": bool(wrote and wrote[1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for sbx in (one, two):
                sbx.kill()
            snap.remove()
        source.kill()
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)

    def p50(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    summary = {"runs": len(rows), "ballast_mib": args.ballast_mib,
               "right_after_ready_ms_p50": p50("right_after_ready_ms"),
               "after_the_file_ms_p50": p50("after_the_file_ms"),
               "ram_file_ms_p50": p50("ram_file_ms"),
               "took_the_pages": sum(r["restore_took_the_pages"] for r in rows), "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
