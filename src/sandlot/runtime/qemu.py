"""The QEMU runtime: the `Runtime` core gets, made of one part per job on one host's resources
(runtime/host.py):

- bring-up (runtime/bringup.py): restores, boots, the warm pool's VMs and their claims;
- capture (runtime/capture.py): snapshots, forks and boot images, and their RAM files;
- the store front (runtime/storefront.py): storing images, templates published, imported and
  reconciled with object storage, the store's garbage collection;
- recovery (runtime/recovery.py): re-adopting VMs after a restart.

What is left here: a VM's end (`kill`), its network, and the host's room, usage and pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Awaitable, Callable

from sandlot.config import Settings
from sandlot.errors import InvalidArgumentError, InvalidStateError
from sandlot.runtime.base import (
    Captured,
    Image,
    MachinePlan,
    Room,
    Runtime,
    Stored,
    Usage,
    Vm,
)
from sandlot.runtime.bringup import BringUp
from sandlot.runtime.capacity import free_mb, mem_available_mb
from sandlot.runtime.capture import Capturer
from sandlot.runtime.host import QemuHost
from sandlot.runtime.network import Networking
from sandlot.runtime.pool import WarmPool
from sandlot.runtime.qemu_vm import QemuVm
from sandlot.runtime.recovery import Recovery
from sandlot.runtime.storefront import StoreFront
from sandlot.runtime.usage import vm_usage
from sandlot.vmm.cpu import HostCpu
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.machine import DEVICE_MODEL
from sandlot.vmm.network import NetworkPolicy
from sandlot.vmm.qemu import qemu_info

MAX_ADVERTISED_KEYS = 256  # cached image keys a heartbeat names (placement prefers them)


class QemuRuntime(Runtime):
    def __init__(self, settings: Settings, network: Networking | None = None) -> None:
        self.host = host = QemuHost(settings, network)
        self.settings, self.accel, self.network = settings, host.accel, network
        self.cache, self.store, self.reserve, self.jails = (host.cache, host.store,
                                                            host.reserve, host.jails)
        self.volumes = host.volumes

        def check(image: Image, plan: MachinePlan, boot: bool) -> None:
            self.check_loadable(image.machine)
            self.check_plan(image, plan, boot)

        def kill(vm: Vm) -> Awaitable[None]:
            return self.kill(vm)

        self.bringup = BringUp(host, kill, check)
        self.captures = Capturer(host, self.bringup, kill)
        self.storefront = StoreFront(host, self.captures)
        self.recovery = Recovery(host, self.captures, kill)
        self._new_id: Callable[[], str] | None = None  # core's, given with the images to pool
        self.pool = WarmPool(make=self._make_pooled, discard=self.kill,
                             size=settings.pool_size) if settings.pool_size else None

    # ---- checks ---------------------------------------------------------------------------

    def check_loadable(self, machine: MachineDescription) -> None:
        problems = machine.problems(qemu_info(), DEVICE_MODEL, self.accel, self.host.cpu)
        if problems:
            raise InvalidStateError("; ".join(problems))

    # ---- bring-up -------------------------------------------------------------------------

    async def claim(self, image: Image, plan: MachinePlan) -> Vm | None:
        if self.pool is None or plan.memory_mb != image.machine.memory_mb:
            return None
        vm = self.pool.take(image)
        if vm is None:
            return None
        assert isinstance(vm, QemuVm)
        return await self.bringup.claim(vm, plan)

    async def _make_pooled(self, image: Image) -> Vm:
        assert self._new_id is not None  # the pool makes only what keep_warm named
        return await self.bringup.make_pooled(image, self._new_id())

    async def restore(self, image: Image, plan: MachinePlan, vm_id: str, *,
                      boot: bool = False) -> Vm:
        unwritten = (self.captures.unwritten(image.key)
                     if self.settings.restore_unwritten and not boot else None)
        if unwritten is None or not unwritten.take():  # at once: its pages stay until left
            return await self.bringup.restore(image, plan, vm_id, boot=boot)
        entry = self.cache.hold(image.key)  # and its entry, until the VM holds it
        try:
            return await self.bringup.restore(image, plan, vm_id, unwritten=unwritten)
        finally:
            entry.release()
            unwritten.leave()

    # ---- capture --------------------------------------------------------------------------

    async def capture(self, vm: Vm, key: str, *, persistent: bool = True,
                      memory: bool = True, sync: bool = False) -> Captured:
        return await self.captures.capture(vm, key, persistent=persistent, memory=memory,
                                           sync=sync)

    def release(self, key: str) -> None:
        self.captures.release(key)

    async def boot_image(self, build: str, plan: MachinePlan) -> tuple[Image, float]:
        return await self.captures.boot_image(build, plan)

    # ---- the store ------------------------------------------------------------------------

    async def persist(self, captured: Captured, meta: dict) -> Stored:
        return await self.storefront.persist(captured, meta)

    async def stored_meta(self, key: str) -> dict:
        return await self.storefront.stored_meta(key)

    async def discard(self, key: str) -> None:
        await self.storefront.discard(key)

    async def publish_template(self, image: Image, info: dict) -> Stored:
        return await self.storefront.publish_template(image, info)

    async def import_template(self, image: Image, info: dict) -> bool:
        return await self.storefront.import_template(image, info)

    async def reconcile_template(self, image: Image) -> bool:
        return await self.storefront.reconcile_template(image)

    async def template_info(self, name: str) -> dict:
        return await self.storefront.template_info(name)

    async def collect_garbage(self, grace: float) -> dict:
        return await self.storefront.collect_garbage(grace)

    # ---- running VMs ----------------------------------------------------------------------

    async def kill(self, vm: Vm) -> None:
        assert isinstance(vm, QemuVm)
        self.storefront.forget(vm.id)
        self.reserve.disks.release(vm.id)
        if vm.growing is not None:
            vm.growing.cancel()
        await self.captures.flattened(vm)  # it reads the frozen layer, which goes with the VM
        with contextlib.suppress(Exception):
            await vm.agent.close()
        await vm.machine.kill()
        if self.network is not None:
            with contextlib.suppress(Exception):
                await self.network.detach(vm.id)
        shutil.rmtree(vm.run_dir, ignore_errors=True)
        vm.disks.remove()
        await asyncio.to_thread(self.jails.release, vm.machine.spec.jail)
        if vm.lease is not None:
            vm.lease.release()

    def _networking(self) -> Networking:
        if self.network is None:
            raise InvalidArgumentError("sandbox networking is off on this server "
                                       "(SANDLOT_NETWORK=off or not running as root)")
        return self.network

    async def set_network(self, vm: Vm, policy: NetworkPolicy) -> None:
        await self._networking().update(vm.id, policy)

    async def expose(self, vm: Vm, port: int) -> tuple[str, int]:
        return await self._networking().expose(vm.id, port)

    def park_ports(self, vm: Vm) -> dict[int, tuple[str, int]]:
        return self.network.manager.park(vm.id) if self.network else {}

    async def wanted(self) -> str:
        if self.network is None:
            return await super().wanted()
        return await self.network.manager.wanted()

    def refuse_parked_ports(self, vm_id: str) -> None:
        if self.network is not None:
            self.network.manager.refuse(vm_id)

    def drop_parked_ports(self, vm_id: str) -> None:
        if self.network is not None:
            self.network.manager.unpark(vm_id)

    # ---- recovery and shutdown ------------------------------------------------------------

    async def recover(self, expected: dict[str, NetworkPolicy | None],
                      keep_images: set[str]) -> dict[str, Vm]:
        return await self.recovery.recover(expected, keep_images)

    def keep_warm(self, images: dict[str, Image], new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        if self.pool is not None:
            self.pool.keep(images)

    def usage(self, vm: Vm) -> Usage | None:
        assert isinstance(vm, QemuVm)
        return vm_usage(vm.pid, vm.cpus, vm.memory_mb, vm.disks.dir, vm.disk_mb << 20,
                        vm.machine.disk_errors.count)

    def room(self) -> Room:
        keys = self.cache.keys()
        return Room(memory_free_mb=max(0, mem_available_mb() - self.reserve.memory_mb),
                    disk_free_mb=max(0, self.reserve.disks.available()) >> 20,
                    disk_promised_mb=self.reserve.disks.promised() >> 20,
                    cache_free_mb=free_mb(self.settings.hot_dir),
                    cached=tuple(keys[:MAX_ADVERTISED_KEYS]))

    def pool_stats(self) -> dict[str, dict]:
        return self.pool.stats() if self.pool is not None else {}

    def cpu(self) -> tuple[str, HostCpu] | None:
        return self.accel, self.host.cpu

    async def start(self) -> None:
        if self.pool is not None:
            self.pool.start()

    async def close(self, vms: list[Vm], kill: bool) -> None:
        if self.pool is not None:
            await self.pool.close()  # pooled VMs are in no record: they cannot be re-adopted
        await self.host.stop()
        for vm in vms:
            assert isinstance(vm, QemuVm)
            if kill:
                await self.kill(vm)
            else:
                await vm.disconnect()
