"""The QEMU runtime: every way a VM comes up or is captured goes through here.

Restore (creates, restores, fork children, rollback, resume, the warm pool): the image's files
are leased from the hot cache (hydrated from the store if missing); the VM's disk chain and its
network namespace are made side by side; QEMU loads the device state with the RAM file mapped
copy-on-write; memory is hotplugged if the plan asks for more; the agent is connected *before*
the VM runs (the snapshot was taken with a host connected, so the port's state matches and no
close/open event, which QEMU may drop, is needed) with env, generation, entropy and CPUs sent
behind the hello; then ``cont``, and the clock is synced. A guest that does not answer is
restored once more on a fresh overlay.

Capture (snapshots, forks, template builds): vmm/snapshot.capture with the VM's disk chain;
the frozen disk layer becomes the image's two-layer disk; the chain is compacted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sandlot.config import Settings
from sandlot.errors import (
    BuildError,
    GuestError,
    InvalidArgumentError,
    SandlotError,
    VmmError,
)
from sandlot.guest.client import AgentClient, Configure
from sandlot.images.guest import build_jail_helper
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
from sandlot.runtime.cache import HotCache, Lease
from sandlot.runtime.capacity import HostReserve, free_mb, mem_available_mb
from sandlot.runtime.images import IMAGE_FILES, ImageStore
from sandlot.runtime.network import Networking
from sandlot.runtime.pool import WarmPool
from sandlot.runtime.qemu_vm import QemuVm, load_state
from sandlot.runtime.usage import vm_usage
from sandlot.storage.chunks import DigestMemo
from sandlot.vmm import hotplug, memory
from sandlot.vmm import snapshot as vmm_snapshot
from sandlot.vmm.cpu import HostCpu
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.disk import DiskChain, backing_file, virtual_size
from sandlot.vmm.jail import (
    Jail,
    Jails,
    Limits,
    ensure_traversable,
    has_tools,
    open_to_vms,
    share_with_vms,
)
from sandlot.vmm.machine import DEVICE_MODEL, Machine, MachineSpec
from sandlot.vmm.memory import PAGE
from sandlot.vmm.network import NetworkPolicy, PendingNetwork
from sandlot.vmm.processes import qemu_alive, qemus_under
from sandlot.vmm.qemu import QemuInfo, qemu_info

log = logging.getLogger(__name__)

PARALLEL_RESTORES = 8
MAX_ADVERTISED_KEYS = 256  # cached image keys a heartbeat names (placement prefers them)
POOL_WARM_UP = "true"  # a pooled VM's first command, so a user's first one finds it warm
BOOT_TIMEOUT = 180.0
SYNC_TIMEOUT = 120.0  # a filesystem-only capture: the guest's `sync`
SYNC_BEST_EFFORT = 10.0  # before a pause with memory


@dataclass
class _Capture:
    """A captured image's files (held), what it came from, and what changed since."""

    lease: Lease
    related: list[str]
    changed: dict[str, list[tuple[int, int]]]
    vm: QemuVm | None = None
    pending: vmm_snapshot.PendingRam | None = None  # RAM files not written yet
    filled: Callable[[], None] | None = None  # lets restores from the entry go on
    flatten: asyncio.Task | None = None  # the disk file, being written
    stored: bool = False
    # (the VM's last stored capture, per RAM file the byte ranges written since): what may
    # differ from that image, if its manifest is still there
    since: tuple[str, dict[str, list[tuple[int, int]]]] | None = None


def _written_since(base: tuple[str, dict] | None, written: dict | None
                   ) -> tuple[str, dict] | None:
    """(the VM's last stored capture, per region the pages written since it, this capture's
    included), from what it was before this capture and what this capture's tracker saw."""
    if base is None or written is None:
        return None
    key, before = base
    empty = np.zeros(0, dtype=np.int64)
    return key, {name: np.union1d(before.get(name, empty), pages)
                 for name, pages in written.items()}


def _byte_ranges(pages) -> list[tuple[int, int]]:
    return [(int(first) * PAGE, int(count) * PAGE) for first, count in memory.runs(pages)]


def _build_dirs(build: Path, disk: Path) -> tuple[Path, ...]:
    """The directories a VM reads its build from: the build's, and the one its disk layer's
    backing file names (a path through a link, or another images dir)."""
    dirs = {build, build.resolve()}
    backing = backing_file(disk)
    if backing is not None:
        dirs |= {backing.parent, backing.resolve().parent}
    return tuple(sorted(dirs))


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
                              cpu_features=cpu.recorded_features())


