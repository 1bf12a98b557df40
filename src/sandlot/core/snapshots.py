"""Snapshots of running sandboxes: their records, names and lifecycle.

Lifecycle: creating (the runtime captures memory, devices and disk while the sandbox runs,
paused for milliseconds) -> uploading (compressed and checksummed into the store) -> ready; or
failed (with the reason); deleted is a soft delete. A snapshot is marked ready only after its
manifest is durably written, so a crash never leaves a bad `ready` snapshot. Progress is
awaitable (`wait`): nothing polls the metadata store.

Kinds: `user` snapshots are listed and named; a `pause` snapshot holds a paused sandbox's
state and is not listed. A fork's capture makes no record at all (sandboxes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from sandlot.core.db import MetadataStore, NameTaken, scoped_name
from sandlot.core.ids import SANDBOX_ID_RE, is_snapshot_id, new_snapshot_id
from sandlot.core.live import LiveSandbox
from sandlot.core.models import (
    SnapshotKind,
    SnapshotRecord,
    SnapshotState,
    now,
    to_doc,
    transition,
)
from sandlot.core.sources import Source
from sandlot.core.tenancy import OPERATOR_TENANT, SYSTEM, Principal
from sandlot.errors import (
    ConflictError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
    StorageError,
)
from sandlot.images.spec import NAME_RE
from sandlot.runtime.base import Captured, Image, MachineDescription, Runtime

log = logging.getLogger(__name__)
TERMINAL = (SnapshotState.READY, SnapshotState.FAILED, SnapshotState.DELETED)


MAX_NAME = 127  # a snapshot name: name[:tag], 63 characters each


def could_name(id_or_name: str) -> bool:
    """Whether `id_or_name` has the form of a snapshot id or name: anything else names no
    snapshot, and is never looked up (in the database or the store)."""
    return is_snapshot_id(id_or_name) or (0 < len(id_or_name) <= MAX_NAME
                                          and "\0" not in id_or_name)


@dataclass
class _Progress:
    """Events of a snapshot this process is taking."""

    captured: asyncio.Event = field(default_factory=asyncio.Event)  # creating is over
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # ready, failed or deleted


class SnapshotManager:
    def __init__(self, db: MetadataStore, runtime: Runtime, host_id: str) -> None:
        self.db = db
        self.runtime = runtime
        self.host_id = host_id
        self._changed = asyncio.Event()  # another host changed a snapshot (shared store)
        self.on_ready: Callable[[SnapshotRecord], None] | None = None  # metrics
        if hasattr(db, "on_snapshot_change"):
            db.on_snapshot_change(lambda _id: self._changed.set())
        self._progress: dict[str, _Progress] = {}
        self._tasks: set[asyncio.Task] = set()
        self._holds: dict[str, int] = {}  # snapshot id -> restores from it under way
        self._doomed: set[str] = set()  # deleted while held: their data goes with the last hold

    # ---- records --------------------------------------------------------------------------

    async def _save(self, rec: SnapshotRecord) -> None:
        try:
            await self.db.put_snapshot(rec.snapshot_id, scoped_name(_tenant(rec), rec.name),
                                       rec.state.value, self.host_id, to_doc(rec),
                                       rec.created_at.timestamp())
        except NameTaken:
            raise ConflictError(f"a snapshot named {rec.name!r} already exists") from None
        progress = self._progress.get(rec.snapshot_id)
        if progress is not None:
            if rec.state != SnapshotState.CREATING:
                progress.captured.set()
            if rec.state in TERMINAL:
                progress.finished.set()
                self._progress.pop(rec.snapshot_id, None)

    async def get(self, id_or_name: str, who: Principal, *, include_deleted: bool = False
                  ) -> SnapshotRecord:
        """A snapshot by id, or by name among `who`'s tenant's; another tenant's is not
        found."""
        if not could_name(id_or_name):
            raise NotFoundError(f"snapshot {id_or_name[:64]!r} not found")
        key = id_or_name if is_snapshot_id(id_or_name) else scoped_name(who.tenant,
                                                                          id_or_name)
        doc = await self.db.get_snapshot(key)
        rec = SnapshotRecord.model_validate(doc) if doc is not None else None
        if rec is None or not who.sees(rec.owner):
            raise NotFoundError(f"snapshot {id_or_name!r} not found")
        if rec.state == SnapshotState.DELETED and not include_deleted:
            raise NotFoundError(f"snapshot {id_or_name!r} was deleted")
        return rec

    async def list(self, sandbox_id: str | None = None,
                   kind: SnapshotKind = SnapshotKind.USER, *,
                   who: Principal) -> list[SnapshotRecord]:
        states = tuple(s.value for s in SnapshotState if s != SnapshotState.DELETED)
        recs = [SnapshotRecord.model_validate(d) for d in await self.db.snapshots(states)]
        recs = [r for r in recs if r.kind == kind and not r.internal and who.sees(r.owner)]
        if sandbox_id:
            recs = [r for r in recs if r.sandbox_id == sandbox_id]
        return recs

    async def check_name(self, name: str | None, tenant: str,
                         except_id: str | None = None) -> None:
        if name is None:
            return
        base, _, tag = name.partition(":")
        if (not NAME_RE.match(base) or (tag or ":" in name) and not NAME_RE.match(tag)
                or is_snapshot_id(name) or SANDBOX_ID_RE.fullmatch(name)):
            raise InvalidArgumentError(
                "snapshot names are 1-63 lowercase letters, digits, '.', '_' or '-', "
                "optionally with a tag of the same (`name:tag`), and may not have the form "
                "of a snapshot or sandbox id ('snap-' or 'sb-' and 10 hex digits)")
        if await self.db.name_taken(scoped_name(tenant, name), except_id):
            raise ConflictError(f"a snapshot named {name!r} already exists")

    async def rename(self, id_or_name: str, name: str | None, *, who: Principal
                     ) -> SnapshotRecord:
        rec = await self.get(id_or_name, who)
        await self.check_name(name, _tenant(rec), except_id=rec.snapshot_id)
        rec.name = name
        await self._save(rec)
        return rec

    async def delete(self, id_or_name: str, *, who: Principal) -> None:
        """Soft delete: the record stays as `deleted`; the data goes in the background (the
        local files once no sandbox restored from it maps them)."""
        rec = await self.get(id_or_name, who)
        if rec.state in (SnapshotState.CREATING, SnapshotState.UPLOADING):
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is still {rec.state.value}; "
                                    "wait for it before deleting", current=rec.state.value,
                                    allowed=("ready", "failed"))
        transition(rec, SnapshotState.DELETED)
        rec.name = None
        await self._save(rec)
        if self._holds.get(rec.snapshot_id):
            self._doomed.add(rec.snapshot_id)  # a restore from it is under way: after it
        else:
            self._spawn(self.runtime.discard(rec.snapshot_id))

    @contextlib.asynccontextmanager
    async def holding(self, snapshot_id: str | None) -> AsyncIterator[None]:
        """Hold a snapshot while a restore from it runs (taken right after `source`): a
        delete meanwhile succeeds (the record is `deleted` at once, new restores are
        refused), but its data (the store's copy, the hot files the restore is fetching or
        mapping) stays until the last holder is done; a restored sandbox's VM then keeps the
        hot files it maps by its lease. NotFoundError if it is deleted already. None (a
        template) holds nothing."""
        if snapshot_id is None:
            yield
            return
        # Held first, then checked: a delete either sees the hold (and waits for it) or has
        # saved `deleted` before the check (NotFoundError here), whatever the order.
        self._holds[snapshot_id] = self._holds.get(snapshot_id, 0) + 1
        try:
            await self.get(snapshot_id, SYSTEM)  # not deleted meanwhile
            yield
        finally:
            left = self._holds.pop(snapshot_id) - 1
            if left:
                self._holds[snapshot_id] = left
            elif snapshot_id in self._doomed:
                self._doomed.discard(snapshot_id)
                self._spawn(self.runtime.discard(snapshot_id))

    # ---- sources --------------------------------------------------------------------------

    async def source(self, id_or_name: str, who: Principal) -> Source:
        """A ready snapshot of `who`'s as a restore source; InvalidStateError if it cannot be
        one here. A snapshot id this server has no record of is looked up in the store
        (another server took it): its manifest carries its record."""
        try:
            rec = await self.get(id_or_name, who, include_deleted=True)
        except NotFoundError:
            if not is_snapshot_id(id_or_name) or await self.db.get_snapshot(id_or_name):
                raise  # a record of another tenant's is as good as none
            rec = await self._from_store(id_or_name, who)
        if rec.state == SnapshotState.DELETED:
            # Not looked for in the store: its copy there may not be gone yet, and must not
            # bring the record back.
            raise NotFoundError(f"snapshot {id_or_name!r} was deleted")
        if rec.state != SnapshotState.READY:
            if rec.state == SnapshotState.FAILED:
                raise InvalidStateError(f"snapshot {rec.snapshot_id} failed: {rec.error}",
                                        current="failed", allowed=("ready",))
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is {rec.state.value}, "
                                    "not ready yet; wait for it", current=rec.state.value,
                                    allowed=("ready",))
        return self.source_of(rec)

    async def _from_store(self, snapshot_id: str, who: Principal) -> SnapshotRecord:
        try:
            meta = await self.runtime.stored_meta(snapshot_id)
        except NotFoundError:
            raise NotFoundError(f"snapshot {snapshot_id!r} not found") from None
        record = meta.get("record")
        if not isinstance(record, dict) or record.get("snapshot_id") != snapshot_id:
            raise NotFoundError(f"snapshot {snapshot_id!r} is in the store without a record")
        rec = SnapshotRecord.model_validate({**record, "name": None})
        if not who.sees(rec.owner):
            raise NotFoundError(f"snapshot {snapshot_id!r} not found")
        transition(rec, SnapshotState.READY)  # it was uploading when its record was stored
        await self._save(rec)
        log.info("snapshot %s: taken by another server, found in the store", snapshot_id)
        return rec

    def source_of(self, rec: SnapshotRecord) -> Source:
        try:
            machine = MachineDescription.from_dict(rec.machine)
            self.runtime.check_loadable(machine)
        except InvalidStateError as e:
            raise InvalidStateError(f"snapshot {rec.snapshot_id} cannot be restored here: "
                                    f"{e.message}") from None
        image = Image(key=rec.snapshot_id, build=rec.build, machine=machine)
        return Source(image=image, env=dict(rec.env), template=rec.template,
                      snapshot_id=rec.snapshot_id, workdir=rec.workdir,
                      user=rec.user, volume_mounts=tuple(rec.volume_mounts),
                      volume_host=rec.volume_host)

    # ---- taking snapshots -----------------------------------------------------------------

    async def begin(self, live: LiveSandbox, name: str | None,
                    kind: SnapshotKind = SnapshotKind.USER,
                    internal: bool = False, memory: bool = True,
                    owner: str | None = None) -> SnapshotRecord:
        """A new `creating` record for a snapshot of `live`, of tenant `owner` (`internal`:
        not listed, deleted by its host's next start if still there: a fork's, for children
        on other hosts; `memory` false: its filesystem only)."""
        owner = owner or live.record.owner
        await self.check_name(name, owner or OPERATOR_TENANT)
        sb = live.record
        rec = SnapshotRecord(
            snapshot_id=new_snapshot_id(), name=name, sandbox_id=sb.sandbox_id,
            template=sb.template, memory_mb=sb.memory_mb, cpus=sb.cpus, env=dict(sb.env),
            kind=kind, workdir=sb.workdir, user=sb.user, build=sb.build, internal=internal,
            memory=memory, owner=owner,
        )
        if memory:  # the mounts are in its memory (a disk alone boots without them)
            rec.volume_mounts, rec.volume_host = list(sb.volume_mounts), sb.volume_host
        self._progress[rec.snapshot_id] = _Progress()
        await self._save(rec)
        return rec

    def start(self, live: LiveSandbox, rec: SnapshotRecord) -> None:
        """Capture and store `rec` in the background; `wait` for it. What the sandbox is
        asked to do after this call waits until the capture is done (`LiveSandbox.guest`)."""
        live.capture_asked()

        async def job() -> None:
            try:
                async with live.lock:
                    captured = await self.capture(live, rec)
            except Exception:  # noqa: BLE001 - recorded on the snapshot as `failed`
                return
            finally:
                live.capture_done()
            try:
                await self.upload(rec, captured)
            except Exception:  # noqa: BLE001 - recorded on the snapshot as `failed`
                pass
            finally:
                self.runtime.release(rec.snapshot_id)

        self._spawn(job())

    async def capture(self, live: LiveSandbox, rec: SnapshotRecord) -> Captured:
        """The sandbox's memory, devices and disk, while it runs (a pause of milliseconds),
        or its disk alone (`rec.memory` false). Call with `live.lock` held. On failure the
        capture's hold is released here (its buffer, its cache entry)."""
        captured = None
        try:
            # A pause's disk holds what the guest wrote, for a resume that reboots from it.
            captured = await self.runtime.capture(live.vm, rec.snapshot_id, memory=rec.memory,
                                                  sync=rec.kind == SnapshotKind.PAUSE)
            rec.machine = captured.image.machine.to_dict()
            rec.pause_ms = round(captured.pause_ms, 2)
            rec.capture_ms = round(captured.total_ms, 2)
            transition(rec, SnapshotState.UPLOADING)
            await self._save(rec)
        except BaseException as e:
            if captured is not None:  # never uploaded: nobody else releases it
                self.runtime.release(rec.snapshot_id)
            await self._fail(rec, e)
            raise
        return captured

    async def upload(self, rec: SnapshotRecord, captured: Captured) -> SnapshotRecord:
        try:
            stored = await self.runtime.persist(captured, {"record": to_doc(rec)})
            rec.size_bytes = stored.size_bytes
            rec.stored_bytes = stored.stored_bytes
            current = await self.get(rec.snapshot_id, SYSTEM, include_deleted=True)
            if current.state != SnapshotState.UPLOADING:
                return current
            transition(rec, SnapshotState.READY)
            rec.ready_at = now()
            await self._save(rec)
            if self.on_ready is not None and rec.kind == SnapshotKind.USER:
                self.on_ready(rec)
        except BaseException as e:
            await self._fail(rec, e)
            raise
        return rec

    async def _fail(self, rec: SnapshotRecord, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            message = "interrupted (server shutting down)"
        elif isinstance(exc, SandlotError):
            message = exc.message
        else:
            message = f"{type(exc).__name__}: {exc}"
        log.warning("snapshot %s failed: %s", rec.snapshot_id, message)
        rec.error = message
        if rec.state not in (SnapshotState.FAILED, SnapshotState.DELETED):
            transition(rec, SnapshotState.FAILED)
        try:
            await self._save(rec)
        except (SandlotError, OSError):
            pass
        self._spawn(self.runtime.discard(rec.snapshot_id))

    async def wait(self, id_or_name: str, timeout: float | None = 300,
                   captured_only: bool = False, *, who: Principal) -> SnapshotRecord:
        """The snapshot once it is ready, failed or deleted (or, `captured_only`, no longer
        creating), or as it is when `timeout` runs out."""
        rec = await self.get(id_or_name, who, include_deleted=True)
        progress = self._progress.get(rec.snapshot_id)
        if progress is not None:
            event = progress.captured if captured_only else progress.finished
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                pass
            return await self.get(rec.snapshot_id, who, include_deleted=True)
        # Taken by another host: its changes come through the store (NOTIFY where shared).
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (rec.state in TERMINAL or
                   (captured_only and rec.state != SnapshotState.CREATING)):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(1.0, left or 1.0))
            except TimeoutError:
                pass
            rec = await self.get(rec.snapshot_id, who, include_deleted=True)
        return rec

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        # Snapshots deleted while a restore held them: their data goes now, not never.
        doomed, self._doomed = self._doomed, set()
        for snapshot_id in doomed:
            with contextlib.suppress(Exception):
                await self.runtime.discard(snapshot_id)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- recovery -------------------------------------------------------------------------

    async def recover(self) -> set[str]:
        """After a restart: this host's unfinished snapshots become failed and their partial
        data goes; so does every fork snapshot an older sandlot recorded. Returns the ready
        ones (of every host: their files may be in this host's cache)."""
        mine = self.host_id if self.db.shared else None
        for doc in await self.db.snapshots(("creating", "uploading"), host=mine):
            rec = SnapshotRecord.model_validate(doc)
            await self._fail(rec, StorageError("interrupted: the server stopped while it was "
                                               f"{rec.state.value}"))
        for doc in await self.db.snapshots(("ready", "failed"), host=mine):
            rec = SnapshotRecord.model_validate(doc)
            if rec.internal:
                transition(rec, SnapshotState.DELETED)
                await self._save(rec)
                self._spawn(self.runtime.discard(rec.snapshot_id))
        return {d["snapshot_id"] for d in await self.db.snapshots(("ready",))}


def _tenant(rec: SnapshotRecord) -> str:
    return rec.owner or OPERATOR_TENANT
