"""What the parts of the QEMU runtime share: this host's settings, CPU, jails, reserve, hot
cache, image store, network and volume server, and the background tasks they start
(`QemuHost`). Each part (bring-up, capture, store front, recovery) is a `Part` of one host."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from sandlot.config import Settings
from sandlot.errors import BuildError
from sandlot.guest.volserve import VolumeServer, host_key
from sandlot.images.guest import build_jail_helper
from sandlot.runtime.cache import HotCache
from sandlot.runtime.capacity import HostReserve
from sandlot.runtime.images import ImageStore
from sandlot.runtime.lazy import LazyImages
from sandlot.runtime.lazy import available as lazy_available
from sandlot.runtime.network import Networking
from sandlot.vmm.cpu import HostCpu
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.jail import (
    VM_GID,
    Jails,
    ensure_traversable,
    has_tools,
    open_to_vms,
    share_with_vms,
)
from sandlot.vmm.machine import DEVICE_MODEL, MachineSpec
from sandlot.vmm.qemu import qemu_info

log = logging.getLogger(__name__)


def _jail_helper(images: Path) -> Path | None:
    """sandlot-jail, built (or reused) with the guest's programs; None without Go: QEMU then
    starts through the chain of shell tools it replaces (vmm/jail.py)."""
    try:
        return build_jail_helper(images / "guest")
    except (BuildError, OSError) as e:
        log.warning("sandlot-jail not built (%s); confined QEMUs start through shell tools",
                    e)
        return None


def describe(spec: MachineSpec, cpus: int, cpu: HostCpu) -> MachineDescription:
    """The machine `spec` runs on this host's `cpu`, as a snapshot of it records it."""
    return MachineDescription(machine_type=spec.machine_type, qemu_version=qemu_info().version,
                              device_model=DEVICE_MODEL, accel=spec.accel, base_mb=spec.base_mb,
                              dimm_mb=spec.dimm_mb, cpus=cpus, cpu_model=cpu.model,
                              cpu_features=cpu.recorded_features(),
                              cpu_vendor=cpu.recorded_vendor())


class QemuHost:
    """This host's resources, as every part of the runtime uses them."""

    def __init__(self, settings: Settings, network: Networking | None = None) -> None:
        self.settings = settings
        self.accel = settings.accelerator
        self.cpu = HostCpu.detect(self.accel, settings.cpu_model)
        if self.cpu.lacks:  # every restore and boot will say so too
            log.warning("this host cannot run CPU model %s (SANDLOT_CPU_MODEL): it lacks %s",
                        self.cpu.model, ", ".join(self.cpu.lacks))
        self.network = network
        self.jails = Jails(settings.instance or "default", kvm=self.accel == "kvm",
                           enabled=settings.confine and has_tools())
        if self.jails.enabled:
            self.jails.helper = _jail_helper(settings.images)
            settings.ensure()
            os.chmod(settings.data_dir, 0o711)  # VMs pass through to their disks; no listing
            self.vm_paths()
            open_to_vms(settings.hot_dir)
        self.reserve = HostReserve(memory_mb=settings.reserve_mem_mb,
                                   disk_mb=settings.reserve_disk_mb,
                                   disks_dir=settings.disks_dir, hot_dir=settings.hot_dir)
        self.cache = HotCache(settings.hot_dir, settings.cache_mb << 20,
                              share=share_with_vms if self.jails.enabled else None)
        self.store = ImageStore(settings)
        # images this host lacks are served from the store as they are read (runtime/lazy.py)
        self.lazy = LazyImages(self.store.store.url, VM_GID if self.jails.enabled else None,
                               settings.lazy_prefetch) \
            if settings.lazy_restore and lazy_available() else None
        # volumes' directories; their guests' mounts are served by it (each agent session
        # is given it when it connects)
        self.volumes = VolumeServer(settings.data_dir / "volumes",
                                    host_key(settings.data_dir / "volume-key"),
                                    max_bytes=settings.limits.volume_mb << 20,
                                    reserve_bytes=settings.reserve_disk_mb << 20)
        self.tasks: set[asyncio.Task] = set()

    def vm_paths(self) -> None:
        """Confined VMs reach their disks and builds by path: keep the way there open (a
        temporary parent directory may have been made private again meanwhile)."""
        if self.jails.enabled:
            for d in (self.settings.disks_dir, self.settings.images / "builds",
                      self.settings.run_root):
                ensure_traversable(d)
                ensure_traversable(d.resolve())

    def spawn(self, coro) -> asyncio.Task:
        """Run `coro` in the background; `stop` cancels what is still running."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self) -> None:
        if self.lazy is not None:
            self.lazy.close()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


class Part:
    """One job of the runtime, on the resources of its host."""

    def __init__(self, host: QemuHost) -> None:
        self.host = host
        self.settings = host.settings
        self.accel = host.accel
        self.cpu = host.cpu
        self.network = host.network
        self.jails = host.jails
        self.reserve = host.reserve
        self.cache = host.cache
        self.store = host.store
        self.volumes = host.volumes

    def _vm_paths(self) -> None:
        self.host.vm_paths()

    def _spawn(self, coro) -> asyncio.Task:
        return self.host.spawn(coro)
