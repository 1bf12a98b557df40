"""Two (or more) builds of sandlot (host code and template) side by side, interleaved so that
all see the same machine load: one server per side (its own source tree on PYTHONPATH, its own
images dir whose `base` template is that side's build, no warm pool), used in turn each round.
Made for issue #11 ("cheaper children", docs/benchmarks.md).

    python bench/restore_ab.py before=SRC_DIR:TEMPLATE_HASH after=SRC_DIR:TEMPLATE_HASH \\
        [--rounds 8] [--fork8 4]

SRC_DIR is a directory holding `src/sandlot` (a checkout or `git archive` of a commit);
TEMPLATE_HASH a build of `base` in /var/lib/sandlot/images/builds (or --images). Per round and
side: a create without the pool (a restore) and its first command; fork(1) to its child's
first command; then `--fork8` rounds of fork(8) to all children's first commands. CPU per
child: utime + stime of its QEMU process (/proc/<pid>/stat) right after its first command.
With `--idle N`, then N sandboxes per side left idle (20 s to settle), and the host CPU of each
one's QEMU over `--idle-windows` windows of 10 s, all sides at once.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _procmem import process_cpu_ms
from sandlot import Sandbox
from sandlot.testing import ServerProcess


def ms_since(t0: float) -> float:
    return (time.monotonic() - t0) * 1000


def images_view(root: Path, images: Path, build: str) -> Path:
    """An images dir that is `images` but for its `base` template, which names `build`."""
    root.mkdir(parents=True)
    for entry in images.iterdir():
        if entry.name != "templates":
            (root / entry.name).symlink_to(entry)
    (root / "templates").mkdir()
    info = (images / "builds" / build / "template.json")
    text = info.read_text() if info.exists() else (images / "templates/base.json").read_text()
    data = json.loads(text)
    data["hash"] = build
    (root / "templates" / "base.json").write_text(json.dumps(data))
    return root


def first_commands(kids: list[Sandbox], add, label: str) -> None:
    def run(kid: Sandbox) -> None:
        kid.commands.run("true")
        add(f"{label} child CPU after its first command", process_cpu_ms(kid.get_info().pid))

    with ThreadPoolExecutor(len(kids)) as ex:
        list(ex.map(run, kids))


def one_round(kw: dict, add, fork8: bool) -> None:
    t0 = time.monotonic()
    box = Sandbox.create(timeout=600, **kw)
    add("create without the pool (a restore)", ms_since(t0))
    t1 = time.monotonic()
    box.commands.run("true")
    add("  its first command", ms_since(t1))
    add("restore -> first command", ms_since(t0))
    add("restore: CPU of its QEMU after the first command", process_cpu_ms(box.get_info().pid))
    t0 = time.monotonic()
    kids = box.fork(1)
    add("fork(1) call", ms_since(t0))
    first_commands(kids, add, "fork(1)")
    add("fork(1) -> first command", ms_since(t0))
    for kid in kids:
        kid.kill()
    if fork8:
        t0 = time.monotonic()
        kids = box.fork(8)
        first_commands(kids, add, "fork(8)")
        add("fork(8) wall -> all first commands", ms_since(t0))
        for kid in kids:
            kid.kill()
    box.kill()


def idle_cpu(servers: dict, count: int, windows: int, add) -> None:
    """Host CPU (ms per second) of `count` idle sandboxes per side, read over the same windows."""
    boxes = {name: [Sandbox.create(timeout=1800, **srv.client_kwargs()) for _ in range(count)]
             for name, srv in servers.items()}
    pids = {name: [box.get_info().pid for box in made] for name, made in boxes.items()}
    time.sleep(20)
    for _ in range(windows):
        t0 = time.monotonic()
        before = {n: [process_cpu_ms(p) for p in ps] for n, ps in pids.items()}
        time.sleep(10)
        seconds = time.monotonic() - t0
        for name, ps in pids.items():
            for pid, cpu in zip(ps, before[name], strict=True):
                add(name, "idle: host CPU per sandbox (ms/s)",
                    (process_cpu_ms(pid) - cpu) / seconds)
    for made in boxes.values():
        for box in made:
            box.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sides", nargs="+", metavar="NAME=SRC_DIR:TEMPLATE_HASH")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--fork8", type=int, default=4, help="rounds that also fork(8)")
    p.add_argument("--idle", type=int, default=0, help="idle sandboxes per side (0: none)")
    p.add_argument("--idle-windows", type=int, default=6)
    p.add_argument("--images", default="/var/lib/sandlot/images")
    args = p.parse_args()
    sides = {}
    for s in args.sides:
        name, rest = s.split("=", 1)
        src, build = rest.rsplit(":", 1)
        sides[name] = (Path(src).resolve(), build)
    root = Path(tempfile.mkdtemp(prefix="sandlot-rab-", dir="/var/tmp"))
    servers: dict[str, ServerProcess] = {}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    print(f"load average before: {os.getloadavg()}", flush=True)
    try:
        for name, (src, build) in sides.items():
            images = images_view(root / name / "images", Path(args.images), build)
            srv = ServerProcess.in_dir(root / name, f"rab{secrets.token_hex(3)}", extra_env={
                "SANDLOT_IMAGES_DIR": str(images), "SANDLOT_POOL_SIZE": "0",
                "SANDLOT_STORE": str(root / name / "store"),
                "PYTHONPATH": str(src / "src")})
            srv.start(timeout=300)
            servers[name] = srv
        # A first create per side hydrates its hot cache; not counted.
        for srv in servers.values():
            Sandbox.create(timeout=600, **srv.client_kwargs()).kill()
        for r in range(args.rounds):
            order = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
            for name in order if r % 2 == 0 else reversed(order):
                one_round(servers[name].client_kwargs(),
                          lambda k, v, n=name: results[n].setdefault(k, []).append(v),
                          fork8=r < args.fork8)
        if args.idle:
            idle_cpu(servers, args.idle, args.idle_windows,
                     lambda n, k, v: results[n].setdefault(k, []).append(v))
    finally:
        for srv in servers.values():
            srv.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    names = list(sides)
    print(f"{'figure (p50 ms, n)':52}" + "".join(f"{n:>14}" for n in names))
    for key in [k for k in results[names[0]] if all(k in results[n] for n in names)]:
        print(f"{key:52}" + "".join(
            f"{statistics.median(results[n][key]):10.1f} ({len(results[n][key]):2d})"
            for n in names))


if __name__ == "__main__":
    main()
