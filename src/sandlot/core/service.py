"""The core service: the managers wired over one runtime, recovery after a restart, the reaper.

`Core` takes its machine layer: `QemuRuntime` in a server, `FakeRuntime` in fast tests. Every
manager is built here and depends only on what it is given (records, the runtime, managers
below it); none calls back up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass

from sandlot.config import Settings
from sandlot.core.background import stop_task
from sandlot.core.builds import TemplateBuilds
from sandlot.core.commands import Commands
from sandlot.core.db import open_store
from sandlot.core.events import Events, FeedingStore
from sandlot.core.files import Files
from sandlot.core.hosts import Hosts
from sandlot.core.ids import new_sandbox_id
from sandlot.core.live import LiveSandbox
from sandlot.core.models import SandboxRecord, SandboxState, to_doc, transition
from sandlot.core.placement import Peers, Placement
from sandlot.core.sandboxes import SandboxManager, policy_of
from sandlot.core.snapshots import SnapshotManager
from sandlot.core.templates import TemplateStore
from sandlot.core.tenancy import OPERATOR_TENANT, SYSTEM, Principal, tenant_of
from sandlot.core.usage import UsageSampler
from sandlot.errors import AuthenticationError, SandlotError
from sandlot.images.pipeline import image_of
from sandlot.runtime.base import Runtime

log = logging.getLogger(__name__)
KEY_CACHE_SECONDS = 5.0  # how long a key's check is remembered (a revoke takes this long)


@dataclass(frozen=True)
class Stats:
    sandboxes: dict[SandboxState, int]
    pool: dict
    memory_free_mb: int
    disk_free_mb: int
    disk_promised_mb: int
    free_slots: int
    snapshot_bytes: int
    stored_bytes: int


class Core:
    """Everything below the HTTP layer. `await start()` before use, `await stop()` after."""

    def __init__(self, settings: Settings, runtime: Runtime, peers: Peers | None = None
                 ) -> None:
        self.settings = settings
        self.runtime = runtime
        settings.ensure()
        self.host_id = settings.stable_host_id()
        self.events = Events()  # the records' changes, for live views (GET /v1/events)
        self.db = FeedingStore(open_store(settings.database_url, settings.db_path),
                               self.events)
        self.templates = TemplateStore(settings, runtime, self.db)
        self.builds = TemplateBuilds(settings, self.templates, runtime, self.db, self.host_id)
        self.builds.core = self
        self.snapshots = SnapshotManager(self.db, runtime, self.host_id)
        self.sandboxes = SandboxManager(settings, self.db, runtime, self.templates,
                                        self.snapshots, self.host_id)
        self.hosts = Hosts(settings, self.db, runtime, self.host_id,
                           running=lambda: len(self.sandboxes.live))
        self.hosts.on_back = self._remove_lost
        self.volumes = self.sandboxes.volumes
        self.placement = Placement(self.hosts, self.sandboxes, self.snapshots, peers)
        self.usage = UsageSampler(runtime, lambda: self.sandboxes.live,
                                  interval=settings.metrics_interval)
        self.commands = Commands(self.sandboxes.get_live, settings.limits,
                                 settings.command_grace)
        self.files = Files(self.sandboxes.get_live, settings.limits)
        self._reaper: asyncio.Task | None = None
        self._keys: dict[bytes, tuple[Principal, float]] = {}  # key digest -> (who, until)
        self._background: list[asyncio.Task] = []
        self._waking: set[asyncio.Task] = set()  # resumes by traffic to kept ports

    async def start(self, url: str = "") -> None:
        """Open the metadata store, recover, join the deployment (reachable at `url`)."""
        await self.db.open()
        await self.recover()
        await self.builds.recover()
        await self._reconcile_templates()
        warm = {}
        for name in self.settings.pool_templates if self.settings.pool_size else ():
            try:
                warm[name] = (await self.templates.source(name, SYSTEM)).image
            except SandlotError as e:
                log.warning("warm pool: template %r: %s", name, e.message)
        self.runtime.keep_warm(warm, new_sandbox_id)
        self._background = [asyncio.create_task(self._import_templates()),
                            asyncio.create_task(self._gc_loop()),
                            asyncio.create_task(self._wake_loop())]
        await self.runtime.start()
        await self.hosts.start(url)
        self.usage.start()
        self._reaper = asyncio.create_task(self._reap_loop())

    async def _wake_loop(self) -> None:
        """Traffic to a port a paused auto-resume sandbox kept (runtime `park_ports`)
        resumes it, as a use does."""
        while True:
            sandbox_id = await self.runtime.wanted()
            task = asyncio.create_task(self._wake(sandbox_id))
            self._waking.add(task)
            task.add_done_callback(self._waking.discard)

    async def _wake(self, sandbox_id: str) -> None:
        """Resume the sandbox for its tenant, placed as any resume: its connections wait
        for it here, or end when it runs on another host or cannot come back now."""
        log.info("sandbox %s: traffic to a port it kept resumes it", sandbox_id)
        try:
            rec = await self.sandboxes.get(sandbox_id, SYSTEM)
            await self.placement.resume_on_use(sandbox_id, tenant_of(rec.owner))
        except SandlotError as e:
            log.warning("sandbox %s: resume by traffic failed: %s", sandbox_id, e.message)
        if self.sandboxes.is_running(sandbox_id, SYSTEM):
            return  # its start here adopted the kept ports: the connections go on
        with contextlib.suppress(SandlotError):
            rec = await self.sandboxes.get(sandbox_id, SYSTEM)
            if rec.state == SandboxState.STARTING and rec.host == self.host_id:
                return  # another call resumes it here: its start adopts the ports
        self.sandboxes.refuse_traffic(sandbox_id)

    async def stop(self, kill_sandboxes: bool = False) -> None:
        await self.usage.stop()
        await self.hosts.stop()
        for task in [self._reaper, *self._background, *self._waking]:
            await stop_task(task)
        await self.snapshots.close()
        lives = list(self.sandboxes.live.values())
        await self.runtime.close([lv.vm for lv in lives], kill=kill_sandboxes)
        for live in lives:
            if kill_sandboxes:
                live.record.pid = None
                transition(live.record, SandboxState.STOPPED)
                await self.db.put_sandbox(live.sandbox_id, live.record.state.value,
                                          self.host_id, to_doc(live.record))
        self.sandboxes.live.clear()
        await self.db.close()

    def pool_stats(self) -> dict:
        """The warm pool's state per template (ready, claimed, misses)."""
        return self.runtime.pool_stats()

    async def stats(self, states: tuple[SandboxState, ...]) -> Stats:
        """What `/metrics` reports: sandboxes in each of `states` (starting and running ones
        of this host, the others of the deployment), the warm pool, free memory and slots,
        and the bytes of ready snapshots (as taken, and as stored)."""
        mine = self.host_id if self.db.shared else None
        counts = {}
        for state in states:
            here = state in (SandboxState.STARTING, SandboxState.RUNNING)
            counts[state] = len(await self.db.sandboxes((state.value,),
                                                        host=mine if here else None))
        ready = await self.db.snapshots(("ready",))
        room = self.runtime.room()
        return Stats(sandboxes=counts, pool=self.runtime.pool_stats(),
                     memory_free_mb=room.memory_free_mb, disk_free_mb=room.disk_free_mb,
                     disk_promised_mb=room.disk_promised_mb,
                     free_slots=self.sandboxes.free_slots(),
                     snapshot_bytes=sum(d.get("size_bytes") or 0 for d in ready),
                     stored_bytes=sum(d.get("stored_bytes") or 0 for d in ready))

    async def deployment_secret(self, name: str) -> str:
        """A secret every host of the deployment shares ("" with one host: none needed)."""
        return await self.db.secret(name) if self.db.shared else ""

    async def add_admin_key(self, key: str) -> None:
        """An operator's key (SANDLOT_API_KEY in the server's environment): sees everything."""
        await self.db.add_key(key, OPERATOR_TENANT, admin=True)

    async def authenticate(self, key: str | None) -> Principal:
        """Who an API key acts for; AuthenticationError if it is not a key of the deployment.
        A check is remembered for a few seconds (a revoked key is refused after that)."""
        if not key:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(key.encode()).digest()
        cached = self._keys.get(digest)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        found = await self.db.key_principal(key)
        if found is None:
            self._keys.pop(digest, None)
            raise AuthenticationError("invalid API key")
        who = Principal(tenant=found[0], admin=found[1])
        if len(self._keys) > 10_000:
            self._keys.clear()
        self._keys[digest] = (who, time.monotonic() + KEY_CACHE_SECONDS)
        return who

    async def _remove_lost(self) -> None:
        """This host was marked lost (silent too long) and answers again: the sandboxes the
        deployment reported lost are gone for their users, so their VMs go too."""
        for live in list(self.sandboxes.live.values()):
            doc = await self.db.get_sandbox(live.sandbox_id)
            if doc is not None and doc.get("state") == SandboxState.LOST.value:
                log.warning("sandbox %s was reported lost: removing it", live.sandbox_id)
                transition(live.record, SandboxState.LOST)
                live.record.error = doc.get("error")
                async with live.lock:
                    await self.sandboxes.teardown(live, SandboxState.STOPPED)

    async def _reconcile_templates(self) -> None:
        """Before anything restores from them: where the store has another build of a local
        template (same hash, built on another host), take the store's, so a snapshot is
        restored over the root filesystem it was taken on, whichever host took it."""
        for info in self.templates.list():
            try:
                if await self.runtime.reconcile_template(image_of(info)):
                    log.warning("template %s: took the store's build %s", info.name, info.hash)
            except SandlotError as e:
                log.warning("template %s not compared with the store's: %s", info.name,
                            e.message)

    @property
    def templates_stored(self) -> bool:
        """Whether the start-up pass that gives the store this host's templates is over."""
        return bool(self._background) and self._background[0].done()

    async def _import_templates(self) -> None:
        """Give the store the templates this host built that it lacks (a new store): their
        chunks are what snapshots of their sandboxes are stored against. The warm pool's
        templates first."""
        pooled = set(self.settings.pool_templates)
        for info in sorted(self.templates.list(), key=lambda i: i.name not in pooled):
            try:
                if await self.runtime.import_template(image_of(info), info.model_dump(
                        mode="json")):
                    log.info("stored template %s (%s)", info.name, info.hash)
            except SandlotError as e:
                log.warning("template %s not stored: %s", info.name, e.message)

    async def _gc_loop(self) -> None:
        """The store's garbage collection, now and then (a store shared by several servers
        is safe with each running it: storage/gc.py)."""
        while True:
            await asyncio.sleep(self.settings.gc_interval)
            try:
                await self.runtime.collect_garbage(self.settings.gc_grace)
            except SandlotError as e:
                log.warning("store GC failed: %s", e.message)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval)
            try:
                await self.sandboxes.reap_expired()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("reaper failed")

    async def recover(self) -> None:
        """Re-adopt running sandboxes whose VM still runs; mark the others stopped. The
        runtime removes everything else an earlier server left (VMs, disks, networks, local
        files no sandbox, template or snapshot needs)."""
        ready = await self.snapshots.recover()
        mine = self.host_id if self.db.shared else None
        recs = [SandboxRecord.model_validate(d)
                for d in await self.db.sandboxes(("starting", "running"), host=mine)]
        for doc in await self.db.sandboxes(("lost",), host=mine):
            rec = SandboxRecord.model_validate(doc)  # reported lost while this host was away
            transition(rec, SandboxState.STOPPED)
            await self.db.put_sandbox(rec.sandbox_id, rec.state.value, self.host_id,
                                      to_doc(rec))
        running = {r.sandbox_id: policy_of(r) for r in recs if r.state == SandboxState.RUNNING}
        keep = ready | {f"tpl-{t.hash}" for t in self.templates.list()}
        adopted = await self.runtime.recover(running, keep)
        for rec in recs:
            vm = adopted.get(rec.sandbox_id)
            if vm is not None:
                rec.pid = vm.pid
                self.sandboxes.live[rec.sandbox_id] = LiveSandbox(
                    rec, vm, key_streams=self.sandboxes.key_streams)
            else:
                rec.pid = None
                rec.error = rec.error or "lost when the server restarted"
                with contextlib.suppress(SandlotError):
                    transition(rec, SandboxState.STOPPED)
            await self.db.put_sandbox(rec.sandbox_id, rec.state.value, self.host_id,
                                      to_doc(rec))
        if adopted:
            log.info("re-adopted %d sandboxes", len(adopted))
