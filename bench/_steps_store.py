"""What snapshots cost in the store: the next snapshot after a small change (stored bytes,
ready time), ten of them, and a restore on a server whose cache is empty, from S3 on loopback
(SeaweedFS)."""

from __future__ import annotations

import time

from _pause import start_holder
from _server import BenchServer
from _stats import ms_since
from _steps import SANDBOX_TIMEOUT, Ctx, kill_all
from sandlot import Sandbox, Snapshot
from sandlot.testing import S3Server

CHANGE_MIB = 10


def _change(sbx: Sandbox, i: int, mib: int = CHANGE_MIB) -> None:
    """`mib` MiB of fresh random data in guest memory (a file on the guest's tmpfs)."""
    sbx.commands.run(f"head -c {mib << 20} /dev/urandom > /run/bench-change-{i}", check=True,
                     timeout=120)


def _ready(sbx: Sandbox, name: str) -> tuple[Snapshot, float]:
    t0 = time.monotonic()
    snap = sbx.create_snapshot(name)
    snap.wait(timeout=600)
    if snap.state != "ready":
        raise RuntimeError(f"snapshot {name} {snap.state}: {snap.error}")
    return snap, ms_since(t0)


def step_incremental(ctx: Ctx) -> None:
    """A sandbox holding `touched_mib` of random data; a first snapshot, then ten more, each
    after CHANGE_MIB MiB of new data."""
    plan, r = ctx.plan, ctx.results
    sbx = ctx.create(template="base")
    snaps: list[Snapshot] = []
    try:
        start_holder(sbx, plan.touched_mib)
        first, ms = _ready(sbx, "bench-incr-0")
        snaps.append(first)
        r.values["incremental_first_stored_mib"] = first.info.stored_bytes / 2**20
        r.values["incremental_first_ready_ms"] = ms
        for i in range(1, plan.incremental_snapshots):
            _change(sbx, i)
            snap, ms = _ready(sbx, f"bench-incr-{i}")
            snaps.append(snap)
            r.s("incremental_stored_mib").add(snap.info.stored_bytes / 2**20)
            r.s("incremental_ready_ms").add(ms)
            if snap.info.pause_ms is not None:
                r.s("incremental_pause_ms").add(snap.info.pause_ms)
        total = sum(s.info.stored_bytes for s in snaps) / 2**20
        r.values["incremental_total_stored_mib"] = total
        r.values["incremental_count"] = len(snaps)
        r.values["incremental_size_mib"] = first.info.size_bytes / 2**20
        ctx.log(f"incremental: first {r.values['incremental_first_stored_mib']:.1f} MiB, next "
                f"p50 {r.s('incremental_stored_mib').p50:.1f} MiB ready p50 "
                f"{r.s('incremental_ready_ms').p50:.0f} ms; {len(snaps)} snapshots "
                f"{total:.1f} MiB")
    finally:
        kill_all([sbx])
        for snap in snaps:
            snap.remove()


def step_store_restore(ctx: Ctx) -> None:
    """Server A (store in S3) snapshots a sandbox; for each run, a new server B with an empty
    data dir and cache restores it: the restore to first command fetches every chunk from S3.
    Then B restores it again (its cache now warm)."""
    plan, r = ctx.plan, ctx.results
    root = ctx.server.root / "s3bench"
    s3 = S3Server(root / "s3")
    s3.start()
    servers: list[BenchServer] = []
    try:
        a = BenchServer.on_store(root, "a", s3)
        servers.append(a)
        sbx = Sandbox.create(template="base", timeout=SANDBOX_TIMEOUT, **a.client_kwargs())
        try:
            start_holder(sbx, plan.touched_mib)
            snap, ms = _ready(sbx, "bench-s3")
            r.values["s3_snapshot_ready_ms"] = ms
            r.values["s3_snapshot_stored_mib"] = snap.info.stored_bytes / 2**20
        finally:
            kill_all([sbx])
        for i in range(plan.runs):
            b = BenchServer.on_store(root, f"b{i}", s3)
            servers.append(b)
            for series in ("restore_empty_cache_ms", "restore_warm_cache_ms"):
                t0 = time.monotonic()
                child = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=SANDBOX_TIMEOUT,
                                       **b.client_kwargs())
                try:
                    child.commands.run("true", check=True)
                    r.s(series).add(ms_since(t0))
                finally:
                    kill_all([child])
            b.close()
        ctx.log(f"restore from S3 with an empty cache: p50 "
                f"{r.s('restore_empty_cache_ms').p50:.0f} ms, warm "
                f"{r.s('restore_warm_cache_ms').p50:.0f} ms")
    finally:
        for server in servers:
            server.close()
        s3.stop()
