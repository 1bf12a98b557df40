"""Disk is promised, not raced for (runtime/capacity.DiskBudget): a VM is admitted only if what
every VM here may still write (its disk's worst case less what its layer holds) fits in the
free space beyond the reserve; a grown disk promises the difference; a killed VM's promise
goes. And the disk a guest sees grows (DiskChain.grow), its snapshots keep the grown size."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandlot.errors import CapacityError
from sandlot.runtime.capacity import DiskBudget, HostReserve, worst_case
from sandlot.vmm import disk
from sandlot.vmm.disk import DiskChain, virtual_size

MiB = 1 << 20
GiB = 1 << 30


def budget(free: int, reserve_mb: int = 100) -> DiskBudget:
    return DiskBudget(Path("/nowhere"), reserve_mb, free=lambda _: free)


def test_worst_case_is_the_disk_and_its_tables() -> None:
    assert GiB < worst_case(GiB) < GiB + 4 * MiB


def test_admits_while_the_disks_fit_and_refuses_beyond() -> None:
    b = budget(free=3 * GiB, reserve_mb=512)  # 2.5 GiB to promise
    b.admit("a", GiB)
    assert b.outstanding() == worst_case(GiB)
    with pytest.raises(CapacityError) as refused:
        b.admit("b", 2 * GiB)
    assert "SANDLOT_RESERVE_DISK_MB" in refused.value.message and "disk_mb" in refused.value.message
    assert "b" not in b._promises  # a refusal promises nothing
    b.admit("b", GiB)
    with pytest.raises(CapacityError):
        b.admit("c", 768 * MiB)
    b.release("a")
    b.admit("c", 768 * MiB)
    assert b.promised() == GiB + 768 * MiB


def test_what_a_layer_holds_is_no_longer_owed() -> None:
    """The free space already lacks what a VM wrote: only the rest of its disk is owed."""
    held = {"a": 0}
    free = {"bytes": 3 * GiB}
    b = DiskBudget(Path("/nowhere"), 0, free=lambda _: free["bytes"])
    b.admit("a", 2 * GiB, lambda: held["a"])
    with pytest.raises(CapacityError):
        b.admit("b", GiB)
    held["a"] = 1536 * MiB  # the guest wrote 1.5 GiB: the host has that much less free
    free["bytes"] -= 1536 * MiB
    assert b.outstanding() == worst_case(2 * GiB) - 1536 * MiB
    with pytest.raises(CapacityError):
        b.admit("b", GiB)  # still: what "a" may write and "b" don't fit
    b.admit("b", 512 * MiB)
    assert b.available() >= 0


def test_a_grown_disk_promises_the_difference() -> None:
    b = budget(free=3 * GiB, reserve_mb=0)
    b.admit("a", GiB)
    b.admit("a", 2 * GiB)  # its own promise does not count against its growth
    assert b.outstanding() == worst_case(2 * GiB)
    with pytest.raises(CapacityError):
        b.admit("a", 3 * GiB)
    assert b._promises["a"].size == 2 * GiB  # refused: the earlier promise stands


def test_captures_need_room_beyond_the_promises() -> None:
    """A capture freezes the VM's layer: its bytes stop counting for the VM's promise until
    merged, so a capture needs that much room beyond the promises."""
    free = {"bytes": 2 * GiB}
    reserve = HostReserve(memory_mb=0, disk_mb=100, disks_dir=Path("/nowhere"),
                          hot_dir=Path("/dev/shm"))
    reserve.disks.free = lambda _: free["bytes"]
    reserve.disks.admit("a", GiB)
    reserve.disks.check("a snapshot's disk layer", 512 * MiB)
    free["bytes"] = GiB + 200 * MiB
    with pytest.raises(CapacityError) as refused:
        reserve.check_capture(0, frozen=512 * MiB)
    assert "snapshot" in refused.value.message


def test_a_layer_that_cannot_be_read_holds_nothing() -> None:
    def gone() -> int:
        raise FileNotFoundError

    b = budget(free=2 * GiB, reserve_mb=0)
    b.admit("a", GiB, gone)
    assert b.outstanding() == worst_case(GiB)


# ---- the disk a guest sees ----------------------------------------------------------------

needs_qemu_img = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")


class FakeMachine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def execute(self, command: str, args: dict | None = None):
        self.calls.append((command, args or {}))
        return {}


def qemu_img(*args: str, tool: str = "qemu-img") -> None:
    subprocess.run([tool, *args], check=True, capture_output=True)


@needs_qemu_img
async def test_grow_resizes_the_top_layer_and_never_shrinks(tmp_path) -> None:
    source = tmp_path / "root.raw"
    source.write_bytes(bytes(MiB))
    chain = DiskChain(dir=tmp_path / "disks", source=source, size=64 * MiB, source_fmt="raw")
    await chain.create()
    assert virtual_size(chain.top) == 64 * MiB and virtual_size(source) == MiB
    machine = FakeMachine()
    await chain.grow(machine, 256 * MiB)
    await chain.grow(machine, 128 * MiB)
    assert machine.calls == [("block_resize", {"node-name": "disk0", "size": 256 * MiB})]
    assert chain.size == 256 * MiB
    assert 0 < chain.held() < MiB


@needs_qemu_img
async def test_a_snapshot_of_a_grown_disk_keeps_its_size(tmp_path) -> None:
    """flatten_pair commits a grown frozen layer into a copy of its smaller source: the
    snapshot's disk is the grown size, so its restores never see a smaller disk."""
    root = tmp_path / "root.raw"
    root.write_bytes(bytes(4 * MiB))
    source = tmp_path / "source.qcow2"
    await disk.create_overlay(source, root, "raw", 4 * MiB)
    frozen = tmp_path / "frozen.qcow2"
    await disk.create_overlay(frozen, source, "qcow2", 4 * MiB)
    qemu_img("resize", "-q", str(frozen), str(64 * MiB))  # as block_resize grows the top
    qemu_img("-c", f"write -P 0xab {48 * MiB} {MiB}", str(frozen), tool="qemu-io")
    out = tmp_path / "snapshot.qcow2"
    await disk.flatten_pair(frozen, source, out)
    assert virtual_size(out) == 64 * MiB
    assert disk.backing_file(out) == root
    dump = tmp_path / "dump.raw"
    qemu_img("convert", "-O", "raw", str(out), str(dump))
    with open(dump, "rb") as f:
        f.seek(48 * MiB)
        assert f.read(MiB) == b"\xab" * MiB


def test_the_host_failing_a_disk_write_is_counted_not_queued() -> None:
    """werror=report: a write the host cannot do is an I/O error in the guest (the VM runs
    on), counted for the sandbox's metrics (`disk_errors`) and logged."""
    from qemu.qmp.message import Message

    from sandlot.vmm.machine import DiskErrors

    errors = DiskErrors("sb-test")
    event = Message({"event": "BLOCK_IO_ERROR", "data": {"device": "", "node-name": "disk0",
                                                         "operation": "write",
                                                         "action": "report", "nospace": True,
                                                         "reason": "No space left on device"},
                     "timestamp": {"seconds": 0, "microseconds": 0}})
    other = Message({"event": "STOP", "timestamp": {"seconds": 0, "microseconds": 0}})
    assert not errors.accept(event) and not errors.accept(other) and not errors.accept(event)
    assert errors.count == 2
