"""Filesystem-only snapshots (`memory=False`): what one costs to take and to store, and what a
sandbox booted from one costs to its first command, beside the cold boot."""

from __future__ import annotations

import time

from _stats import ms_since
from _steps import SANDBOX_TIMEOUT, Ctx, kill_all
from sandlot import Sandbox, Snapshot

FILE_MIB = 10  # written to the guest's disk before each snapshot


def step_filesystem(ctx: Ctx) -> None:
    """A sandbox that wrote FILE_MIB MiB to its disk; filesystem-only snapshots of it (call
    -> ready, stored bytes) and a sandbox booted from each (create -> first command done)."""
    r = ctx.results
    runs = max(1, min(3, ctx.plan.runs))  # each restore is a boot: seconds under TCG
    sbx = ctx.create(template="base")
    made: list[Sandbox] = []
    try:
        for i in range(runs):
            sbx.commands.run(f"head -c {FILE_MIB << 20} /dev/urandom > /root/bench-fs-{i}",
                             check=True, timeout=120)
            t0 = time.monotonic()
            snap = sbx.create_snapshot(memory=False)
            snap.wait(timeout=600)
            if snap.state != "ready":
                raise RuntimeError(f"filesystem snapshot {snap.snapshot_id} {snap.state}: "
                                   f"{snap.error}")
            r.s("fs_snapshot_ready_ms").add(ms_since(t0))
            r.s("fs_snapshot_stored_mib").add(snap.info.stored_bytes / 2**20)
            t0 = time.monotonic()
            booted = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=SANDBOX_TIMEOUT,
                                    **ctx.kw)
            made.append(booted)
            booted.commands.run("true", check=True)
            r.s("fs_boot_ms").add(ms_since(t0))
            kill_all([booted])
            made.clear()
            Snapshot.delete(snap.snapshot_id, **ctx.kw)
        ctx.log(f"filesystem-only: ready {r.s('fs_snapshot_ready_ms').p50:.0f} ms, stored "
                f"{r.s('fs_snapshot_stored_mib').p50:.1f} MiB, boot to first command "
                f"{r.s('fs_boot_ms').p50:.0f} ms")
    finally:
        kill_all([*made, sbx])
