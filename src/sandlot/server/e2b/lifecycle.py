"""E2B's sandbox lifecycle on sandlot's core: E2B's running and paused are core's sandbox
states, pause and resume are core's (`SandboxManager.pause/resume`: the state is kept in a
snapshot, and the sandbox comes back under its id). Every call acts for a `Principal`."""

from __future__ import annotations

from datetime import timedelta

from sandlot.core.models import CreateSandbox, SandboxRecord, SandboxState, SnapshotState, now
from sandlot.core.service import Core
from sandlot.core.snapshots import is_snapshot_id
from sandlot.core.tenancy import Principal
from sandlot.errors import ConflictError, InvalidStateError, NotFoundError, StorageError
from sandlot.server.e2b.convert import snapshot_name

CAPTURE_WAIT = 120.0
READY_WAIT = 600.0


class Lifecycle:
    """E2B's create, connect, pause, resume and kill over one `Core`."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def state_of(self, sandbox_id: str, who: Principal) -> tuple[SandboxRecord, str]:
        """The sandbox and its E2B state, 'running' or 'paused'; NotFoundError otherwise."""
        rec = await self.core.sandboxes.get(sandbox_id, who)
        if self.core.sandboxes.is_running(sandbox_id, who):
            return rec, "running"
        if rec.state == SandboxState.PAUSED:
            return rec, "paused"
        raise NotFoundError(f"sandbox {sandbox_id} not found")

    async def listed(self, who: Principal) -> list[tuple[SandboxRecord, str]]:
        return [(r, "paused" if r.state == SandboxState.PAUSED else "running")
                for r in await self.core.sandboxes.list(who=who)]

    async def wait_captured(self, snapshot_id: str, who: Principal):
        """Wait until the snapshot holds the sandbox's state (capture done; upload may go on)."""
        rec = await self.core.snapshots.wait(snapshot_id, CAPTURE_WAIT, captured_only=True,
                                             who=who)
        if rec.state == SnapshotState.FAILED:
            raise StorageError(f"snapshot {snapshot_id} failed: {rec.error}")
        if rec.state == SnapshotState.CREATING:
            raise StorageError(f"snapshot {snapshot_id} is still being captured")
        return rec

    async def wait_ready(self, id_or_name: str, who: Principal):
        rec = await self.core.snapshots.wait(id_or_name, READY_WAIT, who=who)
        if rec.state == SnapshotState.FAILED:
            raise StorageError(f"snapshot {rec.snapshot_id} failed: {rec.error}")
        if rec.state == SnapshotState.DELETED:
            raise NotFoundError(f"snapshot {id_or_name} was deleted")
        if rec.state != SnapshotState.READY:
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is still {rec.state.value}",
                                    current=rec.state.value, allowed=("ready",))
        return rec

    async def pause(self, sandbox_id: str, memory: bool = True, *, who: Principal) -> None:
        if not self.core.sandboxes.is_running(sandbox_id, who):
            await self.state_of(sandbox_id, who)  # NotFoundError unless it is paused
            raise ConflictError(f"sandbox {sandbox_id} is already paused")
        await self.core.sandboxes.pause(sandbox_id, memory=memory, who=who)

    async def connect(self, sandbox_id: str, timeout: int | None, reboot: bool = False, *,
                      who: Principal) -> tuple[SandboxRecord, bool]:
        """E2B connect: a running sandbox (its timeout only ever extended), or a paused one
        resumed (`reboot`: booted from its disk). Returns (record, resumed)."""
        if self.core.sandboxes.is_running(sandbox_id, who):
            rec = await self.core.sandboxes.get(sandbox_id, who)
            if timeout and rec.expires_at is not None and (
                    now() + timedelta(seconds=timeout) > rec.expires_at):
                rec = await self.core.sandboxes.set_timeout(sandbox_id, timeout, who=who)
            return rec, False
        await self.state_of(sandbox_id, who)
        return await self.core.placement.resume(sandbox_id, timeout, reboot, who=who), True

    async def kill(self, sandbox_id: str, who: Principal) -> None:
        await self.state_of(sandbox_id, who)
        await self.core.sandboxes.kill(sandbox_id, who=who)

    async def source(self, template_id: str, who: Principal) -> CreateSandbox:
        """What an E2B template id names here for `who`: a sandlot template, or a snapshot of
        its tenant's (by id or name; E2B creates sandboxes from snapshots by passing the
        snapshot id as the template)."""
        if not is_snapshot_id(template_id):
            try:
                await self.core.templates.info(template_id, who)
                return CreateSandbox(template=template_id)
            except NotFoundError:
                pass
        try:
            snap = await self.core.snapshots.get(
                template_id if is_snapshot_id(template_id) else snapshot_name(template_id),
                who)
        except NotFoundError:
            raise NotFoundError(
                f"template or snapshot {template_id[:64]!r} not found") from None
        snap = await self.wait_ready(snap.snapshot_id, who)
        return CreateSandbox(snapshot_id=snap.snapshot_id)

    def disk_mb(self, rec: SandboxRecord) -> int:
        return rec.disk_mb or self.core.settings.disk_quota_mb  # (recorded since quotas)
