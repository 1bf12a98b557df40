"""E2B's sandbox lifecycle on top of sandlot's core.

A paused E2B sandbox is a stopped sandlot sandbox plus a sandlot snapshot named
``e2b-paused.<sandbox id>``: pause = snapshot (the sandbox keeps running while its state is
captured, a pause of milliseconds), kill, and wait until the snapshot is stored; resume =
restore that snapshot under the same sandbox id (`core.sandboxes.restore_as`), then drop the
snapshot. Both live in sandlot's metadata store, so a paused sandbox survives a restart.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import timedelta

from sandlot.core.models import (
    CreateSandbox,
    SandboxRecord,
    SnapshotRecord,
    SnapshotState,
    now,
)
from sandlot.core.service import Core
from sandlot.errors import ConflictError, InvalidStateError, NotFoundError, StorageError

PAUSE_PREFIX = "e2b-paused."
CAPTURE_WAIT = 120.0
READY_WAIT = 600.0


def pause_name(sandbox_id: str) -> str:
    return PAUSE_PREFIX + sandbox_id


def is_pause_snapshot(rec: SnapshotRecord) -> bool:
    return bool(rec.name and rec.name.startswith(PAUSE_PREFIX))


class Lifecycle:
    """E2B's create, connect, pause, resume and kill over one `Core`."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def lock(self, sandbox_id: str) -> asyncio.Lock:
        """Serializes pause, resume and kill of one sandbox id."""
        return self._locks[sandbox_id]

    def pause_snapshot(self, sandbox_id: str) -> SnapshotRecord | None:
        try:
            rec = self.core.snapshots.get(pause_name(sandbox_id))
        except NotFoundError:
            return None
        return None if rec.state == SnapshotState.FAILED else rec

    def state_of(self, sandbox_id: str) -> tuple[SandboxRecord, str]:
        """The sandbox and its E2B state, 'running' or 'paused'; NotFoundError otherwise."""
        live = self.core.sandboxes.live.get(sandbox_id)
        if live is not None:
            return live.record, "running"
        rec = self.core.sandboxes.get(sandbox_id)
        if self.pause_snapshot(sandbox_id) is not None:
            return rec, "paused"
        raise NotFoundError(f"sandbox {sandbox_id} not found")

    def paused(self) -> list[SandboxRecord]:
        out = []
        for snap in self.core.snapshots.list():
            if is_pause_snapshot(snap) and snap.state != SnapshotState.FAILED and snap.sandbox_id:
                try:
                    rec = self.core.sandboxes.get(snap.sandbox_id)
                except NotFoundError:
                    continue
                if rec.sandbox_id not in self.core.sandboxes.live:
                    out.append(rec)
        return out

    async def wait_captured(self, snapshot_id: str) -> SnapshotRecord:
        """Wait until the snapshot holds the sandbox's state (capture done; upload may go on)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CAPTURE_WAIT
        while True:
            rec = self.core.snapshots.get(snapshot_id, include_deleted=True)
            if rec.state != SnapshotState.CREATING or loop.time() > deadline:
                break
            await asyncio.sleep(0.01)
        if rec.state == SnapshotState.FAILED:
            raise StorageError(f"snapshot {snapshot_id} failed: {rec.error}")
        if rec.state == SnapshotState.CREATING:
            raise StorageError(f"snapshot {snapshot_id} is still being captured")
        return rec

    async def wait_ready(self, id_or_name: str) -> SnapshotRecord:
        rec = await self.core.snapshots.wait_ready(id_or_name, timeout=READY_WAIT)
        if rec.state == SnapshotState.FAILED:
            raise StorageError(f"snapshot {rec.snapshot_id} failed: {rec.error}")
        if rec.state == SnapshotState.DELETED:
            raise NotFoundError(f"snapshot {id_or_name} was deleted")
        if rec.state != SnapshotState.READY:
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is still {rec.state.value}",
                                    current=rec.state.value, allowed=("ready",))
        return rec

    async def pause(self, sandbox_id: str) -> None:
        async with self.lock(sandbox_id):
            if sandbox_id not in self.core.sandboxes.live:
                self.state_of(sandbox_id)  # NotFoundError unless it is paused
                raise ConflictError(f"sandbox {sandbox_id} is already paused")
            snap = self.core.sandboxes.snapshot(sandbox_id, pause_name(sandbox_id))
            await self.wait_captured(snap.snapshot_id)
            await self.core.sandboxes.kill(sandbox_id)
            # Answer once the snapshot is stored: a paused sandbox outlives a server restart.
            await self.wait_ready(snap.snapshot_id)

    async def resume(self, sandbox_id: str, timeout: int | None) -> SandboxRecord:
        """Restore a paused sandbox under its id. NotFoundError if it is not paused."""
        snap = self.pause_snapshot(sandbox_id)
        if snap is None or sandbox_id in self.core.sandboxes.live:
            raise NotFoundError(f"paused sandbox {sandbox_id} not found")
        snap = await self.wait_ready(snap.snapshot_id)
        rec = await self.core.sandboxes.restore_as(sandbox_id, snap.snapshot_id, timeout)
        self.core.snapshots.delete(snap.snapshot_id)
        return rec

    async def connect(self, sandbox_id: str, timeout: int | None) -> tuple[SandboxRecord, bool]:
        """E2B connect: a running sandbox (its timeout only ever extended), or a paused one
        resumed. Returns (record, resumed)."""
        async with self.lock(sandbox_id):
            live = self.core.sandboxes.live.get(sandbox_id)
            if live is not None:
                rec = live.record
                if timeout and rec.expires_at is not None and (
                        now() + timedelta(seconds=timeout) > rec.expires_at):
                    rec = self.core.sandboxes.set_timeout(sandbox_id, timeout)
                return rec, False
            return await self.resume(sandbox_id, timeout), True

    async def kill(self, sandbox_id: str) -> None:
        async with self.lock(sandbox_id):
            if sandbox_id in self.core.sandboxes.live:
                await self.core.sandboxes.kill(sandbox_id)
                return
            snap = self.pause_snapshot(sandbox_id)
            if snap is None:
                raise NotFoundError(f"sandbox {sandbox_id} not found")
            await self.core.snapshots.wait_ready(snap.snapshot_id, timeout=READY_WAIT)
            self.core.snapshots.delete(snap.snapshot_id)

    async def source(self, template_id: str) -> CreateSandbox:
        """What an E2B template id names here: a sandlot template, or a snapshot (by id or name;
        E2B creates sandboxes from snapshots by passing the snapshot id as the template)."""
        if not template_id.startswith("snap-"):
            try:
                self.core.templates.get(template_id)
                return CreateSandbox(template=template_id)
            except NotFoundError:
                pass
        try:
            snap = self.core.snapshots.get(template_id)
        except NotFoundError:
            names = ", ".join(t.name for t in self.core.templates.list()) or "none"
            raise NotFoundError(f"template or snapshot {template_id!r} not found; this sandlot "
                                f"server has the templates: {names}") from None
        snap = await self.wait_ready(snap.snapshot_id)
        return CreateSandbox(snapshot_id=snap.snapshot_id)

    def disk_mb(self, rec: SandboxRecord) -> int:
        try:
            size = (self.core.templates.builds / rec.base / "rootfs.ext4").stat().st_size
        except OSError:
            return 0
        return size >> 20
