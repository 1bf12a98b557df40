"""Discard passthrough (issue #16): blocks the guest frees and trims go back to the host, so a
sandbox's disk overlay shrinks after `rm` + `fstrim`, before and after a snapshot (whose
capture stacks a new overlay on the VM's disk); zeros it writes take no host disk."""

from __future__ import annotations

from pathlib import Path

MiB = 1 << 20
WRITE_MB = 200


def allocated(disk_dir: Path) -> int:
    """Bytes the host has allocated for a sandbox's own disk layers."""
    return sum(p.stat().st_blocks * 512 for p in disk_dir.glob("disk-*.qcow2"))


def fill_and_trim(sbx, disk_dir: Path) -> tuple[int, int, int]:
    before = allocated(disk_dir)
    sbx.commands.run(f"head -c {WRITE_MB}M /dev/urandom > /root/fill.bin && sync",
                     check=True, timeout=300)
    full = allocated(disk_dir)
    sbx.commands.run("rm /root/fill.bin && sync && fstrim /", check=True, timeout=300)
    return before, full, allocated(disk_dir)


def test_freed_guest_blocks_shrink_the_host_overlay(server, sandbox_factory):
    sbx = sandbox_factory()
    disk_dir = server.data_dir / "disks" / sbx.sandbox_id
    before, full, trimmed = fill_and_trim(sbx, disk_dir)
    assert full - before >= WRITE_MB * MiB * 0.9, (before, full)
    # Most of what the file took is given back (ext4 metadata and the journal stay).
    assert full - trimmed >= WRITE_MB * MiB * 0.8, (before, full, trimmed)

    # A capture puts a new overlay on top (opened over QMP, not from the command line):
    # it passes discards on as well, and the snapshot still restores.
    snap = sbx.create_snapshot()
    snap.wait()
    before, full, trimmed = fill_and_trim(sbx, disk_dir)
    assert full - before >= WRITE_MB * MiB * 0.9, (before, full)
    assert full - trimmed >= WRITE_MB * MiB * 0.8, (before, full, trimmed)
    child = sandbox_factory(snapshot_id=snap.snapshot_id)
    assert child.commands.run("echo ok").stdout == "ok\n"


def test_zeros_a_guest_writes_take_no_host_disk(server, sandbox_factory):
    sbx = sandbox_factory()
    disk_dir = server.data_dir / "disks" / sbx.sandbox_id
    before = allocated(disk_dir)
    sbx.commands.run(f"dd if=/dev/zero of=/root/zeros bs=1M count={WRITE_MB} conv=fsync "
                     "status=none", check=True, timeout=300)
    assert sbx.commands.run("du -m /root/zeros").stdout.split()[0] == str(WRITE_MB)
    grown = allocated(disk_dir) - before
    assert grown < WRITE_MB * MiB * 0.1, grown
