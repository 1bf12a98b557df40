"""Lazy restore (issue 25), side by side in one run, S3 on loopback (SeaweedFS):

- restore -> first command on a server whose cache is empty: lazily (the default: the image
  served from the store as it is read, its recorded order prefetched first), and fetched
  whole first (`SANDLOT_LAZY_RESTORE=off`, the old way), against the same restore once the
  server's cache is warm;
- N children from a stored snapshot (`--children`, a fork of the snapshot when the server has
  that route, else N restores at once) on a cold server, against fork(N) of a running sandbox;
- the chunks a restore fetched by the time its first command, which reads a tenth of RAM, is
  done, against the image's.

    python bench/lazy.py [--runs 5] [--ballast-mib 256] [--children 8] [--json FILE]

The snapshot is of a 512 MiB sandbox holding `--ballast-mib` MiB of random data in a guest
process (incompressible memory the image carries).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pause import start_holder  # noqa: E402
from _server import BenchServer  # noqa: E402
from _stats import ms_since  # noqa: E402
from sandlot import Sandbox  # noqa: E402
from sandlot.storage.lazy import order_key  # noqa: E402
from sandlot.storage.objects import open_store  # noqa: E402
from sandlot.storage.store import Store  # noqa: E402
from sandlot.testing import S3Server  # noqa: E402

TIMEOUT = 1800
TENTH = "head -c 51M /dev/shm/tenth > /dev/null"  # a tenth of 512 MiB, read in the guest


def _server(root: Path, name: str, s3: S3Server, **env: str) -> BenchServer:
    return BenchServer.on_store(root, name, s3, f"z{os.getpid() % 10000}{name}",
                                SANDLOT_POOL_SIZE="0", **env)


def _stats(server: BenchServer, key: str) -> dict:
    path = server.shm_root / "hot" / key / "lazy.stats"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _first_command(server: BenchServer, snapshot_id: str, cmd: str = "true"
                   ) -> tuple[float, Sandbox]:
    if os.environ.get("BENCH_VERBOSE"):
        print(f"    restore starts at {time.strftime('%H:%M:%S')}"
              f".{int(time.time() * 1000) % 1000:03d}", flush=True)
    t0 = time.monotonic()
    sbx = Sandbox.create(snapshot_id=snapshot_id, timeout=TIMEOUT, **server.client_kwargs())
    sbx.commands.run(cmd, check=True, timeout=600)
    return ms_since(t0), sbx


def _children(server: BenchServer, snapshot_id: str, n: int) -> float:
    """N children of a stored snapshot to every child's first command done."""
    t0 = time.monotonic()
    client = httpx.Client(base_url=server.url, timeout=900,
                          headers={"Authorization": f"Bearer {server.key}"})
    answer = client.post(f"/v1/snapshots/{snapshot_id}/fork", json={"count": n})
    kids: list[Sandbox] = []
    if not answer.is_success or "sandboxes" not in answer.json():  # no such route here
        print(f"    no snapshot fork ({answer.status_code}): {n} restores at once", flush=True)
        with ThreadPoolExecutor(n) as pool:
            kids = list(pool.map(lambda _: Sandbox.create(
                snapshot_id=snapshot_id, timeout=TIMEOUT, **server.client_kwargs()), range(n)))
    else:
        answer.raise_for_status()
        if answer.json()["errors"]:
            raise RuntimeError(f"children failed: {answer.json()['errors']}")
        ids = [c["sandbox_id"] for c in answer.json()["sandboxes"]]
        kids = [Sandbox.connect(i, **server.client_kwargs()) for i in ids]
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda k: k.commands.run("true", check=True, timeout=600), kids))
    ms = ms_since(t0)
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda k: k.kill(), kids))
    return ms


