"""What an open console costs the API's hot paths: create, exec and fork(1) with the console's
event stream (GET /v1/events, read as the console reads it) connected and without, on one
server, interleaved round by round so both sides see the same machine load (issue 26).

    python bench/console_cost.py [--rounds 6] [--streams 1] [--json out.json]

Each stream is read by a curl process of its own, as a browser would read it (not a thread of
this client). Without a subscriber core publishes nothing (core/events.py); with one, each
saved record is validated once and queued per subscriber. The table prints the median (p50)
and p90 of each call in ms per side, and how many events the streams read.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from sandlot import Sandbox
from sandlot.testing import ServerProcess

OPS = ("create", "exec", "fork(1)", "kill")


class Listener:
    """A console's event stream, read by a process of its own (as a browser is): curl."""

    def __init__(self, url: str, key: str, out: Path) -> None:
        self.out = out
        self._proc = subprocess.Popen(
            ["curl", "-sN", "-H", f"authorization: Bearer {key}", f"{url}/v1/events"],
            stdout=out.open("wb"), stderr=subprocess.DEVNULL)

    def close(self) -> int:
        """Stop reading; the events it read (its `ready` not counted)."""
        self._proc.terminate()
        self._proc.wait()
        return self.out.read_text().count("event: ") - 1


def one_round(kw: dict, times: dict[str, list[float]]) -> None:
    t0 = time.monotonic()
    box = Sandbox.create(timeout=600, **kw)
    times["create"].append((time.monotonic() - t0) * 1000)
    t0 = time.monotonic()
    box.commands.run("true")
    times["exec"].append((time.monotonic() - t0) * 1000)
    t0 = time.monotonic()
    kids = box.fork(1)
    times["fork(1)"].append((time.monotonic() - t0) * 1000)
    t0 = time.monotonic()
    for s in (*kids, box):
        s.kill()
    times["kill"].append((time.monotonic() - t0) * 1000 / (len(kids) + 1))


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=1, help="consoles connected on that side")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="console-cost-"))
    srv = ServerProcess.in_dir(root, f"cc{secrets.token_hex(2)}",
                               key="sl_bench_" + secrets.token_hex(8))
    srv.extra_env["SANDLOT_POOL_SIZE"] = "0"  # every create a restore: no pool to drain
    sides: dict[str, dict[str, list[float]]] = {
        "without console": {op: [] for op in OPS}, "with console": {op: [] for op in OPS}}
    events = 0
    try:
        srv.start()
        kw = srv.client_kwargs()
        one_round(kw, {op: [] for op in OPS})  # warm-up: caches, the first restore
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                listeners = ([Listener(srv.url, srv.key, root / f"events-{r}-{i}")
                              for i in range(args.streams)]
                             if side == "with console" else [])
                try:
                    time.sleep(0.5)  # the streams are open before the round
                    one_round(kw, sides[side])
                finally:
                    time.sleep(0.5)
                    events += sum(x.close() for x in listeners)
    finally:
        srv.close()
        shutil.rmtree(root, ignore_errors=True)
    report = {side: {op: {"p50_ms": round(statistics.median(v), 1),
                          "p90_ms": round(p(v, 0.9), 1), "n": len(v)}
                     for op, v in ops.items()} for side, ops in sides.items()}
    report["events_read"] = events
    report["streams"] = args.streams
    print(f"sandlot console cost: {args.rounds} rounds, {args.streams} stream(s), "
          f"{events} events read")
    print(f"{'call':10} {'without p50':>12} {'with p50':>10} {'without p90':>12} {'with p90':>10}")
    for op in OPS:
        a, b = report["without console"][op], report["with console"][op]
        print(f"{op:10} {a['p50_ms']:12.1f} {b['p50_ms']:10.1f} {a['p90_ms']:12.1f} "
              f"{b['p90_ms']:10.1f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
