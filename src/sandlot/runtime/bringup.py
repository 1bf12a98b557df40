"""Bringing VMs up: a restore from an image's snapshot (creates, restores, fork children,
rollback, resume, the warm pool), a boot from an image's disk, a claim of a pooled VM, and a
template build's cold boot.

Restore: the image's files are leased from the hot cache (hydrated from the store if missing);
the VM's disk chain and its network namespace are made side by side; QEMU loads the device state
with the RAM file mapped copy-on-write; memory is hotplugged if the plan asks for more; the agent
is connected *before* the VM runs (the snapshot was taken with a host connected, so the port's
state matches and no close/open event, which QEMU may drop, is needed) with env, generation,
entropy and CPUs sent behind the hello; then ``cont``, and the clock is synced. A guest that
does not answer is restored once more on a fresh overlay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from sandlot.errors import (
    GuestError,
    InvalidArgumentError,
    InvalidStateError,
    SandlotError,
    StorageError,
    VmmError,
)
from sandlot.guest.client import AgentClient, Configure
from sandlot.runtime.base import Image, MachinePlan, Vm
from sandlot.runtime.cache import Lease
from sandlot.runtime.host import Part, QemuHost, describe
from sandlot.runtime.qemu_vm import QemuVm
from sandlot.runtime.unwritten import UnwrittenRam
from sandlot.vmm import hotplug
from sandlot.vmm import snapshot as vmm_snapshot
from sandlot.vmm.disk import DiskChain, backing_file, virtual_size
from sandlot.vmm.jail import Jail, Limits
from sandlot.vmm.machine import Machine, MachineSpec
from sandlot.vmm.network import NetworkPolicy, PendingNetwork
from sandlot.vmm.qemu import qemu_info

log = logging.getLogger(__name__)

PARALLEL_RESTORES = 8
POOL_WARM_UP = "true"  # a pooled VM's first command, so a user's first one finds it warm
BOOT_TIMEOUT = 180.0


def _build_dirs(build: Path, disk: Path) -> tuple[Path, ...]:
    """The directories a VM reads its build from: the build's, and the one its disk layer's
    backing file names (a path through a link, or another images dir)."""
    dirs = {build, build.resolve()}
    backing = backing_file(disk)
    if backing is not None:
        dirs |= {backing.parent, backing.resolve().parent}
    return tuple(sorted(dirs))


def _on_network(spec: MachineSpec, net, jail: Jail | None) -> MachineSpec:
    """`spec` with the VM's network device, QEMU started in its namespace (None: none)."""
    if net is None:
        return spec
    spec = spec.with_(netdev=net.qemu_netdev()[-1])
    if jail is not None:
        return spec.with_(jail=replace(jail, netns=net.namespace))
    return spec.with_(exec_prefix=tuple(net.netns_exec_prefix()))


