"""Snapshot and restore of a running machine.

Capture (`capture`): the pages the VM changed relative to its RAM file are found in
/proc/PID/pagemap (vmm/memory.py); before the pause the machine's next disk overlay is created
and opened, and the RAM copy prepared (vmm/ram_copy.py): with write tracking the changed
pages are copied now, while the VM runs, else a buffer is mapped for them. Then, with the
machine stopped:

1. the pages written since that copy (or, without tracking, all the changed pages) are copied
   out of the QEMU process into the buffer;
2. the next overlay goes on top of the disk (`blockdev-snapshot`): the old top is frozen at
   the instant of the RAM;
3. QEMU writes the state of every device but RAM (`xen-save-devices-state`, ~0.2 MB);
4. the machine runs again.

With tracking the pause is a page-table walk plus what the guest wrote during the copy; without,
what changed since the VM's restore. After it, the image's RAM file is written: its source's
with the copied pages over it; or, with `defer_ram`, not yet: the result's `pending` serves the
new RAM's bytes from the capture's buffer and the source's file (what a snapshot's upload
hashes and stores) and writes the file when asked (after the upload: only a restore on this
host needs it).

Why not QEMU's migration: under QEMU 7.2 TCG a live precopy lost pages a busy guest wrote
(tests/vm/test_snapshot_busy.py), a background snapshot write-protects every page of RAM (its
pause grows with RAM), and both copy all of it. Here the kernel's page tables say exactly what
changed and what was written during the copy.

Restore (`restore`): a new QEMU maps the image's RAM file ``share=off`` (copy-on-write over the
shared page cache: an idle restored VM costs a few MiB of its own) and loads the device state
through ``migrate-incoming`` (the destination runs with ``migration.send-configuration=off``,
since the device state stream carries no configuration section). The RAM file must never
change while restores of it live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sandlot.errors import SandlotError, VmmError
from sandlot.vmm import memory
from sandlot.vmm.disk import DiskChain
from sandlot.vmm.machine import Machine, MachineSpec
from sandlot.vmm.ram_copy import StoppedCopy, ram_copy

log = logging.getLogger(__name__)


class PendingRam:
    """A capture's RAM files before they are written: the pages it copied (its buffer) over
    the source's files, readable as they will be (`files`: file name -> memory.Patched), and
    written by `write`. Owns the buffer until `close`."""

    def __init__(self, deltas: list[memory.Delta], buffer: memory.PageBuffer,
                 out: dict[str, Path]) -> None:
        self.paths = dict(out)  # "ram" / "dimm" -> where `write` puts it
        self._buffer = buffer
        self.files: dict[str, memory.Patched] = {}
        try:
            for delta in deltas:
                self.files[delta.region.name] = memory.Patched(delta)
        except BaseException:
            for patched in self.files.values():
                patched.close()
            self._buffer = None  # the caller still owns it
            raise

    def write(self) -> None:
        """Write the RAM files (blocking; run it in a thread)."""
        for name, patched in self.files.items():
            patched.write(self.paths[name])

    def close(self) -> None:
        for patched in self.files.values():
            patched.close()
        self.files = {}
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


@dataclass
class CaptureResult:
    ram: Path
    dimm: Path | None
    devstate: Path
    pause_ms: float  # stopped -> running again, as the host saw it
    total_ms: float
    changed: dict[str, np.ndarray] = field(default_factory=dict)  # region -> page indices
    phases_ms: dict[str, float] = field(default_factory=dict)
    pending: PendingRam | None = None  # with `defer_ram`: the RAM files, not yet written
    pages_in_pause: int = 0  # pages copied with the VM stopped
    # Per region, pages written since the machine's previous capture (None: not tracked).
    written: dict[str, np.ndarray] | None = None


def _regions(machine: Machine) -> list[memory.Region]:
    spec = machine.spec
    ram = (spec.ram_path, spec.base_mb << 20)
    dimm = (spec.dimm_path, spec.dimm_mb << 20) if spec.dimm_mb else None
    return memory.regions(machine.pid, ram, dimm)


async def capture(machine: Machine, disks: DiskChain, out_dir: Path, *,
                  defer_ram: bool = False,
                  quiet: Callable[[], AbstractAsyncContextManager] | None = None
                  ) -> CaptureResult:
    """Snapshot `machine` into `out_dir` (ram, ram.dimm, devstate); its disk chain freezes its
    top layer (`disks.frozen`) at the RAM's instant and goes on on a new one. On failure the
    machine runs again (on the new overlay if it got that far). `defer_ram`: the RAM files
    are not written; the result's `pending` has them (the caller closes it). `quiet`: held
    from just before the stop until the VM runs again (the agent's writes wait: QEMU would
    put them in guest RAM while it is stopped)."""
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    devstate = out_dir / "devstate"
    # QEMU writes it where it may (its run dir: a confined QEMU cannot write the cache).
    written = machine.spec.run_dir / f"devstate-{out_dir.name}"
    phases: dict[str, float] = {}
    regions = _regions(machine)
    pending: PendingRam | None = None
    copier = await _prepared_copy(machine, regions, disks, phases)
    phases["prepare"] = (time.monotonic() - t0) * 1000
    stacked = False
    deltas: list[memory.Delta] = []
    held = contextlib.AsyncExitStack()
    try:
        if quiet is not None:
            await held.enter_async_context(quiet())
        paused_at = time.monotonic()
        await machine.stop()
        phases["stop"] = (time.monotonic() - paused_at) * 1000
        try:
            # With the VM stopped, three things at once: the disk's next overlay is stacked
            # and the device state saved (QMP, one after the other), while the changed pages
            # are copied out in threads.
            async def disk() -> None:
                nonlocal stacked
                t = time.monotonic()
                await disks.stack_next(machine)
                stacked = True
                phases["disk"] = (time.monotonic() - t) * 1000
                t = time.monotonic()
                await machine.execute("xen-save-devices-state",
                                      {"filename": str(written), "live": False})
                phases["devices"] = (time.monotonic() - t) * 1000

            async def ram() -> None:
                t = time.monotonic()
                await asyncio.to_thread(copier.in_pause)
                phases["copy"] = (time.monotonic() - t) * 1000
                if copier.tracking_failed:
                    machine.drop_write_tracker()

            if copier.quick:  # a few pages: copied first, alone (nothing contends with it)
                await ram()
                results = await asyncio.gather(disk(), return_exceptions=True)
            else:
                results = await asyncio.gather(disk(), ram(), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        finally:
            t = time.monotonic()
            try:
                await machine.cont()
            except SandlotError:
                with contextlib.suppress(SandlotError):
                    await machine.ensure_running()
            resumed_at = time.monotonic()
            phases["cont"] = (resumed_at - t) * 1000
            await held.aclose()
        t = time.monotonic()
        deltas = await asyncio.to_thread(copier.finish)
        phases["merge"] = (time.monotonic() - t) * 1000
        t = time.monotonic()
        await asyncio.to_thread(shutil.move, written, devstate)
        out = {}
        for delta in deltas:
            out[delta.region.name] = out_dir / ("ram" if delta.region.name == "ram"
                                                else "ram.dimm")
        if defer_ram:
            pending = PendingRam(deltas, copier.buffer, out)
            copier.buffer, copier.deltas = None, []  # the pending files own them now
        else:
            for delta in deltas:
                await asyncio.to_thread(memory.write_image, delta, out[delta.region.name])
        phases["write"] = (time.monotonic() - t) * 1000
    except BaseException:
        await held.aclose()
        written.unlink(missing_ok=True)
        if not stacked:  # the machine stays on its disk: drop the overlay it did not take
            await disks.drop_next(machine)
        raise
    finally:
        changed = {d.region.name: d.pages for d in deltas}
        written_pages = copier.written()
        copier.close()
    return CaptureResult(ram=out["ram"], dimm=out.get("dimm"), devstate=devstate,
                         pause_ms=(resumed_at - paused_at) * 1000,
                         total_ms=(time.monotonic() - t0) * 1000,
                         changed=changed, phases_ms=phases, pending=pending,
                         pages_in_pause=copier.pages_in_pause, written=written_pages)


async def _prepared_copy(machine: Machine, regions: list[memory.Region], disks: DiskChain,
                         phases: dict[str, float]) -> StoppedCopy:
    """The RAM copy, prepared (a thread), while QEMU opens the disk's next overlay. With
    write tracking the copy runs now; if tracking fails, the machine goes on without it."""
    def prepare() -> StoppedCopy:
        t = time.monotonic()
        tracker = machine.write_tracker()  # its first lookup reads QEMU's fd table: a thread
        copier = ram_copy(machine.pid, regions, tracker)
        try:
            copier.prepare()
        except VmmError as e:
            copier.close()
            if tracker is None:
                raise
            log.warning("QEMU %d: capture without write tracking: %s", machine.pid, e)
            machine.drop_write_tracker()
            copier = ram_copy(machine.pid, regions, None)
            copier.prepare()
        except BaseException:
            copier.close()
            raise
        phases["precopy"] = (time.monotonic() - t) * 1000
        return copier

    async def overlay() -> None:
        t = time.monotonic()
        await disks.open_next(machine)
        phases["overlay"] = (time.monotonic() - t) * 1000

    made = await asyncio.gather(asyncio.to_thread(prepare), overlay(), return_exceptions=True)
    if isinstance(made[1], BaseException):
        if not isinstance(made[0], BaseException):
            made[0].close()
        raise made[1]
    if isinstance(made[0], BaseException):
        await disks.drop_next(machine)
        raise made[0]
    return made[0]


async def freeze_disk(machine: Machine, disks: DiskChain) -> float:
    """A filesystem-only capture: the disk's next overlay is stacked while the VM runs
    (QEMU drains the disk's requests for it), so its old top (`disks.frozen`) holds the disk as
    it was at this instant, crash-consistent (the caller syncs the guest first). No memory is
    read and the VM is not stopped. Returns the time the stacking took, ms."""
    await disks.open_next(machine)
    t = time.monotonic()
    try:
        await disks.stack_next(machine)
    except BaseException:
        await disks.drop_next(machine)
        raise
    return (time.monotonic() - t) * 1000


async def restore(spec: MachineSpec, devstate: Path, timeout: float = 60.0) -> Machine:
    """Start a machine from an image's RAM file (`spec.ram_path`) and device state.

    The machine is left paused: the caller finishes its setup and sends ``cont``.
    """
    machine = await launch_incoming(spec)
    await load_devices(machine, devstate, timeout)
    return machine


async def launch_incoming(spec: MachineSpec) -> Machine:
    """The first half of `restore`: QEMU started over the RAM file, its memory mapped, its
    devices not loaded yet (what is written into its memory now is there when they load)."""
    if spec.ram_path is None or spec.ram_share:
        raise VmmError("restore needs the image's RAM file mapped share=off")
    return await Machine.launch(spec.with_(incoming=True))


async def load_devices(machine: Machine, devstate: Path, timeout: float = 60.0) -> None:
    """The second half of `restore`: the device state loaded (their queues are checked against
    guest memory); the machine killed if it fails."""
    try:
        sock = machine.spec.run_dir / "incoming.sock"
        await machine.execute("migrate-incoming", {"uri": f"unix:{sock}"})
        await _send_file(sock, devstate)
        await machine.wait_incoming(timeout)
    except BaseException:
        await machine.kill()
        raise


async def _send_file(sock: Path, path: Path) -> None:
    """Stream a file into a unix socket QEMU listens on (QEMU opens and runs nothing)."""
    _, writer = await asyncio.open_unix_connection(str(sock))
    try:
        writer.write(await asyncio.to_thread(path.read_bytes))
        await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def punch_zero_pages(path: Path) -> None:
    """Give zero-filled pages of a RAM file back to tmpfs."""
    proc = await asyncio.create_subprocess_exec(
        "fallocate", "--dig-holes", str(path),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode:
        raise VmmError(f"fallocate --dig-holes failed: {err.decode().strip()}")
