"""Live snapshot and restore of a running machine.

Capture (the guest keeps running; its pause is only migration's final switchover):

1. A *holder* QEMU starts with the same device model, ``-incoming``, and its RAM in a new
   ``share=on`` file: the snapshot's RAM file.
2. The source live-migrates its RAM to the holder (precopy, guest running). With
   ``pause-before-switchover`` the source stops in ``pre-switchover``; there it moves its disk
   to a new overlay (``blockdev-snapshot-sync``), freezing the old overlay as the snapshot's disk
   at exactly the RAM's instant. Then the switchover finishes and the source continues (``cont``).
3. The holder, never run, saves its device state with ``x-ignore-shared`` (RAM skipped: it is
   in the file) and exits.

The holder's migration allocates tmpfs pages for zero pages too: `punch_zero_pages` gives them
back. It changes no byte of the file, so it is safe to run while restores map it.

Restore: a new QEMU maps the snapshot RAM file ``share=off`` (MAP_PRIVATE: copy-on-write over
the shared page cache), gets its own qcow2 overlay on the snapshot disk, and loads the device
state with ``x-ignore-shared``. The RAM file must never change while restores of it live.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import VmmError
from sandlot.vmm.disk import create_overlay
from sandlot.vmm.machine import NO_NETWORK, Machine, MachineSpec

MIGRATE_PARAMS = {
    "max-bandwidth": 64 << 30,  # unthrottled: the stream is a local unix socket
    "downtime-limit": 20,  # ms; the switchover is when the guest is paused
    # No multifd: ~15% faster here, but QEMU 7.2's multifd has had page-loss fixes since, and a
    # snapshot that silently misses pages is far worse than a slower one.
}


@dataclass
class CaptureResult:
    ram: Path
    dimm: Path | None
    devstate: Path
    disk: Path  # the frozen overlay (its backing chain holds the rest)
    pause_ms: float  # source stopped -> running again, as the host saw it
    total_ms: float


async def capture(source: Machine, out_dir: Path, new_overlay: Path, holder_dir: Path,
                  node_name: str) -> CaptureResult:
    """Snapshot `source` into `out_dir` (ram, devstate); its disk moves to `new_overlay`.

    Returns the frozen disk path (the source's previous overlay). On failure the source is left
    running on its previous disk; nothing is written under `out_dir` but partial files the
    caller discards.
    """
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    frozen_disk = source.spec.disk
    ram = out_dir / "ram"
    devstate = out_dir / "devstate"
    holder_dir.mkdir(parents=True, exist_ok=True)
    holder_disk = holder_dir / "disk.qcow2"
    size = os.path.getsize(frozen_disk)  # placeholder size; the holder never runs
    await create_overlay(holder_disk, frozen_disk, "qcow2", max(size, 1 << 20))
    holder_spec = source.spec.with_(
        run_dir=holder_dir, disk=holder_disk, ram_path=ram, ram_share=True, incoming=True,
        netdev=NO_NETWORK, exec_prefix=(),
        dimm_path=out_dir / "ram.dimm" if source.spec.dimm_mb else None,
    )
    holder = await Machine.launch(holder_spec)
    paused_at = resumed_at = 0.0
    try:
        sock = holder_dir / "mig.sock"
        await holder.execute("migrate-set-parameters", MIGRATE_PARAMS)
        await holder.execute("migrate-incoming", {"uri": f"unix:{sock}"})
        await source.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "pause-before-switchover", "state": True},
            {"capability": "x-ignore-shared", "state": False},
        ]})
        await source.execute("migrate-set-parameters", MIGRATE_PARAMS)
        await source.execute("migrate", {"uri": f"unix:{sock}"})
        try:
            await source.wait_migration(("pre-switchover",), timeout=300)
            paused_at = time.monotonic()
            await source.execute("blockdev-snapshot-sync", {
                "node-name": source.top_node, "snapshot-file": str(new_overlay),
                "snapshot-node-name": node_name, "format": "qcow2",
            })
            source.top_node = node_name
            source.spec = source.spec.with_(disk=new_overlay)
            source.spec.save()
            await source.execute("migrate-continue", {"state": "pre-switchover"})
            await source.wait_migration(("completed",), timeout=60)
        except BaseException:
            with contextlib.suppress(VmmError):
                await source.execute("migrate_cancel")
            raise
        finally:
            if await source.status() != "running":
                await source.execute("cont")
            resumed_at = time.monotonic()
            with contextlib.suppress(VmmError):
                await source.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "pause-before-switchover", "state": False}]})
        await holder.wait_incoming(timeout=60)
        await holder.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})
        await holder.execute("migrate", {"uri": f"exec:cat > {devstate}"})
        await holder.wait_migration(("completed",), timeout=60)
    except VmmError as e:
        raise VmmError(f"{e.message} (holder: {holder.log_tail(600) or 'no output'})") from e
    finally:
        await holder.kill()
        shutil.rmtree(holder_dir, ignore_errors=True)
    return CaptureResult(ram=ram, dimm=holder_spec.dimm_path, devstate=devstate,
                         disk=frozen_disk,
                         pause_ms=(resumed_at - paused_at) * 1000,
                         total_ms=(time.monotonic() - t0) * 1000)


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