def _fork_running(server: BenchServer, snapshot_id: str, n: int) -> float:
    parent = Sandbox.create(snapshot_id=snapshot_id, timeout=TIMEOUT, **server.client_kwargs())
    try:
        parent.commands.run("true", check=True)
        t0 = time.monotonic()
        kids = parent.fork(n)
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda k: k.commands.run("true", check=True, timeout=600), kids))
        ms = ms_since(t0)
        for k in kids:
            k.kill()
        return ms
    finally:
        parent.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--ballast-mib", type=int, default=256)
    p.add_argument("--children", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandlot-lazy-bench-"))
    s3 = S3Server(root / "s3")
    s3.start()
    servers: list[BenchServer] = []
    out: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out.setdefault(name, []).append(value)
        print(f"  {name}: {value:.0f}", flush=True)

    try:
        a = _server(root, "a", s3)
        servers.append(a)
        src = Sandbox.create(template="base", timeout=TIMEOUT, memory_mb=512,
                             **a.client_kwargs())
        start_holder(src, args.ballast_mib)
        src.commands.run("head -c 51M /dev/urandom > /dev/shm/tenth", check=True, timeout=300)
        snap = src.create_snapshot("lazy-bench").wait(timeout=900)
        src.kill()
        key = snap.snapshot_id
        print(f"snapshot {key}: {snap.info.size_bytes / 2**20:.0f} MiB, stored "
              f"{snap.info.stored_bytes / 2**20:.0f} MiB", flush=True)
        # The first lazy restore anywhere records the order the next ones prefetch.
        first = _server(root, "first", s3)
        servers.append(first)
        ms, sbx = _first_command(first, key, TENTH)
        add("restore_first_lazy_ms", ms)
        sbx.kill()
        first.close()
        servers.remove(first)
        with s3.environ():
            store = Store(open_store(s3.url("bench")))
        deadline = time.monotonic() + 180
        while not asyncio.run(store.objects.exists(order_key(key))):
            if time.monotonic() > deadline:
                raise RuntimeError("the first lazy restore recorded no order")
            time.sleep(0.5)
        for i in range(args.runs):
            print(f"run {i + 1}/{args.runs}", flush=True)
            lazy = _server(root, f"l{i}", s3)
            servers.append(lazy)
            ms, sbx = _first_command(lazy, key)
            add("restore_empty_cache_lazy_ms", ms)
            stats = _stats(lazy, key)
            print(f"    at its first command: {stats}", flush=True)
            if os.environ.get("BENCH_VERBOSE"):
                log = lazy.shm_root / "hot" / key / "lazy.log"
                print("    " + log.read_text().replace("\n", "\n    "), flush=True)
            for name in ("fetched_chunks", "reads_waited", "waited_ms"):
                if name in stats:
                    add(f"lazy_{name}", stats[name])
            sbx.commands.run(TENTH, check=True, timeout=600)
            sbx.kill()
            deadline = time.monotonic() + 300
            entry = lazy.shm_root / "hot" / key
            while not any((entry / m).exists() for m in (".ok", "lazy.complete")):
                if time.monotonic() > deadline:
                    raise RuntimeError("the image was not complete within 300 s")
                time.sleep(0.2)
            ms, sbx = _first_command(lazy, key)
            add("restore_warm_cache_ms", ms)
            sbx.kill()
            add("fork_running_ms", _fork_running(lazy, key, args.children))
            add("children_stored_warm_ms", _children(lazy, key, args.children))
            lazy.close()
            servers.remove(lazy)

            tenth = _server(root, f"t{i}", s3)
            servers.append(tenth)
            ms, sbx = _first_command(tenth, key, TENTH)
            stats = _stats(tenth, key)
            add("tenth_first_command_ms", ms)
            if stats.get("chunks"):
                add("tenth_fetched_pct", 100 * stats["fetched_chunks"] / stats["chunks"])
            sbx.kill()
            tenth.close()
            servers.remove(tenth)

            cold = _server(root, f"c{i}", s3)
            servers.append(cold)
            add("children_stored_cold_ms", _children(cold, key, args.children))
            cold.close()
            servers.remove(cold)

            whole = _server(root, f"w{i}", s3, SANDLOT_LAZY_RESTORE="off")
            servers.append(whole)
            ms, sbx = _first_command(whole, key)
            add("restore_empty_cache_whole_ms", ms)
            sbx.kill()
            whole.close()
            servers.remove(whole)
    finally:
        for server in servers:
            server.close()
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary = {name: {"p50": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
               for name, v in out.items()}
    warm = summary["restore_warm_cache_ms"]["p50"]
    print("\nmedians (ms, or % of the image's chunks):")
    for name, s in summary.items():
        ratio = f"  ({s['p50'] / warm:.2f}x warm)" if name.endswith("_ms") else ""
        print(f"  {name:32s} {s['p50']:8.0f}  [{s['min']:.0f}-{s['max']:.0f}]{ratio}")
    if "fork_running_ms" in summary:
        cold = summary["children_stored_cold_ms"]["p50"]
        print(f"  {args.children} children of a stored snapshot on a cold server: "
              f"{cold / summary['fork_running_ms']['p50']:.2f}x a fork of a running one, "
              f"{cold / summary['children_stored_warm_ms']['p50']:.2f}x the same on a warm one")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "raw": out,
                                         "id": secrets.token_hex(4)}, indent=1))


if __name__ == "__main__":
    main()
