"""Filesystem-only pauses and snapshots of real VMs (issue #14): the disk is kept, memory is
not, and the sandbox comes back by booting from that disk: its files (as synced at the pause),
its env and its network, but none of its processes or tmpfs. A booted sandbox is a sandbox like
any other: it snapshots with memory, forks and restores."""

from __future__ import annotations

import pytest

from sandlot import Snapshot

pytestmark = pytest.mark.vm


def _uptime(sbx) -> float:
    return float(sbx.commands.run("cut -d' ' -f1 /proc/uptime").stdout)


def test_a_filesystem_only_pause_boots_on_resume_with_its_files(sandbox_factory):
    sbx = sandbox_factory(env={"MODE": "kept"})
    sbx.commands.run("echo on-disk > /root/disk.txt; echo in-memory > /tmp/mem.txt", check=True)
    sleeper = sbx.commands.run("sleep 1000", background=True)
    up_before = _uptime(sbx)
    sbx.pause(memory=False)
    assert sbx.get_info().state == "paused"

    sbx.resume()
    info = sbx.get_info()
    assert info.state == "running"
    assert sbx.commands.run("cat /root/disk.txt").stdout == "on-disk\n"  # synced at the pause
    assert sbx.commands.run("test -e /tmp/mem.txt").exit_code == 1  # tmpfs went with memory
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}  # processes too
    assert sbx.commands.run("echo $MODE").stdout == "kept\n"
    assert _uptime(sbx) < up_before + 120  # a fresh boot (its clock started again)
    # Its network came up with the boot, at the address every sandbox has.
    assert "10.0.2.15" in sbx.commands.run("cat /proc/net/fib_trie").stdout

    # A booted sandbox snapshots with memory, and that snapshot restores with its processes.
    sbx.commands.run("echo second > /root/disk.txt", check=True)
    bg = sbx.commands.run("sleep 900", background=True)
    snap = sbx.create_snapshot().wait()
    assert snap.info.memory is True and snap.info.state == "ready"
    restored = snap.restore()
    try:
        assert restored.commands.run("cat /root/disk.txt").stdout == "second\n"
        assert bg.pid in {p.pid for p in restored.commands.list()}
    finally:
        restored.kill()
    # ... and forks.
    [child] = sbx.fork()
    try:
        assert child.commands.run("cat /root/disk.txt").stdout == "second\n"
    finally:
        child.kill()


def test_a_filesystem_only_snapshot_restores_by_booting_any_size(sandbox_factory):
    sbx = sandbox_factory()
    sbx.commands.run("mkdir -p /root/app && echo v1 > /root/app/state", check=True)
    bg = sbx.commands.run("sleep 1000", background=True)
    snap = sbx.create_snapshot(memory=False).wait()
    info = snap.info
    assert info.state == "ready" and info.memory is False and info.pause_ms == 0
    # The source ran on untouched: its process lives, its later writes are not in the snapshot.
    assert bg.pid in {p.pid for p in sbx.commands.list()}
    sbx.commands.run("echo v2 > /root/app/state", check=True)

    # Booted, so any memory size and CPU count (a memory snapshot's can only grow).
    child = Snapshot.get(snap.snapshot_id).restore_with(memory_mb=384, cpus=2)
    try:
        assert child.commands.run("cat /root/app/state").stdout == "v1\n"
        assert child.commands.run("nproc").stdout == "2\n"
        total_kb = int(child.commands.run("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout)
        assert 250 * 1024 < total_kb <= 384 * 1024
        assert bg.pid not in {p.pid for p in child.commands.list()}
    finally:
        child.kill()

    # A rollback to it boots the sandbox under its id.
    sbx.rollback(snap)
    assert sbx.commands.run("cat /root/app/state").stdout == "v1\n"


def test_a_reboot_resume_boots_a_memory_pause_from_its_disk(sandbox_factory):
    sbx = sandbox_factory()
    sbx.commands.run("echo synced > /root/f; sync", check=True)
    sleeper = sbx.commands.run("sleep 1000", background=True)
    sbx.pause()
    sbx.resume(reboot=True)
    assert sbx.commands.run("cat /root/f").stdout == "synced\n"
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}
