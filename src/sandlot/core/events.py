"""Record changes as a feed: every sandbox and snapshot this host writes, for the console's live
views (GET /v1/events). Core publishes as it saves; a subscriber iterates what its tenant may
see. Nothing calls up: the server iterates `subscribe()`.

On a store shared by several hosts (PostgreSQL), every host's writes are seen: the store
notifies each change, and the feed reads the record as it now is (only while a console is
subscribed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sandlot.core.models import SandboxRecord, SnapshotKind, SnapshotRecord
from sandlot.core.tenancy import Principal

QUEUE = 1000  # changes kept for a slow subscriber; past that it is told to reload


@dataclass(frozen=True)
class Change:
    """One record as it now is: `kind` sandbox or snapshot; `record` its API shape.
    `kind` "reload": the subscriber fell behind and should list everything again."""

    kind: str
    id: str
    record: dict[str, Any] | None = None


RELOAD = Change("reload", "")


class Events:
    """The feed. `publish_*` are called where records are saved; `subscribe` reads."""

    def __init__(self) -> None:
        self._subscribers: set[tuple[Principal, asyncio.Queue[Change]]] = set()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish_sandbox(self, doc: dict) -> None:
        if not self._subscribers:
            return  # the hot path pays nothing while no console is open
        rec = SandboxRecord.model_validate(doc)
        self._publish(rec.owner, Change("sandbox", rec.sandbox_id, rec.model_dump(mode="json")))

    def publish_snapshot(self, doc: dict) -> None:
        if not self._subscribers:
            return
        rec = SnapshotRecord.model_validate(doc)
        if rec.kind != SnapshotKind.USER or rec.internal:
            return  # a pause's or a fork's: not listed, not shown
        self._publish(rec.owner,
                      Change("snapshot", rec.snapshot_id, rec.model_dump(mode="json")))

    def _publish(self, owner: str | None, change: Change) -> None:
        for who, queue in list(self._subscribers):
            if not who.sees(owner):
                continue
            try:
                queue.put_nowait(change)
            except asyncio.QueueFull:
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(RELOAD)

    async def subscribe(self, who: Principal, keepalive: float | None = None
                        ) -> AsyncIterator[Change | None]:
        """The changes `who` may see, as they happen; None every `keepalive` seconds of
        silence (for the caller to send something that keeps the connection open)."""
        entry = (who, asyncio.Queue[Change](QUEUE))
        self._subscribers.add(entry)
        try:
            while True:
                try:
                    yield await asyncio.wait_for(entry[1].get(), keepalive)
                except TimeoutError:
                    yield None
        finally:
            self._subscribers.discard(entry)


class FeedingStore:
    """The metadata store, publishing each sandbox and snapshot saved to `events`: those it
    saves itself, or, on a store shared by hosts, those any host saves (as it notifies)."""

    def __init__(self, store: Any, events: Events) -> None:
        self._store = store
        self._events = events
        self._shared = hasattr(store, "on_sandbox_change")
        self._reads: set[asyncio.Task] = set()
        if self._shared:
            store.on_sandbox_change(
                lambda sid: self._read(store.get_sandbox, sid, events.publish_sandbox))
            store.on_snapshot_change(
                lambda sid: self._read(store.get_snapshot, sid, events.publish_snapshot))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _read(self, get: Callable[[str], Awaitable[dict | None]], record_id: str,
              publish: Callable[[dict], None]) -> None:
        """A change another host (or this one) notified: read and publish the record."""
        if not self._events.subscribers:
            return  # the hot path pays nothing while no console is open
        task = asyncio.get_running_loop().create_task(self._publish_read(get, record_id,
                                                                          publish))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    @staticmethod
    async def _publish_read(get: Callable[[str], Awaitable[dict | None]], record_id: str,
                            publish: Callable[[dict], None]) -> None:
        try:
            doc = await get(record_id)
        except Exception:  # noqa: BLE001 - a lost change only delays a view; never the store
            return
        if doc is not None:
            publish(doc)

    async def put_sandbox(self, sandbox_id: str, state: str, host: str, doc: dict) -> None:
        await self._store.put_sandbox(sandbox_id, state, host, doc)
        if not self._shared:
            self._events.publish_sandbox(doc)

    async def put_snapshot(self, snapshot_id: str, name: str | None, state: str, host: str,
                           doc: dict, created_at: float) -> None:
        await self._store.put_snapshot(snapshot_id, name, state, host, doc, created_at)
        if not self._shared:
            self._events.publish_snapshot(doc)
