"""A VM's use of the host, read from /proc and its disk files: no guest call, no QEMU call."""

from __future__ import annotations

import os
from pathlib import Path

from sandlot.runtime.base import Usage

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def own_memory_bytes(pid: int) -> int:
    """Anonymous resident memory: guest pages changed since the restore, and QEMU's heap (the
    image pages it maps from the shared cache are not its own)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    return 0


def allocated_bytes(directory: Path) -> int:
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    except FileNotFoundError:
        pass
    return total


def vm_usage(pid: int | None, cpus: int, memory_mb: int, disk_dir: Path,
             disk_size: int, disk_errors: int = 0) -> Usage | None:
    if pid is None:
        return None
    try:
        return Usage(cpu_seconds=cpu_seconds(pid), memory_bytes=own_memory_bytes(pid),
                     memory_total_bytes=memory_mb << 20, disk_bytes=allocated_bytes(disk_dir),
                     disk_total_bytes=disk_size, cpus=cpus, disk_errors=disk_errors)
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
