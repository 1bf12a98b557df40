"""Snapshot and restore of a running machine.

Capture writes the machine's RAM into a *holder*: a never-run QEMU with the same device model,
``-incoming``, and its RAM in a new ``share=on`` file, the snapshot's RAM file. The source's
next disk overlay is created and opened (``blockdev-add``); then the source is stopped, the
overlay goes on top (``blockdev-snapshot``: the old one is frozen as the snapshot's disk at the
RAM's instant) and the source migrates to the holder in one of two ways:

- ``live=True`` (snapshots): QEMU's *background snapshot*. The device state is taken while the
  source is stopped, its RAM is write-protected (userfaultfd), and the source runs again while
  the RAM streams out; a page the guest writes meanwhile is copied out before the write goes
  through. The snapshot is the instant of the stop, and the pause is the stop, not the copy.
- ``live=False`` (forks, template builds): stop and copy. The pause is the whole copy (about
  0.3 s for 512 MiB here), but the capture is over sooner, which is what a fork waits for.

Not precopy: QEMU 7.2 under TCG loses pages the guest writes while a precopy migration runs (the
same dozen kernel pages, run after run; tests/vm/test_snapshot_busy.py), so its snapshots of a
busy guest did not boot. Neither way here depends on dirty-page tracking.

The holder, never run, saves its device state with ``x-ignore-shared`` (RAM skipped: it is in
the file) and exits. It allocates tmpfs pages for zero pages too: `punch_zero_pages` gives them
back. It changes no byte of the file, so it is safe to run while restores map it.

Restore: a new QEMU maps the snapshot RAM file ``share=off`` (MAP_PRIVATE: copy-on-write over
the shared page cache), gets its own qcow2 overlay on the snapshot disk, and loads the device
state with ``x-ignore-shared``. The RAM file must never change while restores of it live.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import VmmError
from sandlot.vmm.disk import DiskChain, create_overlay
from sandlot.vmm.machine import NO_NETWORK, Machine, MachineSpec

MIGRATE_PARAMS = {
    "max-bandwidth": 64 << 30,  # unthrottled: the stream is a local unix socket
}
POPULATE_CHUNK = 8 << 20


@dataclass
class CaptureResult:
    ram: Path
    dimm: Path | None
    devstate: Path
    pause_ms: float  # source stopped -> running again, as the host saw it
    total_ms: float


async def capture(source: Machine, disks: DiskChain, out_dir: Path, holder_dir: Path, *,
                  live: bool = True) -> CaptureResult:
    """Snapshot `source` into `out_dir` (ram, devstate); its disk chain freezes its top layer
    (`disks.frozen`) at the RAM's instant and goes on on a new one.

    `live`: background snapshot (the source pauses for milliseconds); else stop and copy. On
    failure the source runs again (on the new overlay if it got that far); nothing is written
    under `out_dir` but partial files the caller discards.
    """
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    ram = out_dir / "ram"
    devstate = out_dir / "devstate"
    holder_dir.mkdir(parents=True, exist_ok=True)
    holder_disk = holder_dir / "disk.qcow2"
    # The holder's disk, and the source's next overlay: made now, so the pause only stacks it.
    await asyncio.gather(create_overlay(holder_disk, disks.top, "qcow2", disks.size),
                         disks.open_next(source))
    holder_spec = source.spec.with_(
        run_dir=holder_dir, disk=holder_disk, ram_path=ram, ram_share=True, incoming=True,
        netdev=NO_NETWORK, exec_prefix=(),
        dimm_path=out_dir / "ram.dimm" if source.spec.dimm_mb else None,
    )
    try:
        holder = await Machine.launch(holder_spec)
    except BaseException:
        await disks.drop_next(source)
        shutil.rmtree(holder_dir, ignore_errors=True)
        raise
    paused_at = resumed_at = 0.0
    stacked = False
    try:
        sock = holder_dir / "mig.sock"
        await holder.execute("migrate-set-parameters", MIGRATE_PARAMS)
        await holder.execute("migrate-incoming", {"uri": f"unix:{sock}"})
        await source.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "pause-before-switchover", "state": False},
            {"capability": "x-ignore-shared", "state": False},
            {"capability": "background-snapshot", "state": live},
        ]})
        await source.execute("migrate-set-parameters", MIGRATE_PARAMS)
        if live:
            # Write-protecting RAM needs its pages mapped; QEMU maps the missing ones while
            # the source is stopped. Map them now, while it runs, so the pause stays short.
            await asyncio.to_thread(populate_ram, source)
        paused_at = time.monotonic()
        await source.stop()
        try:
            await disks.stack_next(source)
            stacked = True
            await source.execute("migrate", {"uri": f"unix:{sock}"})
            if live:  # QEMU runs the source again once its RAM is write-protected
                await source.wait_running(timeout=60)
                resumed_at = time.monotonic()
            await source.wait_migration(("completed",), timeout=300)
        except BaseException:
            with contextlib.suppress(VmmError):
                await source.execute("migrate_cancel")
            raise
        finally:
            with contextlib.suppress(VmmError):
                await source.ensure_running()
            resumed_at = resumed_at or time.monotonic()
            with contextlib.suppress(VmmError):
                await source.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "background-snapshot", "state": False}]})
        await holder.wait_incoming(timeout=60)
        await holder.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})
        await holder.execute("migrate", {"uri": f"exec:cat > {devstate}"})
        await holder.wait_migration(("completed",), timeout=60)
    except BaseException as e:
        if not stacked:  # the source stays on its disk: drop the overlay it did not take
            await disks.drop_next(source)
        if isinstance(e, VmmError):
            raise VmmError(f"{e.message} (holder: {holder.log_tail(600) or 'no output'})") from e
        raise
    finally:
        await holder.kill()
        shutil.rmtree(holder_dir, ignore_errors=True)
    return CaptureResult(ram=ram, dimm=holder_spec.dimm_path, devstate=devstate,
                         pause_ms=(resumed_at - paused_at) * 1000,
                         total_ms=(time.monotonic() - t0) * 1000)


def populate_ram(machine: Machine) -> None:
    """Map every page of the machine's RAM files in its QEMU process (by reading them through
    /proc/<pid>/mem); the guest sees nothing of it."""
    spec = machine.spec
    paths = {str(p) for p in (spec.ram_path, spec.dimm_path) if p is not None}
    # A DIMM without a file (hotplugged on restore) is the anonymous mapping of its size.
    anonymous_size = spec.dimm_mb << 20 if spec.dimm_mb and spec.dimm_path is None else None
    buf = bytearray(POPULATE_CHUNK)
    try:
        ranges = []
        with open(f"/proc/{machine.pid}/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if (fields[-1] in paths if len(fields) >= 6
                        else end - start == anonymous_size):
                    ranges.append((start, end))
        with open(f"/proc/{machine.pid}/mem", "rb", buffering=0) as mem:
            for start, end in ranges:
                for offset in range(start, end, POPULATE_CHUNK):
                    mem.seek(offset)
                    mem.readinto(memoryview(buf)[: min(POPULATE_CHUNK, end - offset)])
    except OSError:
        pass  # an optimisation only: QEMU maps what is missing itself


async def punch_zero_pages(path: Path) -> None:
    """Give zero-filled pages of a RAM file back to tmpfs (the migration may allocate them)."""
    proc = await asyncio.create_subprocess_exec(
        "fallocate", "--dig-holes", str(path),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    if proc.returncode:
        raise VmmError(f"fallocate --dig-holes failed: {err.decode().strip()}")


async def restore(spec: MachineSpec, devstate: Path, timeout: float = 60.0) -> Machine:
    """Start a machine from a snapshot's RAM file (`spec.ram_path`) and device state.

    The machine is left paused: the caller finishes its setup and sends ``cont``.
    """
    if spec.ram_path is None or spec.ram_share:
        raise VmmError("restore needs the snapshot RAM file mapped share=off")
    machine = await Machine.launch(spec.with_(incoming=True))
    try:
        await machine.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})
        await machine.execute("migrate-incoming", {"uri": f"exec:cat {devstate}"})
        await machine.wait_incoming(timeout)
    except BaseException:
        await machine.kill()
        raise
    return machine
