"""Room on this host for one more VM or capture: refused with a clear error before the host
runs out, never found out by the kernel's OOM killer or an ENOSPC halfway through.

A VM's guest RAM is mostly pages of its image shared with every other VM restored from it,
and its cgroup (vmm/jail.py) caps what it can make its own, so admission does not reserve a
whole guest's RAM per VM (that would forbid the dense forks sandlot is for); it keeps a reserve
of memory and disk the host never hands out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import CapacityError
from sandlot.vmm.jail import QEMU_OVERHEAD_MB


def mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def free_mb(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize >> 20


@dataclass(frozen=True)
class HostReserve:
    """What this host keeps for itself (SANDLOT_RESERVE_MEM_MB, SANDLOT_RESERVE_DISK_MB)."""

    memory_mb: int
    disk_mb: int
    disks_dir: Path
    hot_dir: Path

    def check_vm(self, memory_mb: int) -> None:
        """Room to start a VM: memory for its QEMU beyond the reserve, disk for its overlay."""
        available = mem_available_mb()
        need = self.memory_mb + QEMU_OVERHEAD_MB
        if available < need:
            raise CapacityError(
                f"this host has {available} MiB of memory available; a new sandbox needs "
                f"{QEMU_OVERHEAD_MB} MiB beyond the host's reserve of {self.memory_mb} MiB "
                f"(SANDLOT_RESERVE_MEM_MB); kill or pause sandboxes, or use another host")
        self._check_disk(self.disks_dir, self.disk_mb, "a new sandbox's disk")

    def check_capture(self, memory_mb: int) -> None:
        """Room for a capture's image in the hot cache (at most the VM's RAM) and its disk."""
        free = free_mb(self.hot_dir)
        if free < memory_mb + self.memory_mb // 4:
            raise CapacityError(
                f"the image cache has {free} MiB free; a capture of a "
                f"{memory_mb} MiB sandbox may need {memory_mb} MiB beyond a reserve of "
                f"{self.memory_mb // 4} MiB; free space with `sandlot template gc` or delete "
                "snapshots")
        self._check_disk(self.disks_dir, self.disk_mb, "a snapshot's disk layer")

    @staticmethod
    def _check_disk(path: Path, reserve_mb: int, what: str) -> None:
        free = free_mb(path)
        if free < reserve_mb:
            raise CapacityError(
                f"the data directory's disk has {free} MiB free, under the host's reserve of "
                f"{reserve_mb} MiB (SANDLOT_RESERVE_DISK_MB): no room for {what}")
