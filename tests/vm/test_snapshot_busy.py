"""Snapshots and forks of a guest that is busy writing memory are consistent.

A precopy migration under QEMU 7.2's TCG lost pages the guest wrote while it ran (the same
kernel pages every time), and every restore of such a snapshot panicked. A process here
rewrites one byte of every page of a 64 MiB buffer with a round number, over and over; asked
(SIGUSR1) it records the values it finds. A consistent memory image has at most two adjacent
values, the round in progress and the one before: a lost page shows an older round.
"""

from __future__ import annotations

import os
import shutil

import pytest
from snapkit import STIR, consistent, start_hammer

from harness import qemu_pids
from sandlot import Sandbox
from sandlot.vmm import write_tracking


@pytest.fixture
def busy(sandbox_factory) -> Sandbox:
    sbx = sandbox_factory()
    start_hammer(sbx)
    assert consistent(sbx)
    return sbx


def test_snapshot_of_a_busy_guest_restores_consistent(busy, sandbox_factory):
    busy.commands.run(STIR)
    snap = busy.create_snapshot()
    snap.wait(timeout=120)
    assert snap.info.pause_ms is not None  # how long: bench/
    for _ in range(2):
        restored = sandbox_factory(snapshot_id=snap.snapshot_id)
        assert restored.commands.run("echo up").stdout == "up\n"
        assert consistent(restored)
    assert consistent(busy)
    snap.remove()


def test_fork_of_a_busy_guest_gives_consistent_children(busy):
    busy.commands.run(STIR)
    kids = busy.fork(count=2)
    try:
        for kid in kids:
            assert kid.commands.run("echo up").stdout == "up\n"
            assert consistent(kid)
    finally:
        for kid in kids:
            kid.kill()
    assert consistent(busy)


def test_every_qemu_tracks_what_its_guest_writes(busy, server):
    """Where the kernel has asynchronous write-protection (Linux 6.7+) and a C compiler is
    there, every sandbox's QEMU runs with the userfaultfd through which a capture copies while
    the guest runs and, in the pause, only what it wrote meanwhile: so the tests above take
    their snapshots and forks that way (vmm/write_tracking.py)."""
    if not write_tracking.kernel_supports() or shutil.which("cc") is None:
        pytest.skip("no write tracking on this host: captures copy in the pause")
    busy.create_snapshot().wait(timeout=120)
    pids = qemu_pids(server.run_root)
    assert pids
    for pid in pids:
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert "anon_inode:[userfaultfd]" in links, f"QEMU {pid} tracks no writes"
