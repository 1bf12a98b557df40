"""Capturing running VMs: snapshots, forks and template builds' boot images, and the RAM files
a capture writes.

vmm/snapshot.capture with the VM's disk chain; the frozen disk layer becomes the image's
two-layer disk; the chain is compacted afterwards. A persistent capture's RAM files are written
once it is stored (`release`); until then its cache entry is not ready and restores wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np

from sandlot.errors import GuestError, InvalidArgumentError, SandlotError, VmmError
from sandlot.guest.client import AgentClient, Configure
from sandlot.runtime.base import Captured, Image, MachinePlan, Vm
from sandlot.runtime.bringup import BringUp
from sandlot.runtime.cache import Lease
from sandlot.runtime.host import Part, QemuHost, describe
from sandlot.runtime.images import IMAGE_FILES
from sandlot.runtime.qemu_vm import QemuVm
from sandlot.runtime.unwritten import UnwrittenRam
from sandlot.vmm import memory
from sandlot.vmm import snapshot as vmm_snapshot
from sandlot.vmm.memory import PAGE

log = logging.getLogger(__name__)

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
    # a pause's: its resume maps the written file, so the memory the guest freed (zero
    # pages: holes in the file) goes back to the host (no restore from `UnwrittenRam`)
    pause: bool = False


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



class Capturer(Part):
    """Captures VMs into images, holds the captures' files until released, and writes their
    RAM files."""

    def __init__(self, host: QemuHost, bringup: BringUp,
                 kill: Callable[[Vm], Awaitable[None]]) -> None:
        super().__init__(host)
        self._bringup = bringup
        self._kill = kill
        self._captures: dict[str, _Capture] = {}
        self._unwritten: dict[str, UnwrittenRam] = {}  # stored, RAM files being written

    def held(self, key: str) -> _Capture:
        """What a capture not yet released holds (KeyError if none)."""
        return self._captures[key]

    def unwritten(self, key: str) -> UnwrittenRam | None:
        """A stored capture whose RAM files are being written: a restore from it need not
        wait for them (runtime/unwritten.py); `take` it at once."""
        return self._unwritten.get(key)

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
            await self.flattened(vm)
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
                                                      for name, pages in since[1].items()}),
                                       pause=sync)
        vm.last_capture = key if persistent else vm.last_capture
        self._spawn(self.compact_locked(vm))
        machine = describe(vm.machine.spec, vm.cpus, self.cpu)
        image = Image(key=key, build=vm.image.build, persistent=persistent,
                      machine=machine if memory else replace(machine, memory=False))
        return Captured(image=image, pause_ms=pause_ms,
                        total_ms=(time.monotonic() - t0) * 1000)

    @staticmethod
    async def flattened(vm: QemuVm) -> None:
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
        await self.flattened(vm)
        if vm.disks.frozen is None or vm.machine.exited:
            return
        try:
            await vm.disks.compact(vm.machine)
        except SandlotError as e:
            log.warning("disk chain of %s not compacted: %s", vm.id, e)

    async def compact_locked(self, vm: QemuVm) -> None:
        """After a capture: merge its frozen layer, and make the next capture's overlay."""
        async with vm.lock:
            await self._compact(vm)
            if vm.disks.frozen is None and not vm.machine.exited:
                try:
                    await vm.disks.prepare_next()
                except (SandlotError, OSError) as e:
                    log.warning("next overlay of %s not made ahead: %s", vm.id, e)

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
        unwritten = None if held.pause else UnwrittenRam.link(self.cache.dir(key), {
            name: patched.delta for name, patched in pending.files.items()})
        if unwritten is not None:
            self.cache.share(key)  # a restore from it maps its links
            self._unwritten[key] = unwritten

        def done(future: asyncio.Future) -> None:
            self._unwritten.pop(key, None)
            try:
                error = future.exception() if not future.cancelled() else "cancelled"
                if error is None:
                    self.cache.mark_ready(key)
                    log.info("wrote the RAM files of %s in %.1f ms%s", key,
                             (time.monotonic() - started) * 1000,
                             " (restores started meanwhile)" if unwritten is not None
                             and unwritten.used else "")
                else:
                    raise VmmError(str(error))
            except Exception as e:  # noqa: BLE001 - the store has the image: fetched if wanted
                log.warning("writing the RAM files of %s failed (%s): a restore fetches them "
                            "from the store", key, e)
                if unwritten is not None and unwritten.used:  # VMs map its links
                    self.cache.forget(key)
                else:
                    self.cache.remove(key)
            finally:
                filled()
                held.lease.release()
                if unwritten is not None:
                    unwritten.retire(pending.close)
                else:
                    pending.close()

        future = asyncio.get_running_loop().run_in_executor(None, pending.write)
        future.add_done_callback(done)

    async def boot_image(self, build: str, plan: MachinePlan) -> tuple[Image, float]:
        """Cold-boot, settle, capture; the boot image stays with the build (builds/<hash>/
        image) until `publish_template` stores it."""
        local = self.store.local_image(build)
        work = local.with_name("work")
        for d in (work, local):
            shutil.rmtree(d, ignore_errors=True)
        work.mkdir(parents=True)
        t0 = time.monotonic()
        vm = await self._bringup.cold_boot(build, replace(plan, generation="template"),
                                  f"tb-{build[:8]}")
        boot_ms = (time.monotonic() - t0) * 1000
        try:
            await warm_up(vm.agent)
            await asyncio.sleep(0.5)  # let boot-time work settle: an idle guest
            await vmm_snapshot.capture(vm.machine, vm.disks, work)
            await vm.disks.flatten_frozen(work / IMAGE_FILES["disk"])
        finally:
            await self._kill(vm)
        work.replace(local)
        return Image(key=f"tpl-{build}", build=build, machine=vm.image.machine), boot_ms



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
