"""What an open console costs the API's hot paths: create, exec and fork(1) with the console's
event stream (GET /v1/events, read as the console reads it) connected and without, on one
server, interleaved round by round so both sides see the same machine load (issue 26).

    python bench/console_cost.py [--rounds 6] [--streams 1] [--json out.json]

Without a subscriber core publishes nothing (core/events.py); with one, each saved record is
validated once and queued per subscriber. The table prints the median (p50) and p90 of each
call in ms per side, and how many events the streams read.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from sandlot import Sandbox
from sandlot.testing import ServerProcess

OPS = ("create", "exec", "fork(1)", "kill")


class Listener:
    """A console's event stream, read on a thread until stopped."""

    def __init__(self, url: str, key: str) -> None:
        self.events = 0
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=url, timeout=httpx.Timeout(5, read=None))
        self._thread = threading.Thread(target=self._read, args=(key,), daemon=True)
        self._thread.start()

    def _read(self, key: str) -> None:
        with self._client.stream("GET", "/v1/events",
                                 headers={"authorization": f"Bearer {key}"}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("event: "):
                    self.events += 1
                if self._stop.is_set():
                    break

    def close(self) -> None:
        self._stop.set()
        self._client.close()


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
                listeners = ([Listener(srv.url, srv.key) for _ in range(args.streams)]
                             if side == "with console" else [])
                try:
                    time.sleep(0.2)  # the streams are open before the round
                    one_round(kw, sides[side])
                finally:
                    time.sleep(0.2)
                    events += sum(x.events for x in listeners)
                    for x in listeners:
                        x.close()
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
