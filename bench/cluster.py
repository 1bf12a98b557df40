"""Several hosts: what the deployment layer costs. Starts a real PostgreSQL, a SeaweedFS S3
and three `sandlot serve` hosts on this machine (as tests/vm/test_cluster.py does), then
measures, side by side in one run:

- a command through the host that runs the sandbox vs through another host (forwarding);
- create through the deployment (placement) vs on a single host with SQLite;
- restore on a host whose cache never saw the snapshot (its files come from S3);
- fork(4) of a sandbox on a full host (children placed on the others) vs fork(4) in place.

    .venv/bin/python bench/cluster.py [--runs 20] [--json bench/results/cluster.json]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import BenchServer  # noqa: E402
from sandlot import Sandbox, Sandlot  # noqa: E402
from sandlot.testing import PostgresServer, S3Server  # noqa: E402


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def timed(fn, runs: int) -> dict:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return {"median_ms": ms(statistics.median(samples)),
            "p90_ms": ms(samples[int(0.9 * (len(samples) - 1))]), "runs": runs}


def summary(samples_ms: list[float]) -> dict:
    samples_ms = sorted(samples_ms)
    return {"median_ms": round(statistics.median(samples_ms), 1),
            "p90_ms": samples_ms[int(0.9 * (len(samples_ms) - 1))], "runs": len(samples_ms)}


def host(root: Path, name: str, env: dict) -> BenchServer:
    srv = BenchServer.in_dir(root / name, f"bc{name}{secrets.token_hex(2)}",
                             key="sl_bench_" + secrets.token_hex(8))
    srv.extra_env.update(env)
    return srv


def wait_for_template(s3: S3Server, prefix: str, timeout: float = 600) -> None:
    import asyncio
    import os

    from sandlot.storage.objects import open_store

    os.environ.update(s3.env)
    store = open_store(s3.url(prefix))
    deadline = time.monotonic() + timeout
    while not asyncio.run(store.exists("index/templates/base.json")):
        if time.monotonic() > deadline:
            raise RuntimeError("the base template never reached the store")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="sandlot-bench-cluster-"))
    pg, s3 = PostgresServer(), S3Server(root / "s3")
    pg.start()
    s3.start()
    prefix = "bench-" + secrets.token_hex(3)
    common = {"SANDLOT_STORE": s3.url(prefix), **s3.env, "SANDLOT_POOL_SIZE": "0",
              "SANDLOT_HEARTBEAT": "1"}
    database = pg.new_database("bench" + secrets.token_hex(3))
    hosts = {n: host(root, n, {**common, "SANDLOT_DATABASE_URL": database,
                               "SANDLOT_HOST_ID": f"host-{n}",
                               "SANDLOT_MAX_SANDBOXES": "2" if n == "a" else "16"})
             for n in "abc"}
    single = host(root, "single", dict(common, SANDLOT_STORE=s3.url(prefix + "-single")))
    out: dict = {}
    try:
        hosts["a"].start(timeout=300)  # gives the new store the templates; then the others
        wait_for_template(s3, prefix)
        for srv in (hosts["b"], hosts["c"], single):
            srv.start(timeout=300)
        wait_for_template(s3, prefix + "-single")
        kw = {n: srv.client_kwargs() for n, srv in hosts.items()}
        admin = Sandlot(**kw["a"])

        def only(name: str):
            for n in "abc":
                (admin.hosts.activate if n == name else admin.hosts.drain)(f"host-{n}")

        only("b")
        sbx = Sandbox.create(timeout=3600, **kw["b"])
        sbx.commands.run("true")
        owner = Sandbox.connect(sbx.sandbox_id, **kw["b"])
        other = Sandbox.connect(sbx.sandbox_id, **kw["c"])
        for _ in range(3):
            owner.commands.run("true")
            other.commands.run("true")
        via_owner, via_other = [], []
        for _ in range(args.runs):  # interleaved, so drift hits both alike
            via_owner.append(timed(lambda: owner.commands.run("true"), 1)["median_ms"])
            via_other.append(timed(lambda: other.commands.run("true"), 1)["median_ms"])
        out["command_via_owner"] = summary(via_owner)
        out["command_via_other_host"] = summary(via_other)
        out["forwarding_overhead_ms"] = round(out["command_via_other_host"]["median_ms"]
                                              - out["command_via_owner"]["median_ms"], 1)

        def create_kill(kwargs):
            Sandbox.create(timeout=600, **kwargs).kill()

        for n in "abc":
            admin.hosts.activate(f"host-{n}")
        create_kill(kw["c"])  # every cache warm with the template
        create_kill(single.client_kwargs())
        out["create_single_host"] = timed(lambda: create_kill(single.client_kwargs()),
                                          max(5, args.runs // 2))
        out["create_deployment"] = timed(lambda: create_kill(kw["c"]), max(5, args.runs // 2))

        sbx.commands.run("head -c 64M /dev/urandom > /dev/shm/ballast", timeout=300)
        snap = sbx.create_snapshot().wait(timeout=600)
        only("c")  # c never saw it: its files come from S3
        t = time.perf_counter()
        restored = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=600, **kw["a"])
        restored.commands.run("true")
        out["restore_other_host_empty_cache_ms"] = ms(time.perf_counter() - t)
        t = time.perf_counter()
        again = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=600, **kw["a"])
        again.commands.run("true")
        out["restore_other_host_warm_cache_ms"] = ms(time.perf_counter() - t)
        restored.kill()
        again.kill()

        only("a")  # the parent and its neighbour fill host a (2 slots)
        parent = Sandbox.create(timeout=600, **kw["a"])
        neighbour = Sandbox.create(timeout=600, **kw["a"])
        for n in "bc":
            admin.hosts.activate(f"host-{n}")
        t = time.perf_counter()
        kids = parent.fork(4)
        for k in kids:
            k.commands.run("true")
        out["fork4_spread_ms"] = ms(time.perf_counter() - t)
        out["fork4_spread_hosts"] = sorted({k.info.host for k in kids})
        for k in kids:
            k.kill()
        neighbour.kill()
        only("b")
        t = time.perf_counter()
        kids = sbx.fork(4)
        for k in kids:
            k.commands.run("true")
        out["fork4_in_place_ms"] = ms(time.perf_counter() - t)
        for k in (*kids, parent, sbx):
            k.kill()
        snap.remove()
    finally:
        for srv in (*hosts.values(), single):
            srv.close()
        s3.stop()
        pg.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
