"""E2B's sandbox lifecycle on sandlot's core: E2B's running and paused are core's sandbox
states, pause and resume are core's (`SandboxManager.pause/resume`: the state is kept in a
snapshot, and the sandbox comes back under its id)."""

from __future__ import annotations

from datetime import timedelta

from sandlot.core.models import CreateSandbox, SandboxRecord, SandboxState, SnapshotState, now
from sandlot.core.service import Core
from sandlot.errors import ConflictError, InvalidStateError, NotFoundError, StorageError
from sandlot.server.e2b.convert import snapshot_name

CAPTURE_WAIT = 120.0
READY_WAIT = 600.0


class Lifecycle:
    """E2B's create, connect, pause, resume and kill over one `Core`."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def state_of(self, sandbox_id: str) -> tuple[SandboxRecord, str]:
        """The sandbox and its E2B state, 'running' or 'paused'; NotFoundError otherwise."""
        live = self.core.sandboxes.live.get(sandbox_id)
        if live is not None:
            return live.record, "running"
        rec = await self.core.sandboxes.get(sandbox_id)
        if rec.state == SandboxState.PAUSED:
            return rec, "paused"
        raise NotFoundError(f"sandbox {sandbox_id} not found")

    async def listed(self) -> list[tuple[SandboxRecord, str]]:
        return [(r, "paused" if r.state == SandboxState.PAUSED else "running")
                for r in await self.core.sandboxes.list()]

    async def wait_captured(self, snapshot_id: str):
        """Wait until the snapshot holds the sandbox's state (capture done; upload may go on)."""
        rec = await self.core.snapshots.wait(snapshot_id, CAPTURE_WAIT, captured_only=True)
        if rec.state == SnapshotState.FAILED:
            raise StorageError(f"snapshot {snapshot_id} failed: {rec.error}")
        if rec.state == SnapshotState.CREATING:
            raise StorageError(f"snapshot {snapshot_id} is still being captured")
        return rec

    async def wait_ready(self, id_or_name: str):
        rec = await self.core.snapshots.wait(id_or_name, READY_WAIT)
        if rec.state == SnapshotState.FAILED:
            raise StorageError(f"snapshot {rec.snapshot_id} failed: {rec.error}")
        if rec.state == SnapshotState.DELETED:
            raise NotFoundError(f"snapshot {id_or_name} was deleted")
        if rec.state != SnapshotState.READY:
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is still {rec.state.value}",
                                    current=rec.state.value, allowed=("ready",))
        return rec

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        if sandbox_id not in self.core.sandboxes.live:
            await self.state_of(sandbox_id)  # NotFoundError unless it is paused
            raise ConflictError(f"sandbox {sandbox_id} is already paused")
        await self.core.sandboxes.pause(sandbox_id, memory=memory)

    async def connect(self, sandbox_id: str, timeout: int | None, reboot: bool = False
                      ) -> tuple[SandboxRecord, bool]:
        """E2B connect: a running sandbox (its timeout only ever extended), or a paused one
        resumed (`reboot`: booted from its disk). Returns (record, resumed)."""
        live = self.core.sandboxes.live.get(sandbox_id)
        if live is not None:
            rec = live.record
            if timeout and rec.expires_at is not None and (
                    now() + timedelta(seconds=timeout) > rec.expires_at):
                rec = await self.core.sandboxes.set_timeout(sandbox_id, timeout)
            return rec, False
        rec, _ = await self.state_of(sandbox_id)
        return await self.core.sandboxes.resume(sandbox_id, timeout, reboot=reboot), True

    async def kill(self, sandbox_id: str) -> None:
        await self.state_of(sandbox_id)
        await self.core.sandboxes.kill(sandbox_id)

    async def source(self, template_id: str) -> CreateSandbox:
        """What an E2B template id names here: a sandlot template, or a snapshot (by id or name;
        E2B creates sandboxes from snapshots by passing the snapshot id as the template)."""
        if not template_id.startswith("snap-"):
            try:
                await self.core.templates.info(template_id)
                return CreateSandbox(template=template_id)
            except NotFoundError:
                pass
        try:
            snap = await self.core.snapshots.get(
                template_id if template_id.startswith("snap-") else snapshot_name(template_id))
        except NotFoundError:
            names = ", ".join(t.name for t in self.core.templates.list()) or "none"
            raise NotFoundError(f"template or snapshot {template_id!r} not found; this sandlot "
                                f"server has the templates: {names}") from None
        snap = await self.wait_ready(snap.snapshot_id)
        return CreateSandbox(snapshot_id=snap.snapshot_id)

    def disk_mb(self, rec: SandboxRecord) -> int:
        if rec.disk_mb:
            return rec.disk_mb
        try:
            size = (self.core.templates.builds / rec.build / "rootfs.ext4").stat().st_size
        except OSError:
            return 0
        return size >> 20
