"""Snapshots of running sandboxes: capture (milliseconds of pause), then compress and store.

Lifecycle: creating (capturing memory, devices, disk) -> uploading (zstd + sha256 into the blob
store) -> ready; or failed (with the reason); deleted is a soft delete. A snapshot is marked ready
only after its manifest is durably written, so a crash never leaves a bad `ready` snapshot.
Fork snapshots are `internal`: kept on tmpfs only, dropped with the last sandbox restored from them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
from collections.abc import Callable
from pathlib import Path

from sandlot.core.config import Settings
from sandlot.core.models import SnapshotRecord, SnapshotState, now, to_doc, transition
from sandlot.core.runtime import LiveSandbox
from sandlot.core.sources import HotCache, Source
from sandlot.core.store import MetadataStore
from sandlot.core.templates import TemplateStore
from sandlot.errors import (
    ConflictError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
    StorageError,
    VmmError,
)
from sandlot.images.spec import NAME_RE
from sandlot.storage.blobs import BlobStore
from sandlot.vmm import snapshot as vmm_snapshot
from sandlot.vmm.disk import flatten_pair, merge_below_top
from sandlot.vmm.machine import DEVICE_MODEL

log = logging.getLogger(__name__)


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(5)


class SnapshotManager:
    def __init__(self, settings: Settings, db: MetadataStore, hot: HotCache,
                 templates: TemplateStore) -> None:
        self.settings = settings
        self.db = db
        self.hot = hot
        self.templates = templates
        self.store = BlobStore(settings.store_dir)
        self._tasks: set[asyncio.Task] = set()
        self.in_use: Callable[[str], bool] = lambda key: False
        self.on_sandbox_changed: Callable[[LiveSandbox], None] = lambda live: None

    # ---- records --------------------------------------------------------------------------

    def _save(self, rec: SnapshotRecord) -> None:
        try:
            self.db.put_snapshot(rec.snapshot_id, rec.name, rec.state.value, to_doc(rec),
                                 rec.created_at.timestamp())
        except sqlite3.IntegrityError:
            raise ConflictError(f"a snapshot named {rec.name!r} already exists") from None

    def _load(self, doc: dict) -> SnapshotRecord:
        return SnapshotRecord.model_validate(doc)

    def get(self, id_or_name: str, *, include_deleted: bool = False) -> SnapshotRecord:
        doc = self.db.get_snapshot(id_or_name)
        if doc is None:
            raise NotFoundError(f"snapshot {id_or_name!r} not found")
        rec = self._load(doc)
        if rec.state == SnapshotState.DELETED and not include_deleted:
            raise NotFoundError(f"snapshot {id_or_name!r} was deleted")
        return rec

    def list(self, sandbox_id: str | None = None) -> list[SnapshotRecord]:
        states = tuple(s.value for s in SnapshotState if s != SnapshotState.DELETED)
        recs = [self._load(d) for d in self.db.snapshots(states)]
        recs = [r for r in recs if not r.internal]
        if sandbox_id:
            recs = [r for r in recs if r.sandbox_id == sandbox_id]
        return recs

    def _check_name(self, name: str | None, except_id: str | None = None) -> None:
        if name is None:
            return
        if not NAME_RE.match(name) or name.startswith(("snap-", "sb-")):
            raise InvalidArgumentError(
                "snapshot names are 1-63 lowercase letters, digits, '.', '_' or '-', "
                "and may not start with 'snap-' or 'sb-'")
        if self.db.name_taken(name, except_id):
            raise ConflictError(f"a snapshot named {name!r} already exists")

    def rename(self, id_or_name: str, name: str | None) -> SnapshotRecord:
        rec = self.get(id_or_name)
        self._check_name(name, except_id=rec.snapshot_id)
        rec.name = name
        self._save(rec)
        return rec

    def delete(self, id_or_name: str) -> None:
        """Soft delete: the record stays as `deleted`; data goes away in the background, and the
        hot files stay until no live sandbox restored from this snapshot remains."""
        rec = self.get(id_or_name)
        if rec.state in (SnapshotState.CREATING, SnapshotState.UPLOADING):
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is still {rec.state.value}; "
                                    "wait for it before deleting", current=rec.state.value,
                                    allowed=("ready", "failed"))
        transition(rec, SnapshotState.DELETED)
        rec.name = None
        self._save(rec)
        self._spawn(self._purge(rec.snapshot_id))

    async def _purge(self, snapshot_id: str) -> None:
        await asyncio.to_thread(self.store.delete, snapshot_id)
        self.release(snapshot_id)

    def release(self, key: str) -> None:
        """Drop a snapshot's hot files if nothing needs them any more."""
        if key.startswith("tpl-") or self.in_use(key):
            return
        doc = self.db.get_snapshot(key)
        if doc is None:
            self.hot.remove(key)
            return
        rec = self._load(doc)
        if rec.state == SnapshotState.DELETED or rec.internal:
            self.hot.remove(key)

    # ---- sources --------------------------------------------------------------------------

    def source(self, id_or_name: str) -> Source:
        rec = self.get(id_or_name)
        if rec.state != SnapshotState.READY:
            if rec.state == SnapshotState.FAILED:
                raise InvalidStateError(f"snapshot {rec.snapshot_id} failed: {rec.error}",
                                        current="failed", allowed=("ready",))
            raise InvalidStateError(f"snapshot {rec.snapshot_id} is {rec.state.value}, "
                                    "not ready yet; wait for it", current=rec.state.value,
                                    allowed=("ready",))
        return self.source_of(rec)

    def source_of(self, rec: SnapshotRecord) -> Source:
        build = self.templates.builds / rec.base
        return Source(key=rec.snapshot_id, build=build, store=self.store,
                      blob_key=rec.snapshot_id, memory_mb=rec.ram_mb or rec.memory_mb,
                      dimm_mb=rec.memory_mb - (rec.ram_mb or rec.memory_mb), cpus=rec.cpus,
                      env=dict(rec.env), template=rec.template, snapshot_id=rec.snapshot_id,
                      workdir=rec.workdir, device_model=rec.device_model)

    # ---- capture --------------------------------------------------------------------------

    def begin(self, live: LiveSandbox, name: str | None, internal: bool = False) -> SnapshotRecord:
        self._check_name(name)
        sb = live.record
        rec = SnapshotRecord(
            snapshot_id=new_snapshot_id(), name=name, sandbox_id=sb.sandbox_id,
            template=sb.template, memory_mb=sb.memory_mb, cpus=sb.cpus, env=dict(sb.env),
            internal=internal, workdir=sb.workdir, base=live.base,
            ram_mb=live.machine.spec.memory_mb, device_model=DEVICE_MODEL,
        )
        self._save(rec)
        return rec

    async def capture(self, live: LiveSandbox, rec: SnapshotRecord,
                      pause: bool = False) -> SnapshotRecord:
        """Take the snapshot's memory, device state and disk; the sandbox keeps running, paused
        for milliseconds, or (`pause`, for a fork) for the whole copy, which is quicker."""
        key = rec.snapshot_id
        try:
            async with live.lock:
                await self._merge_pending(live)
                if live.pending_merge is not None:
                    raise VmmError(f"sandbox {live.sandbox_id}: its disk chain could not be "
                                   "compacted before the snapshot")
                sb = live.record
                sb.disk_index += 1
                new_overlay = live.disk_dir / f"disk-{sb.disk_index}.qcow2"
                result = await vmm_snapshot.capture(
                    live.machine, self.hot.dir(key), new_overlay,
                    self.settings.run_root / f"h-{key}", f"ov{sb.disk_index}", live=not pause)
                self.on_sandbox_changed(live)
            # The guest's clock stood still during the pause: bring it back to the host's.
            try:
                await (await live.session()).sync_clock()
            except SandlotError as e:
                log.warning("clock resync after snapshot of %s failed: %s", sb.sandbox_id, e)
            await flatten_pair(result.disk, self.hot.paths(live.record.source_key)["disk"],
                               self.hot.paths(key)["disk"])
            self.hot.mark_ready(key)
            live.pending_merge = result.disk
            self._spawn(self._compact(live))
            # The migration read every page of the sandbox's RAM, and reading a hole of the
            # tmpfs file it was restored from allocates it: give those zero pages back too.
            source_ram = self.hot.paths(live.record.source_key)["ram"]
            self._spawn(self._punch([result.ram, result.dimm, source_ram]))
            rec.pause_ms = round(result.pause_ms, 2)
            rec.capture_ms = round(result.total_ms, 2)
        except BaseException as e:
            self._fail(rec, e)
            raise
        return rec

    async def _compact(self, live: LiveSandbox) -> None:
        async with live.lock:
            await self._merge_pending(live)

    async def _merge_pending(self, live: LiveSandbox) -> None:
        """Keep the sandbox's disk chain at three layers (its overlay, its source's disk, the
        template's root filesystem): merge the overlay a snapshot froze into the new one.
        Runs in the background after a capture, and before the next one (which needs the
        frozen layer's backing to be the source disk). Call with `live.lock` held."""
        frozen = live.pending_merge
        if frozen is None or live.machine.exited:
            return
        try:
            await merge_below_top(live.machine, self.hot.paths(live.record.source_key)["disk"])
        except SandlotError as e:
            log.warning("disk chain of %s not compacted: %s", live.sandbox_id, e)
            return
        live.pending_merge = None
        frozen.unlink(missing_ok=True)

    async def _punch(self, files: list[Path | None]) -> None:
        for ram in files:
            if ram is not None and ram.exists():
                try:
                    await vmm_snapshot.punch_zero_pages(ram)
                except SandlotError as e:
                    log.warning("could not free zero pages of %s: %s", ram, e)

    async def upload(self, rec: SnapshotRecord) -> SnapshotRecord:
        key = rec.snapshot_id
        try:
            transition(rec, SnapshotState.UPLOADING)
            self._save(rec)
            paths = self.hot.paths(key)
            manifest = await asyncio.to_thread(self.store.put, key, paths, {
                "memory_mb": rec.memory_mb, "cpus": rec.cpus, "base": rec.base})
            rec.size_bytes = manifest.size_bytes
            rec.stored_bytes = manifest.stored_bytes
            current = self.get(key, include_deleted=True)
            if current.state != SnapshotState.UPLOADING:
                return current
            transition(rec, SnapshotState.READY)
            rec.ready_at = now()
            self._save(rec)
        except BaseException as e:
            self._fail(rec, e)
            raise
        return rec

    def finish_internal(self, rec: SnapshotRecord) -> None:
        transition(rec, SnapshotState.READY)
        rec.ready_at = now()
        self._save(rec)

    def _fail(self, rec: SnapshotRecord, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):
            message = "interrupted (server shutting down)"
        elif isinstance(exc, StorageError):
            message = exc.message
        else:
            message = f"{type(exc).__name__}: {exc}"
        log.warning("snapshot %s failed: %s", rec.snapshot_id, message)
        rec.error = message
        if rec.state not in (SnapshotState.FAILED, SnapshotState.DELETED):
            transition(rec, SnapshotState.FAILED)
        try:
            self._save(rec)
        except SandlotError:
            pass
        self.hot.remove(rec.snapshot_id)
        self.store.delete(rec.snapshot_id)

    def run_in_background(self, live: LiveSandbox, rec: SnapshotRecord) -> None:
        async def job() -> None:
            try:
                await self.capture(live, rec)
                await self.upload(rec)
            except Exception:  # noqa: BLE001 - recorded on the snapshot as `failed`
                pass

        self._spawn(job())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait_ready(self, id_or_name: str, timeout: float = 300) -> SnapshotRecord:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            rec = self.get(id_or_name, include_deleted=True)
            if rec.state in (SnapshotState.READY, SnapshotState.FAILED, SnapshotState.DELETED):
                return rec
            if loop.time() > deadline:
                return rec
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- recovery -------------------------------------------------------------------------

    def recover(self) -> None:
        """After a restart: unfinished snapshots become failed; their partial data goes."""
        for doc in self.db.snapshots(("creating", "uploading")):
            rec = self._load(doc)
            self._fail(rec, StorageError("interrupted: the server stopped while it was "
                                         f"{rec.state.value}"))
        for doc in self.db.snapshots(("deleted",)):
            rec = self._load(doc)
            if self.store.exists(rec.snapshot_id):
                self.store.delete(rec.snapshot_id)
        known = {d["snapshot_id"] for d in self.db.snapshots()}
        for key in self.store.keys():
            if key not in known:
                self.store.delete(key)