class BringUp(Part):
    """Makes running VMs: restores, boots, pooled VMs' claims, cold boots."""

    def __init__(self, host: QemuHost, kill: Callable[[Vm], Awaitable[None]],
                 check: Callable[[Image, MachinePlan, bool], None]) -> None:
        super().__init__(host)
        self._kill = kill  # the runtime's: every VM goes the same way
        self._check = check  # the runtime's: can this host make `plan` of that image?
        self._restore_slots = asyncio.Semaphore(PARALLEL_RESTORES)

    async def claim(self, vm: QemuVm, plan: MachinePlan) -> Vm | None:
        """A VM the pool restored ahead, given `plan`'s identity (None: the caller restores
        one instead)."""
        try:
            agent = await vm.guest()
            # Reseeds the RNG too; onlines or offlines vCPUs (QEMU always has MAX_CPUS).
            await agent.configure(Configure(env=plan.env, generation=plan.generation,
                                            cpus=plan.cpus if plan.cpus != vm.cpus else None))
            vm.cpus = plan.cpus
            if vm.growing is not None:
                await asyncio.wait({vm.growing})  # its growth to the default quota
            size = self._disk_size(plan, vm.disks.size)
            if size > vm.disks.size:
                self.reserve.disks.admit(vm.id, size, vm.disks.held)
                self._grow_soon(vm, size)  # as a restore does: not waited for
            vm.save()
            await agent.sync_clock()
            if self.network is not None and plan.network is not None \
                    and plan.network != NetworkPolicy():
                await self.network.update(vm.id, plan.network)
        except BaseException as e:
            # Out of the pool and in no record yet: whatever went wrong, it must not live on.
            log.warning("pooled VM %s could not be claimed: %s", vm.id, e)
            await self._kill(vm)
            if isinstance(e, InvalidArgumentError) or not isinstance(e, SandlotError):
                raise  # the request itself is at fault (or cancelled): a restore won't help
            return None  # e.g. its VM died while pooled: the caller restores one
        return vm

    async def make_pooled(self, image: Image, vm_id: str) -> Vm:
        """A VM for the warm pool, restored from `image` and warmed up."""
        plan = MachinePlan(cpus=image.machine.cpus, memory_mb=image.machine.memory_mb,
                           generation="pool", network=NetworkPolicy())
        vm = await self.restore(image, plan, vm_id)
        try:
            await (await vm.guest()).run(POOL_WARM_UP, track=False)
        except BaseException:
            await self._kill(vm)
            raise
        return vm

    async def _hot(self, image: Image) -> Lease:
        mount = None
        lazy = self.host.lazy
        if lazy is not None and not self.store.local(image):
            async def mount(entry: Path, names: dict[str, str]):
                return await lazy.start(entry, await self.store.manifest(image.key), names)

        return await self.cache.acquire(image.key, bool(image.machine.dimm_mb),
                                        lambda paths: self.store.fetch(image, paths),
                                        identity=self.store.identity(image), mount=mount)

    async def restore(self, image: Image, plan: MachinePlan, vm_id: str, *,
                      boot: bool = False, unwritten: UnwrittenRam | None = None) -> Vm:
        """`unwritten`: the image is a capture whose RAM files are still being written (taken
        by the caller): the VM starts from the files it was taken over and its pages."""
        self._check(image, plan, boot)
        if boot or not image.machine.memory:
            return await self._boot(image, plan, vm_id)
        self.reserve.check_vm(plan.memory_mb)
        run_dir = self.settings.run_root / vm_id
        build = await self.store.ensure_build(image.build)
        lease: Lease | None = None
        machine: Machine | None = None
        net = None
        disks: DiskChain | None = None
        jail: Jail | None = None
        connecting: asyncio.Task | None = None
        pending: PendingNetwork | None = None
        finishing: asyncio.Future | None = None  # the network's addresses and rules
        try:
            async with self._restore_slots:
                if unwritten is not None:
                    lease = self.cache.hold(image.key)
                    hot = {**self.cache.paths(image.key, dimm=False), **unwritten.files}
                else:
                    lease = await self._hot(image)
                    hot = lease.files()
                run_dir.mkdir(parents=True, exist_ok=True)
                jail = self.jails.make(
                    vm_id, Limits.for_vm(plan.memory_mb, plan.cpus),
                    rw=(run_dir, self.settings.disks_dir / vm_id, hot["ram"].parent),
                    ro=_build_dirs(build, hot["disk"]))
                self._vm_paths()
                owner = jail.uid if jail is not None else None
                disks = DiskChain(dir=self.settings.disks_dir / vm_id, source=hot["disk"],
                                  size=virtual_size(hot["disk"]), owner=owner)
                size = self._disk_size(plan, disks.size)
                self.reserve.disks.admit(vm_id, size, disks.held)
                if self.network is not None and plan.network is not None:
                    # QEMU starts once the namespace and its tap exist; their addresses and
                    # rules are set while it loads, and are there before the guest runs.
                    results = await asyncio.gather(disks.create(),
                                                   self.network.begin(vm_id, plan.network,
                                                                      tap_owner=owner),
                                                   return_exceptions=True)
                    if not isinstance(results[1], BaseException):
                        pending = results[1]
                    for result in results:
                        if isinstance(result, BaseException):
                            raise result
                    assert pending is not None
                    net = pending.net
                    finishing = asyncio.ensure_future(self.network.finish(pending))
                else:
                    await disks.create()
                spec = MachineSpec(
                    run_dir=run_dir, kernel=build / "vmlinuz", initrd=build / "initramfs.gz",
                    disk=disks.top, machine_type=image.machine.machine_type,
                    base_mb=image.machine.base_mb, cpus=image.machine.cpus, accel=self.accel,
                    cpu_model=self.cpu.arg,
                    ram_path=hot["ram"], ram_share=False,
                    ram_on_demand=lease is not None and lease.lazy is not None,
                    write_tracking=self.settings.write_tracking,
                    dimm_mb=image.machine.dimm_mb, dimm_path=hot.get("dimm"), jail=jail)
                spec = _on_network(spec, net, jail)
                extra_mb = plan.memory_mb - image.machine.memory_mb
                configure = Configure(env=plan.env, generation=plan.generation,
                                      cpus=plan.cpus if plan.cpus != image.machine.cpus else None,
                                      clock=False)  # sync_clock sets it once the VM runs
                for attempt in (1, 2):
                    if unwritten is None:
                        machine = await vmm_snapshot.restore(spec, hot["devstate"])
                    else:  # the captured pages in memory before the devices load
                        machine = await vmm_snapshot.launch_incoming(spec)
                        await unwritten.write_into(machine.pid)
                        await vmm_snapshot.load_devices(machine, hot["devstate"])
                    await hotplug.apply(machine, extra_mb)
                    running = asyncio.Event()
                    connecting = asyncio.create_task(AgentClient.connect(
                        str(spec.agent_socket), timeout=15, configure=configure,
                        running=running, volumes=self.volumes))
                    await machine.wait_chardev_connected("agent")
                    if finishing is not None:
                        await finishing
                    await machine.cont()
                    running.set()
                    try:
                        agent = await connecting
                        break
                    except GuestError as e:
                        console = machine.console_tail()
                        await machine.kill()
                        machine = None
                        if attempt == 2:
                            raise GuestError(f"{e.message}; guest console: {console}") from e
                        log.warning("VM %s: the restored guest did not answer (%s); console: "
                                    "%s; restoring again", vm_id, e.message, console or "empty")
                        await disks.create()  # start over from the image, on a fresh overlay
            await agent.sync_clock()
            vm = QemuVm(id=vm_id, image=image, cpus=plan.cpus, memory_mb=plan.memory_mb,
                        machine=machine, agent=agent, disks=disks, run_dir=run_dir,
                        lease=lease, network=net)
            vm.save()
            self._grow_soon(vm, size)
        except BaseException as e:
            failed = lease.lazy.failed() if lease is not None and lease.lazy is not None \
                else None
            if connecting is not None and not connecting.done():
                connecting.cancel()
            if finishing is not None:  # a thread: let it end (a failure removes its network)
                with contextlib.suppress(BaseException):
                    await asyncio.shield(finishing)
            elif pending is not None:
                await self.network.abandon(pending)
            await self._undo(vm_id, run_dir, machine, net, disks, jail, lease)
            if failed is not None and isinstance(e, SandlotError):  # what the VM died of
                raise StorageError(f"sandbox {vm_id}: its image could not be read: "
                                   f"{failed}") from e
            raise
        return vm

    async def _boot(self, image: Image, plan: MachinePlan, vm_id: str) -> QemuVm:
        """A new VM booted from `image`'s disk (a filesystem-only image, or a resume that
        reboots): the build's kernel and initramfs, the image's disk under an overlay of its
        own, its network, and fresh memory of the plan's size; agent connected and configured.
        Slow under TCG (a boot: seconds), and nothing of the image's memory survives."""
        self._check_cpu()
        self.reserve.check_vm(plan.memory_mb)
        run_dir = self.settings.run_root / vm_id
        build = await self.store.ensure_build(image.build)
        lease: Lease | None = None
        machine: Machine | None = None
        net = None
        disks: DiskChain | None = None
        jail: Jail | None = None
        try:
            async with self._restore_slots:
                if image.machine.memory:  # a reboot: the entry as restores have it
                    lease = await self._hot(image)
                else:
                    lease = await self.cache.acquire(
                        image.key, False, lambda paths: self.store.fetch(image, paths),
                        identity=self.store.identity(image), memory=False)
                disk = lease.path("disk")
                run_dir.mkdir(parents=True, exist_ok=True)
                jail = self.jails.make(vm_id, Limits.for_vm(plan.memory_mb, plan.cpus),
                                       rw=(run_dir, self.settings.disks_dir / vm_id),
                                       ro=(disk.parent, *_build_dirs(build, disk)))
                self._vm_paths()
                owner = jail.uid if jail is not None else None
                disks = DiskChain(dir=self.settings.disks_dir / vm_id, source=disk,
                                  size=virtual_size(disk), owner=owner)
                size = self._disk_size(plan, disks.size)
                self.reserve.disks.admit(vm_id, size, disks.held)
                await disks.create()
                if self.network is not None and plan.network is not None:
                    net = await self.network.attach(vm_id, plan.network, tap_owner=owner)
                spec = MachineSpec(
                    run_dir=run_dir, kernel=build / "vmlinuz", initrd=build / "initramfs.gz",
                    disk=disks.top, machine_type=qemu_info().default_q35,
                    base_mb=plan.memory_mb, cpus=plan.cpus, accel=self.accel,
                    cpu_model=self.cpu.arg, jail=jail,
                    write_tracking=self.settings.write_tracking)
                spec = _on_network(spec, net, jail)
                machine = await Machine.launch(spec)
            try:
                agent = await AgentClient.connect(str(spec.agent_socket), timeout=BOOT_TIMEOUT,
                                                  volumes=self.volumes)
                await agent.configure(Configure(env=plan.env, generation=plan.generation,
                                                cpus=plan.cpus))
            except GuestError as e:
                raise VmmError(f"sandbox {vm_id} did not boot from its disk: {e.message}; "
                               f"guest console: {machine.console_tail()}") from None
            await agent.sync_clock()
            vm = QemuVm(id=vm_id, image=image, cpus=plan.cpus, memory_mb=plan.memory_mb,
                        machine=machine, agent=agent, disks=disks, run_dir=run_dir,
                        lease=lease, network=net, booted=True)
            vm.save()
            self._grow_soon(vm, size)
        except BaseException:
            await self._undo(vm_id, run_dir, machine, net, disks, jail, lease)
            raise
        log.info("booted %s from image %s's disk", vm_id, image.key)
        return vm

    def _disk_size(self, plan: MachinePlan, image_size: int) -> int:
        """The disk a VM of `plan` gets, bytes: its quota, never less than its image's."""
        return max(image_size, (plan.disk_mb or self.settings.disk_quota_mb) << 20)

    def _grow_soon(self, vm: QemuVm, size: int) -> None:
        """Grow a new VM's disk to `size` bytes (its quota, already promised) right after it is
        handed out: the guest's online resize takes 150-500 ms under TCG, which a restore does
        not wait for. Until then the guest sees less than its quota, never more. Captures
        wait for it (the VM's lock)."""
        if size <= vm.disks.size:
            return
        vm.quota = size

        async def grow() -> None:
            async with vm.lock:
                if vm.machine.exited:
                    return
                try:
                    if not await self._grow_disk(vm.id, vm.machine, vm.disks,
                                                 await vm.guest(), size):
                        vm.quota = 0
                    vm.save()
                except (SandlotError, OSError) as e:
                    log.warning("VM %s: its disk was not grown to %d MiB: %s", vm.id,
                                size >> 20, e)

        vm.growing = self._spawn(grow())

    def _check_cpu(self) -> None:
        """A boot gives its guest this host's CPU model: refused, before anything starts,
        where this host cannot run it (vmm/cpu.py)."""
        problems = self.cpu.problems(self.cpu.model, ())
        if problems:
            raise InvalidStateError(problems[0])

    async def _grow_disk(self, vm_id: str, machine: Machine, disks: DiskChain,
                         agent: AgentClient, size: int) -> bool:
        """Grow a running VM's disk to `size` bytes and its root filesystem with it (the
        agent's online resize), so the guest's filesystem is its quota. An agent without
        `grow_disk` (a template built before it) keeps its image's disk (False)."""
        if size <= disks.size:
            return True
        if not agent.has_cap("grow_disk"):
            log.warning("VM %s: its agent cannot grow its disk (rebuild its template); it keeps "
                        "%d MiB", vm_id, disks.size >> 20)
            self.reserve.disks.hold(vm_id, disks.size, disks.held)  # less: nothing to check
            return False
        t0 = time.monotonic()
        await disks.grow(machine, size)
        t1 = time.monotonic()
        grown = await agent.configure(Configure(disk_bytes=size, reseed=False, clock=False))
        log.info("VM %s: disk grown to %d MiB (its filesystem: %d MiB) in %.1f ms "
                 "(block_resize %.1f)", vm_id, size >> 20, (grown.disk_bytes or 0) >> 20,
                 (time.monotonic() - t0) * 1000, (t1 - t0) * 1000)
        return True

    async def _undo(self, vm_id: str, run_dir: Path, machine: Machine | None, net,
                    disks: DiskChain | None, jail: Jail | None, lease: Lease | None) -> None:
        """Remove what a VM that failed to come up had so far (None: not made yet)."""
        self.reserve.disks.release(vm_id)
        if machine is not None:
            await machine.kill()
        if net is not None:
            with contextlib.suppress(Exception):
                await self.network.detach(vm_id)
        shutil.rmtree(run_dir, ignore_errors=True)
        if disks is not None:
            disks.remove()
        await asyncio.to_thread(self.jails.release, jail)
        if lease is not None:
            lease.release()

    async def cold_boot(self, build: str, plan: MachinePlan, vm_id: str) -> QemuVm:
        """Boot a template build from scratch (slow under TCG: the baseline restores beat),
        its agent connected and configured."""
        self._check_cpu()
        build_dir = await self.store.ensure_build(build)
        rootfs = build_dir / "rootfs.ext4"
        run_dir = self.settings.run_root / vm_id
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (self.settings.disks_dir / vm_id).mkdir(parents=True, exist_ok=True)
        jail = self.jails.make(vm_id, Limits.for_vm(plan.memory_mb, plan.cpus),
                               rw=(run_dir, self.settings.disks_dir / vm_id), ro=(build_dir,))
        self._vm_paths()
        disks = DiskChain(dir=self.settings.disks_dir / vm_id, source=rootfs,
                          size=rootfs.stat().st_size, source_fmt="raw",
                          owner=jail.uid if jail is not None else None)
        spec = MachineSpec(run_dir=run_dir, kernel=build_dir / "vmlinuz",
                           initrd=build_dir / "initramfs.gz", disk=disks.top,
                           machine_type=qemu_info().default_q35, base_mb=plan.memory_mb,
                           cpus=plan.cpus, accel=self.accel,
                    cpu_model=self.cpu.arg, jail=jail,
                    write_tracking=self.settings.write_tracking)
        try:
            await disks.create()
            machine = await Machine.launch(spec)
        except BaseException:
            disks.remove()
            await asyncio.to_thread(self.jails.release, jail)
            raise
        try:  # a template build's VM: no volumes
            agent = await AgentClient.connect(str(spec.agent_socket), timeout=BOOT_TIMEOUT)
            await agent.configure(Configure(env=plan.env, generation=plan.generation,
                                            cpus=plan.cpus))
        except BaseException as e:
            console = machine.console_tail()
            await machine.kill()
            shutil.rmtree(run_dir, ignore_errors=True)
            disks.remove()
            await asyncio.to_thread(self.jails.release, jail)
            if isinstance(e, GuestError):
                raise VmmError(f"guest did not come up: {console}") from None
            raise
        image = Image(key=f"boot-{build}", build=build, machine=describe(spec, plan.cpus, self.cpu))
        return QemuVm(id=vm_id, image=image, cpus=plan.cpus, memory_mb=plan.memory_mb,
                      machine=machine, agent=agent, disks=disks, run_dir=run_dir)
