"""Two template builds side by side, interleaved so that both see the same machine load: one
sandlot server per images dir (same host code, no warm pool), used in turn each round. Made to
compare guest agents (docs/benchmarks.md, "The Python and the Go guest agent").

    python bench/images_ab.py python=/var/lib/sandlot-py/images go=/var/lib/sandlot/images \\
        [--rounds 7] [--forks 16]

Per round and side: a create without the pool (a restore), its first command, 5 commands,
fork(1) and fork(4) to their children's first commands; then `--forks` rounds of fork(1) on
one parent per side; the memory of the agent process in the guest (smaps_rollup), and the
guest's memory in use (MemTotal - MemAvailable) after the round's commands.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandlot import Sandbox
from sandlot.testing import ServerProcess

AGENT_MEMORY = r"""
for pid in $(awk '$2 ~ /^\((sandlot-agent|python3)\)$/ {print $1}' /proc/[0-9]*/stat); do
  awk '/^(Rss|Pss):/ {printf "%s %s kB  ", $1, $2}' /proc/$pid/smaps_rollup; echo; done
"""


GUEST_USED = "awk '/^MemTotal:/ {t=$2} /^MemAvailable:/ {a=$2} END {print t-a}' /proc/meminfo"


def ms_since(t0: float) -> float:
    return (time.monotonic() - t0) * 1000


def one_round(box_kw: dict, add) -> Sandbox:
    t0 = time.monotonic()
    box = Sandbox.create(timeout=600, **box_kw)
    add("create without the pool", ms_since(t0))
    t0 = time.monotonic()
    box.commands.run("true")
    add("its first command", ms_since(t0))
    for _ in range(5):
        t0 = time.monotonic()
        box.commands.run("true")
        add("exec true", ms_since(t0))
    for count in (1, 4):
        t0 = time.monotonic()
        kids = box.fork(count)
        add(f"fork({count}) call", ms_since(t0))
        with ThreadPoolExecutor(count) as ex:
            list(ex.map(lambda c: c.commands.run("true"), kids))
        add(f"fork({count}) -> first commands", ms_since(t0))
        for kid in kids:
            kid.kill()
    return box


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sides", nargs=2, metavar="NAME=IMAGES_DIR")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--forks", type=int, default=16)
    args = p.parse_args()
    sides = dict(s.split("=", 1) for s in args.sides)
    root = Path(tempfile.mkdtemp(prefix="sandlot-ab-", dir="/var/tmp"))
    servers: dict[str, ServerProcess] = {}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    memory: dict[str, str] = {}
    try:
        for name, images in sides.items():
            srv = ServerProcess.in_dir(root / name, f"ab{secrets.token_hex(3)}", extra_env={
                "SANDLOT_IMAGES_DIR": images, "SANDLOT_POOL_SIZE": "0",
                "SANDLOT_STORE": str(root / name / "store")})
            srv.start(timeout=120)
            servers[name] = srv
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                box = one_round(servers[name].client_kwargs(),
                                lambda k, v, n=name: results[n].setdefault(k, []).append(v))
                memory[name] = box.commands.run(AGENT_MEMORY).stdout.strip()
                used_kb = int(box.commands.run(GUEST_USED).stdout)
                results[name].setdefault("guest memory in use (MiB)", []).append(used_kb / 1024)
                box.kill()
        parents = {name: Sandbox.create(timeout=600, **srv.client_kwargs())
                   for name, srv in servers.items()}
        for r in range(args.forks):
            for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
                t0 = time.monotonic()
                kids = parents[name].fork(1)
                results[name].setdefault("fork(1) call, one parent", []).append(ms_since(t0))
                t0 = time.monotonic()
                kids[0].commands.run("true")
                results[name].setdefault("fork child's first command", []).append(ms_since(t0))
                kids[0].kill()
    finally:
        for srv in servers.values():
            srv.close()
    names = list(sides)
    print(f"{'figure (p50, ms unless named)':34}" + "".join(f"{n:>12}" for n in names))
    for key in results[names[0]]:
        print(f"{key:34}" + "".join(f"{statistics.median(results[n][key]):12.1f}"
                                    for n in names))
    for name in names:
        print(f"agent memory in the guest, {name}: {memory.get(name)}")


if __name__ == "__main__":
    main()
