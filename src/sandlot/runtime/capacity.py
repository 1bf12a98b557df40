"""Room on this host for one more VM or capture: refused with a clear error before the host
runs out, never found out by the kernel's OOM killer or an ENOSPC halfway through.

A VM's guest RAM is mostly pages of its image shared with every other VM restored from it,
and its cgroup (vmm/jail.py) caps what it can make its own, so admission does not reserve a
whole guest's RAM per VM (that would forbid the dense forks sandlot is for); it keeps a reserve
of memory and disk the host never hands out.

Disk is promised, not raced for (`DiskBudget`): a VM's writable layer may grow to its disk's
virtual size (the guest sees a disk of its quota and may rewrite every block of it), so each
VM is admitted only if what every VM here may still write, its own included, fits in the disks
directory's free space beyond the reserve. A guest that fills its disk gets ENOSPC from its own
filesystem; the host's never fills from a guest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import CapacityError
from sandlot.vmm.jail import QEMU_OVERHEAD_MB


def mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def free_mb(path: Path) -> int:
    return free_bytes(path) >> 20


def worst_case(size: int) -> int:
    """The most a qcow2 layer of a `size`-byte disk takes on the host: every cluster written,
    and its tables (8-byte L2 entries and 2-byte refcounts per 64 KiB cluster, the header)."""
    return size + size // 8192 + size // 32768 + (2 << 20)


@dataclass
class _Promise:
    size: int  # the disk's virtual size, bytes
    held: Callable[[], int]  # what its writable layer holds now, bytes


@dataclass
class DiskBudget:
    """The disk this host has promised its VMs: each may still write its disk's worst case
    less what its writable layer holds. `admit` refuses a VM (CapacityError) whose promise does
    not fit in the free space of `path` beyond `reserve_mb` and every other promise."""

    path: Path
    reserve_mb: int
    free: Callable[[Path], int] = free_bytes
    _promises: dict[str, _Promise] = field(default_factory=dict)

    def outstanding(self, skip: str | None = None) -> int:
        """What the VMs here may still write (bytes), `skip`'s aside."""
        total = 0
        for vm_id, p in list(self._promises.items()):
            if vm_id != skip:
                total += max(0, worst_case(p.size) - _held(p))
        return total

    def available(self, skip: str | None = None) -> int:
        """Free bytes beyond the reserve and the promises (may be negative)."""
        return self.free(self.path) - (self.reserve_mb << 20) - self.outstanding(skip)

    def admit(self, vm_id: str, size: int, held: Callable[[], int] = lambda: 0,
              what: str = "a new sandbox's disk") -> None:
        """Promise VM `vm_id` a disk of `size` bytes (it replaces the VM's earlier promise:
        a disk grown), or raise CapacityError."""
        promise = _Promise(size, held)
        need = max(0, worst_case(size) - _held(promise))
        available = self.available(skip=vm_id)
        if need > available:
            raise CapacityError(
                f"no room for {what} of {size >> 20} MiB: the data directory's disk has "
                f"{max(0, available) >> 20} MiB free beyond the host's reserve of "
                f"{self.reserve_mb} MiB (SANDLOT_RESERVE_DISK_MB) and the disks of running "
                "sandboxes; kill or pause sandboxes, ask for a smaller disk (disk_mb), or use "
                "another host")
        self._promises[vm_id] = promise

    def hold(self, vm_id: str, size: int, held: Callable[[], int] = lambda: 0) -> None:
        """Record a promise already made (a VM adopted after a restart), unchecked."""
        self._promises[vm_id] = _Promise(size, held)

    def release(self, vm_id: str) -> None:
        self._promises.pop(vm_id, None)

    def promised(self) -> int:
        """The disks promised, bytes (their virtual sizes)."""
        return sum(p.size for p in list(self._promises.values()))

    def check(self, what: str, need: int = 0) -> None:
        """Room for `need` bytes beyond the reserve and the promises (what is not a VM's
        disk)."""
        available = self.available()
        if available < need:
            raise CapacityError(
                f"the data directory's disk has no room for {what}: its free space is under "
                "the host's "
                f"reserve of {self.reserve_mb} MiB (SANDLOT_RESERVE_DISK_MB) plus what the "
                "disks of running sandboxes may still take; kill or pause sandboxes, or "
                "delete snapshots")


def _held(promise: _Promise) -> int:
    try:
        return promise.held()
    except OSError:
        return 0


@dataclass
class HostReserve:
    """What this host keeps for itself (SANDLOT_RESERVE_MEM_MB, SANDLOT_RESERVE_DISK_MB), and
    the disk it promised its VMs (`disks`)."""

    memory_mb: int
    disk_mb: int
    disks_dir: Path
    hot_dir: Path
    disks: DiskBudget = field(init=False)

    def __post_init__(self) -> None:
        self.disks = DiskBudget(self.disks_dir, self.disk_mb)

    def check_vm(self, memory_mb: int) -> None:
        """Room to start a VM: memory for its QEMU beyond the reserve (its disk: `disks`)."""
        available = mem_available_mb()
        need = self.memory_mb + QEMU_OVERHEAD_MB
        if available < need:
            raise CapacityError(
                f"this host has {available} MiB of memory available; a new sandbox needs "
                f"{QEMU_OVERHEAD_MB} MiB beyond the host's reserve of {self.memory_mb} MiB "
                f"(SANDLOT_RESERVE_MEM_MB); kill or pause sandboxes, or use another host")

    def check_capture(self, memory_mb: int, frozen: int = 0) -> None:
        """Room for a capture's image in the hot cache (at most the VM's RAM) and its disk:
        the layer it freezes (`frozen` bytes) stops counting against the VM's promise until
        it is merged into the next one."""
        free = free_mb(self.hot_dir)
        if free < memory_mb + self.memory_mb // 4:
            raise CapacityError(
                f"the image cache has {free} MiB free; a capture of a "
                f"{memory_mb} MiB sandbox may need {memory_mb} MiB beyond a reserve of "
                f"{self.memory_mb // 4} MiB; free space with `sandlot template gc` or delete "
                "snapshots")
        self.disks.check("a snapshot's disk layer", frozen)
