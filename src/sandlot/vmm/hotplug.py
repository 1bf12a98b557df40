"""Memory and CPU changes on restore.

Memory: one pc-dimm, hotplugged while the restored VM is still paused; the guest onlines it by
itself (``memhp_default_state=online``). CPUs: every VM has MAX_CPUS vCPUs and the guest agent
onlines or offlines them, so CPUs can go up or down and no device changes. Both are checked
before anything starts.
"""

from __future__ import annotations

from sandlot.errors import InvalidArgumentError
from sandlot.vmm.machine import MAX_CPUS, MAX_MEM_MB, Machine

MEMORY_BLOCK_MB = 128  # x86-64 Linux onlines memory in 128 MiB blocks


MIN_BOOT_MB = 256  # a guest booted from its disk (filesystem-only images)


def check_bounds(memory_mb: int, cpus: int) -> None:
    """Validate a boot's memory/CPU request (any size within the bounds: nothing to load)."""
    if cpus > MAX_CPUS:
        raise InvalidArgumentError(f"cpus={cpus} is above the maximum of {MAX_CPUS}")
    if not MIN_BOOT_MB <= memory_mb <= MAX_MEM_MB:
        raise InvalidArgumentError(f"memory_mb={memory_mb} is outside {MIN_BOOT_MB}-"
                                   f"{MAX_MEM_MB} for a sandbox booted from its disk")


def check_overrides(base_mb: int, base_dimm_mb: int, memory_mb: int, cpus: int) -> int:
    """Validate a restore's memory/CPU request; returns the extra memory (MiB) to hotplug."""
    have = base_mb + base_dimm_mb
    if memory_mb < have:
        raise InvalidArgumentError(
            f"memory_mb={memory_mb} is below the snapshot's {have} MiB; memory can grow on "
            "restore but not shrink")
    if cpus > MAX_CPUS:
        raise InvalidArgumentError(f"cpus={cpus} is above the maximum of {MAX_CPUS}")
    if memory_mb > MAX_MEM_MB:
        raise InvalidArgumentError(f"memory_mb={memory_mb} is above the maximum of {MAX_MEM_MB}")
    extra = memory_mb - have
    if extra and base_dimm_mb:
        raise InvalidArgumentError(
            "this snapshot already has hotplugged memory; restore it with the same memory_mb "
            f"({have})")
    if extra % MEMORY_BLOCK_MB:
        raise InvalidArgumentError(
            f"memory can grow in steps of {MEMORY_BLOCK_MB} MiB: ask for {have} + a multiple "
            f"of {MEMORY_BLOCK_MB}")
    return extra


async def apply(machine: Machine, extra_mb: int) -> None:
    """Hotplug `extra_mb` of memory into a paused, restored machine."""
    if extra_mb:
        await machine.execute("object-add", {"qom-type": "memory-backend-ram", "id": "dimm0",
                                             "size": extra_mb << 20, "merge": False})
        await machine.execute("device_add", {"driver": "pc-dimm", "id": "pcdimm0",
                                             "memdev": "dimm0"})
        machine.spec = machine.spec.with_(dimm_mb=extra_mb, dimm_path=None)