class QemuRuntime(Runtime):
    def __init__(self, settings: Settings, network: Networking | None = None) -> None:
        self.settings = settings
        self.accel = settings.accel
        self.cpu = HostCpu.detect(settings.accel, settings.cpu_model)
        self.network = network
        self.jails = Jails(settings.instance or "default", kvm=self.accel == "kvm",
                           enabled=settings.confine and has_tools())
        if self.jails.enabled:
            self.jails.helper = _jail_helper(settings.images)
            settings.ensure()
            os.chmod(settings.data_dir, 0o711)  # VMs pass through to their disks; no listing
            self._vm_paths()
            open_to_vms(settings.hot_dir)
        self.reserve = HostReserve(memory_mb=settings.reserve_mem_mb,
                                   disk_mb=settings.reserve_disk_mb,
                                   disks_dir=settings.disks_dir, hot_dir=settings.hot_dir)
        self.cache = HotCache(settings.hot_dir, settings.cache_mb << 20,
                              share=share_with_vms if self.jails.enabled else None)
        self.store = ImageStore(settings)
        self._restore_slots = asyncio.Semaphore(PARALLEL_RESTORES)
        self._captures: dict[str, _Capture] = {}
        self._memos: dict[str, dict[bytes, str]] = {}  # VM id -> its last snapshot's digests
        self._tasks: set[asyncio.Task] = set()
        self.pool = WarmPool(make=self._make_pooled, discard=self.kill,
                             size=settings.pool_size) if settings.pool_size else None

    def _vm_paths(self) -> None:
        """Confined VMs reach their disks and builds by path: keep the way there open (a
        temporary parent directory may have been made private again meanwhile)."""
        if self.jails.enabled:
            for d in (self.settings.disks_dir, self.settings.images / "builds",
                      self.settings.run_root):
                ensure_traversable(d)
                ensure_traversable(d.resolve())

    # ---- checks ---------------------------------------------------------------------------

    def host_machine(self) -> tuple[QemuInfo, str]:
        return qemu_info(), DEVICE_MODEL

    def host_cpu(self) -> HostCpu:
        return self.cpu

    # ---- bringing VMs up ------------------------------------------------------------------

    async def claim(self, image: Image, plan: MachinePlan) -> Vm | None:
        if self.pool is None or plan.memory_mb != image.machine.memory_mb:
            return None
        vm = self.pool.take(image)
        if vm is None:
            return None
        assert isinstance(vm, QemuVm)
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
            await self.kill(vm)
            if isinstance(e, InvalidArgumentError) or not isinstance(e, SandlotError):
                raise  # the request itself is at fault (or cancelled): a restore won't help
            return None  # e.g. its VM died while pooled: the caller restores one
        return vm

    async def _make_pooled(self, image: Image) -> Vm:
        vm_id = "sb-" + secrets.token_hex(5)
        plan = MachinePlan(cpus=image.machine.cpus, memory_mb=image.machine.memory_mb,
                           generation="pool", network=NetworkPolicy())
        vm = await self.restore(image, plan, vm_id)
        try:
            await (await vm.guest()).run(POOL_WARM_UP, track=False)
        except BaseException:
            await self.kill(vm)
            raise
        return vm

    async def _hot(self, image: Image) -> Lease:
        return await self.cache.acquire(image.key, bool(image.machine.dimm_mb),
                                        lambda paths: self.store.fetch(image, paths),
                                        identity=self.store.identity(image))

    async def restore(self, image: Image, plan: MachinePlan, vm_id: str, *,
                      boot: bool = False) -> Vm:
        self.check_loadable(image.machine)
        self.check_plan(image, plan, boot)
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
                    cpu_model=self.cpu.model,
                    ram_path=hot["ram"], ram_share=False,
                    dimm_mb=image.machine.dimm_mb, dimm_path=hot.get("dimm"), jail=jail)
                if net is not None:
                    spec = spec.with_(netdev=net.qemu_netdev()[-1])
                    if jail is not None:
                        spec = spec.with_(jail=replace(jail, netns=net.namespace))
                    else:
                        spec = spec.with_(exec_prefix=tuple(net.netns_exec_prefix()))
                extra_mb = plan.memory_mb - image.machine.memory_mb
                configure = Configure(env=plan.env, generation=plan.generation,
                                      cpus=plan.cpus if plan.cpus != image.machine.cpus else None,
                                      clock=False)  # sync_clock sets it once the VM runs
                for attempt in (1, 2):
                    machine = await vmm_snapshot.restore(spec, hot["devstate"])
                    await hotplug.apply(machine, extra_mb)
                    running = asyncio.Event()
                    connecting = asyncio.create_task(AgentClient.connect(
                        str(spec.agent_socket), timeout=15, configure=configure,
                        running=running))
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
        except BaseException:
            if connecting is not None and not connecting.done():
                connecting.cancel()
            if finishing is not None:  # a thread: let it end (a failure removes its network)
                with contextlib.suppress(BaseException):
                    await asyncio.shield(finishing)
            elif pending is not None:
                await self.network.abandon(pending)
            await self._undo(vm_id, run_dir, machine, net, disks, jail, lease)
            raise
        return vm

    async def _boot(self, image: Image, plan: MachinePlan, vm_id: str) -> QemuVm:
        """A new VM booted from `image`'s disk (a filesystem-only image, or a resume that
        reboots): the build's kernel and initramfs, the image's disk under an overlay of its
        own, its network, and fresh memory of the plan's size; agent connected and configured.
        Slow under TCG (a boot: seconds), and nothing of the image's memory survives."""
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
                    cpu_model=self.cpu.model, jail=jail)
                if net is not None:
                    spec = spec.with_(netdev=net.qemu_netdev()[-1])
                    if jail is not None:
                        spec = spec.with_(jail=replace(jail, netns=net.namespace))
                    else:
                        spec = spec.with_(exec_prefix=tuple(net.netns_exec_prefix()))
                machine = await Machine.launch(spec)
            try:
                agent = await AgentClient.connect(str(spec.agent_socket), timeout=BOOT_TIMEOUT)
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
                    cpu_model=self.cpu.model, jail=jail)
        try:
            await disks.create()
            machine = await Machine.launch(spec)
        except BaseException:
            disks.remove()
            await asyncio.to_thread(self.jails.release, jail)
            raise
        try:
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

    async def boot_image(self, build: str, plan: MachinePlan) -> tuple[Image, float]:
        """Cold-boot, settle, capture; the boot image stays with the build (builds/<hash>/
        image) until `publish_template` stores it."""
        local = self.store.local_image(build)
        work = local.with_name("work")
        for d in (work, local):
            shutil.rmtree(d, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.monotonic()
        vm = await self.cold_boot(build, replace(plan, generation="template"),
                                  f"tb-{build[:8]}")
        boot_ms = (time.monotonic() - t0) * 1000
        try:
            await warm_up(vm.agent)
            await asyncio.sleep(0.5)  # let boot-time work settle: an idle guest
            await vmm_snapshot.capture(vm.machine, vm.disks, work)
            await vm.disks.flatten_frozen(work / IMAGE_FILES["disk"])
        finally:
            await self.kill(vm)
        work.replace(local)
        return Image(key=f"tpl-{build}", build=build, machine=vm.image.machine), boot_ms

    async def publish_template(self, image: Image, info: dict) -> Stored:
        return await self.store.publish_template(image, info)

    async def import_template(self, image: Image, info: dict) -> bool:
        return await self.store.import_template(image, info)

    async def reconcile_template(self, image: Image) -> bool:
        if not await self.store.store.exists(image.key):
            return False
        return await self.store.reconcile_build(image)

    async def template_info(self, name: str) -> dict:
        return await self.store.template_info(name)

    # ---- capture and storage --------------------------------------------------------------

    async def capture(self, vm: Vm, key: str, *, persistent: bool = True,
                      memory: bool = True, sync: bool = False) -> Captured:
        """A persistent capture's RAM files are written after its upload (`release`): the
        upload reads the RAM from the capture's buffer and the source's file, so a snapshot
        is ready without waiting for them. Until they are written the cache entry is not
        ready and restores from it wait (`HotCache.filling`). A fork's children restore from
        its files at once: they are written before this returns."""
        assert isinstance(vm, QemuVm)
        if memory:
            self.reserve.check_capture(vm.memory_mb, vm.disks.held())
        else:
            self.reserve.disks.check("a snapshot's disk layer", vm.disks.held())
        t0 = time.monotonic()
        lease = self.cache.create(key, persistent, memory=memory)
        filled = await self.cache.filling(key) if persistent and memory else None
        self._vm_paths()
        result = None
        since = None
        try:
            if not memory:  # the disk is all it keeps: what the guest wrote must be on it
                await _sync_guest(vm, SYNC_TIMEOUT)
            elif sync:  # best effort: the memory holds it anyway
                try:
                    await _sync_guest(vm, SYNC_BEST_EFFORT)
                except (SandlotError, TimeoutError) as e:
                    log.warning("%s: guest not synced before its capture: %s", vm.id, e)
            async with vm.lock:
                await self._compact(vm)
                if vm.disks.frozen is not None:
                    raise VmmError(f"sandbox {vm.id}: its disk chain could not be compacted "
                                   "before the snapshot")
                if memory:
                    # The pages written since the VM's last stored capture: known only while
                    # every capture in between was tracked and went through.
                    ram_base, vm.ram_base = vm.ram_base, None
                    result = await vmm_snapshot.capture(vm.machine, vm.disks,
                                                        self.cache.dir(key),
                                                        defer_ram=persistent,
                                                        quiet=vm.agent.writes_held)
                    pause_ms, changed_pages = result.pause_ms, result.changed
                    since = _written_since(ram_base, result.written)
                    if result.written is not None:
                        vm.ram_base = (key, {}) if persistent else since
                else:
                    await vmm_snapshot.freeze_disk(vm.machine, vm.disks)
                    pause_ms, changed_pages = 0.0, {}
                vm.save()

            async def clock() -> None:
                if not memory:
                    return
                # The guest's clock stood still during the pause: bring it back to the host's.
                try:
                    await (await vm.guest()).sync_clock()
                except SandlotError as e:
                    log.warning("clock resync after a capture of %s failed: %s", vm.id, e)

            t = time.monotonic()
            flatten = None
            if result is not None and result.pending is not None:
                # Flattened while the upload hashes the RAM (it waits for the disk; the
                # entry is made ready after both).
                flatten = self._spawn(vm.disks.flatten_frozen(lease.path("disk")))
                vm.flattening = flatten
                await clock()
            else:  # a fork's children restore from its disk at once
                await asyncio.gather(clock(), vm.disks.flatten_frozen(lease.path("disk")))
                if result is not None:
                    result.phases_ms["flatten"] = (time.monotonic() - t) * 1000
            if result is not None:
                changed_mib = sum(len(p) for p in changed_pages.values()) * 4096 / 2**20
                log.info("captured %s of %s: pause %.1f ms (%s), %.1f MiB changed since its "
                         "restore, %d pages copied in the pause", key, vm.id, pause_ms,
                         ", ".join(f"{k} {v:.1f}" for k, v in result.phases_ms.items()),
                         changed_mib, result.pages_in_pause)
            if result is None or result.pending is None:
                self.cache.mark_ready(key)
            self.cache.evict()
        except BaseException:
            await self._flattened(vm)
            if result is not None and result.pending is not None:
                result.pending.close()
            lease.release()
            self.cache.remove(key)
            if filled is not None:
                filled()
            raise
        related = [vm.image.key] + ([vm.last_capture] if vm.last_capture else [])
        # Pages changed relative to the image the VM maps; a booted VM maps none (all its
        # RAM is its own), so its files are hashed whole.
        changed = {} if vm.booted else {name: _byte_ranges(pages)
                                        for name, pages in changed_pages.items()}
        self._captures[key] = _Capture(lease, related, changed, vm,
                                       result.pending if result is not None else None, filled,
                                       flatten, since=None if since is None else (
                                           since[0], {name: _byte_ranges(pages)
                                                      for name, pages in since[1].items()}))
        vm.last_capture = key if persistent else vm.last_capture
        self._spawn(self._compact_locked(vm))
        machine = describe(vm.machine.spec, vm.cpus, self.cpu)
        image = Image(key=key, build=vm.image.build, persistent=persistent,
                      machine=machine if memory else replace(machine, memory=False))
        return Captured(image=image, pause_ms=pause_ms,
                        total_ms=(time.monotonic() - t0) * 1000)

    @staticmethod
    async def _flattened(vm: QemuVm) -> None:
        """Wait for a capture's disk to be flattened from the frozen layer (whatever the
        outcome: its capture's upload reports a failure)."""
        flattening = vm.flattening
        if flattening is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(flattening)
            if vm.flattening is flattening:
                vm.flattening = None

    async def _compact(self, vm: QemuVm) -> None:
        """Merge a frozen disk layer into the VM's top one (call with `vm.lock` held)."""
        await self._flattened(vm)
        if vm.disks.frozen is None or vm.machine.exited:
            return
        try:
            await vm.disks.compact(vm.machine)
        except SandlotError as e:
            log.warning("disk chain of %s not compacted: %s", vm.id, e)

    async def _compact_locked(self, vm: QemuVm) -> None:
        """After a capture: merge its frozen layer, and make the next capture's overlay."""
        async with vm.lock:
            await self._compact(vm)
            if vm.disks.frozen is None and not vm.machine.exited:
                try:
                    await vm.disks.prepare_next()
                except (SandlotError, OSError) as e:
                    log.warning("next overlay of %s not made ahead: %s", vm.id, e)

    async def persist(self, captured: Captured, meta: dict) -> Stored:
        key = captured.image.key
        held = self._captures[key]
        files: dict = self.cache.paths(key)
        if held.pending is not None:  # the RAM from the capture's buffer: no file yet
            files = self.cache.paths(key, dimm="dimm" in held.pending.files)
            files |= held.pending.files
        # The disk is hashed once flattened (after the RAM, so its flattening overlaps).
        ready = {"disk": held.flatten} if held.flatten is not None else {}
        # What the VM's last snapshot hashed: most of what it changed since its restore is
        # unchanged since then.
        vm = held.vm
        memo = None
        if vm is not None and DigestMemo.available():
            memo = DigestMemo(self._memos.get(vm.id))
        stored = await self.store.put(captured.image, files, held.changed, meta, held.related,
                                      memo, ready, since=held.since)
        if memo is not None and vm is not None and not vm.machine.exited:
            self._memos[vm.id] = memo.seen
        held.stored = True
        return stored

    async def stored_meta(self, key: str) -> dict:
        return dict((await self.store.manifest(key)).meta)

    def release(self, key: str) -> None:
        held = self._captures.pop(key, None)
        if held is None:
            return
        if held.pending is not None and held.stored:
            self._write_ram(key, held)  # holds the lease until the files are written
            return
        if held.pending is not None:  # never stored: nothing will restore from it here
            held.pending.close()
        if held.filled is not None:
            held.filled()
        held.lease.release()

    def _write_ram(self, key: str, held: _Capture) -> None:
        """Write a stored capture's RAM files in a thread, then make its cache entry ready
        (restores from it wait until then); on failure the entry goes (a restore fetches
        it from the store)."""
        assert held.pending is not None and held.filled is not None
        pending, filled = held.pending, held.filled
        started = time.monotonic()

        def done(future: asyncio.Future) -> None:
            try:
                error = future.exception() if not future.cancelled() else "cancelled"
                if error is None:
                    self.cache.mark_ready(key)
                    log.info("wrote the RAM files of %s in %.1f ms", key,
                             (time.monotonic() - started) * 1000)
                else:
                    raise VmmError(str(error))
            except Exception as e:  # noqa: BLE001 - the store has the image: fetched if wanted
                log.warning("writing the RAM files of %s failed (%s): a restore fetches them "
                            "from the store", key, e)
                self.cache.remove(key)
            finally:
                filled()
                held.lease.release()
                pending.close()

        future = asyncio.get_running_loop().run_in_executor(None, pending.write)
        future.add_done_callback(done)

    async def discard(self, key: str) -> None:
        await self.store.delete(key)
        self.cache.discard(key)

    # ---- running VMs ----------------------------------------------------------------------

    async def kill(self, vm: Vm) -> None:
        assert isinstance(vm, QemuVm)
        self._memos.pop(vm.id, None)
        self.reserve.disks.release(vm.id)
        if vm.growing is not None:
            vm.growing.cancel()
        await self._flattened(vm)  # it reads the frozen layer, which goes with the VM
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

    def park_ports(self, vm: Vm, waker: Callable[[], Awaitable[None]]
                   ) -> dict[int, tuple[str, int]]:
        return self.network.manager.park(vm.id, waker) if self.network else {}

    def drop_parked_ports(self, vm_id: str) -> None:
        if self.network is not None:
            self.network.manager.unpark(vm_id)

    # ---- recovery and shutdown ------------------------------------------------------------

    async def recover(self, expected: dict[str, NetworkPolicy | None],
                      keep_images: set[str]) -> dict[str, Vm]:
        adopted: dict[str, QemuVm] = {}
        for vm_id in expected:
            vm = await self._adopt(vm_id)
            if vm is not None:
                adopted[vm_id] = vm
        if self.network is not None:
            lost = await self.network.recover(
                {i: expected[i] or NetworkPolicy() for i in adopted})
            for vm in adopted.values():
                vm.network = self.network.manager.get(vm.id)
            for vm_id in lost:
                log.warning("VM %s: its network could not be recovered; stopping it", vm_id)
                await self.kill(adopted.pop(vm_id))
        keep_pids = {vm.pid for vm in adopted.values()}
        for pid in qemus_under(self.settings.run_root):
            if pid not in keep_pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for root in (self.settings.run_root, self.settings.disks_dir):
            for d in root.iterdir() if root.exists() else ():
                if d.name not in adopted:
                    shutil.rmtree(d, ignore_errors=True)
        await asyncio.to_thread(self.jails.recover, set(adopted))
        self.cache.prune(keep_images | {vm.image.key for vm in adopted.values()})
        return dict(adopted)

    async def _adopt(self, vm_id: str) -> QemuVm | None:
        run_dir = self.settings.run_root / vm_id
        try:
            pid = int((run_dir / "qemu.pid").read_text().split()[0])
            state = load_state(run_dir)
            spec = MachineSpec.from_json((run_dir / "machine.json").read_text())
        except (OSError, ValueError, KeyError, IndexError, SandlotError):
            return None
        if not qemu_alive(pid, run_dir):
            return None
        try:
            machine = await Machine.adopt(spec, pid)
            agent = await AgentClient.connect(str(spec.agent_socket), timeout=10)
            await agent.sync_clock()
            d = state["disks"]
            disks = await DiskChain.adopt(Path(d["dir"]), Path(d["source"]), int(d["size"]),
                                          machine, spec.jail.uid if spec.jail else None)
        except (SandlotError, OSError, ValueError) as e:
            log.warning("cannot re-adopt %s: %s", vm_id, e)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return None
        image: Image = state["image"]
        vm = QemuVm(id=vm_id, image=image, cpus=int(state["cpus"]),
                    memory_mb=int(state["memory_mb"]), machine=machine, agent=agent,
                    disks=disks, run_dir=run_dir, lease=self.cache.adopt(image.key),
                    last_capture=state.get("last_capture"),
                    booted=bool(state.get("booted", False)))
        vm.save()
        self.reserve.disks.hold(vm_id, disks.size, disks.held)
        for leftover in run_dir.glob("devstate-*"):  # saved by a capture the crash cut short
            leftover.unlink(missing_ok=True)
        if disks.frozen is not None:  # a capture's merge never ran
            self._spawn(self._compact_locked(vm))
        return vm

    async def collect_garbage(self, grace: float) -> dict:
        from sandlot.storage.gc import collect_garbage

        return vars(await collect_garbage(self.store.store, grace))

    def keep_warm(self, images: dict[str, Image]) -> None:
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

    async def start(self) -> None:
        if self.pool is not None:
            self.pool.start()

    async def close(self, vms: list[Vm], kill: bool) -> None:
        if self.pool is not None:
            await self.pool.close()  # pooled VMs are in no record: they cannot be re-adopted
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for vm in vms:
            assert isinstance(vm, QemuVm)
            if kill:
                await self.kill(vm)
            else:
                await vm.disconnect()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _sync_guest(vm: QemuVm, timeout: float) -> None:
    """Flush the guest's filesystems to its disk (`sync` in the guest, within `timeout` s)."""
    agent = await vm.guest()
    synced = await asyncio.wait_for(agent.run("sync", timeout=timeout, track=False),
                                    timeout + 5)
    if synced.exit_code:
        raise GuestError(f"sandbox {vm.id}: `sync` failed in the guest (exit "
                         f"{synced.exit_code})")


async def warm_up(agent: AgentClient) -> None:
    """Before a template's snapshot: drop the guest's caches (the kernel runs with
    init_on_free=1, so freed memory is zero and stays out of the snapshot), then exercise the
    agent: its worker threads, the modules it imports lazily and the files a first command
    reads are then already there in every restore."""
    if (await agent.run("sync; echo 3 > /proc/sys/vm/drop_caches")).exit_code:
        raise VmmError("template warm-up: dropping caches failed")
    await asyncio.gather(*(agent.run("true") for _ in range(4)))
    try:
        await agent.run("id >/dev/null; ls / >/dev/null", user="user")
    except InvalidArgumentError:  # an image's template: it may have no `user` account
        await agent.run("id >/dev/null; ls / >/dev/null")

    async def one_chunk():
        yield b"warm"

    await agent.write("/tmp/.warm", one_chunk())
    _, chunks = await agent.read("/tmp/.warm")
    async for _ in chunks:
        pass
    await agent.stat("/tmp/.warm")
    await agent.exists("/tmp/.warm")
    await agent.remove("/tmp/.warm")
    await agent.list_dir("/tmp")
    await agent.configure(Configure(freeze=True, reseed=False))
