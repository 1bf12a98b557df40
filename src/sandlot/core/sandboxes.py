"""Sandboxes: create (a claim of a warm VM, or a restore: never a boot), fork, rollback, pause
and resume, time-to-live, network rules, kill. Commands and files in them: core/commands.py,
core/files.py. Every VM comes from the runtime; this module keeps records and lifecycles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import timedelta

from sandlot.config import Settings
from sandlot.core.db import MetadataStore
from sandlot.core.ids import new_generation, new_sandbox_id
from sandlot.core.limits import check_disk, check_egress, check_env, check_metadata
from sandlot.core.live import KeyStreams, LiveSandbox
from sandlot.core.models import (
    CreateSandbox,
    MountedVolume,
    NetworkSpec,
    SandboxRecord,
    SandboxState,
    SnapshotKind,
    SnapshotState,
    now,
    overrides_of,
    to_doc,
    transition,
)
from sandlot.core.snapshots import SnapshotManager
from sandlot.core.sources import Source
from sandlot.core.templates import TemplateStore
from sandlot.core.tenancy import NOBODY, SYSTEM, Principal, tenant_of
from sandlot.core.volumes import Volumes
from sandlot.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
    StorageError,
    VmmError,
)
from sandlot.runtime.base import MachinePlan, NetworkPolicy, Runtime

log = logging.getLogger(__name__)
MAX_FORK = 64
PAUSE_CAPTURE_WAIT = 120.0
PAUSE_READY_WAIT = 600.0
ENDED_KEPT = 4096
# what a listing shows unless asked for other states
LISTED = (SandboxState.STARTING, SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.LOST)


def policy_of(rec: SandboxRecord) -> NetworkPolicy:
    net = rec.network
    return NetworkPolicy(internet=rec.internet,
                         allow_out=tuple(net.allow_out) if net else (),
                         deny_out=tuple(net.deny_out) if net else (),
                         dns_servers=tuple(net.dns_servers or ()) if net else ())


def plan_of(rec: SandboxRecord) -> MachinePlan:
    return MachinePlan(cpus=rec.cpus, memory_mb=rec.memory_mb, env=dict(rec.env),
                       generation=rec.generation, network=policy_of(rec), disk_mb=rec.disk_mb)


class SandboxManager:
    def __init__(self, settings: Settings, db: MetadataStore, runtime: Runtime,
                 templates: TemplateStore, snapshots: SnapshotManager, host_id: str) -> None:
        self.settings = settings
        self.db = db
        self.host_id = host_id
        self.runtime = runtime
        self.templates = templates
        self.snapshots = snapshots
        self.live: dict[str, LiveSandbox] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # of sandboxes with no VM (paused)
        # last known (state, tenant) of sandboxes not running here
        self._ended: dict[str, tuple[str, str | None]] = {}
        self._pausing: set[str] = set()  # paused at their timeout, now
        # Exposed ports of paused auto-resume sandboxes, still listening (guest -> host).
        self._parked_ports: dict[str, dict[int, tuple[str, int]]] = {}
        self._tasks: set[asyncio.Task] = set()
        # Per tenant on this host: streams open, and creates under way (not live yet).
        self.key_streams = KeyStreams(settings.limits.key_streams)
        self._starting: dict[str, int] = {}
        self._launching: set[str] = set()  # sandboxes whose VMs start here now
        self.volumes = Volumes(db, runtime, host_id)

    # ---- records --------------------------------------------------------------------------

    async def _save(self, rec: SandboxRecord) -> None:
        if rec.state in (SandboxState.STARTING, SandboxState.RUNNING):
            rec.host = self.host_id
        elif rec.state in (SandboxState.STOPPED, SandboxState.FAILED, SandboxState.PAUSED):
            self.seen(rec.sandbox_id, rec.state.value, rec.owner)
        await self.db.put_sandbox(rec.sandbox_id, rec.state.value, rec.host or self.host_id,
                                  to_doc(rec))

    def seen(self, sandbox_id: str, state: str, owner: str | None) -> None:
        """Remember the state of a sandbox that does not run here (for error messages)."""
        self._ended.pop(sandbox_id, None)
        self._ended[sandbox_id] = (state, owner)
        while len(self._ended) > ENDED_KEPT:
            self._ended.pop(next(iter(self._ended)))

    def get_live(self, sandbox_id: str, who: Principal) -> LiveSandbox:
        """The sandbox's VM on this host, or NotFoundError (also for another tenant's)."""
        live = self.live.get(sandbox_id)
        if live is None or not who.sees(live.record.owner):
            state, owner = self._ended.get(sandbox_id, (None, None))
            if state is not None and live is None and who.sees(owner):
                raise NotFoundError(f"sandbox {sandbox_id!r} is not running (state: {state})")
            raise NotFoundError(f"sandbox {sandbox_id!r} not found or not running")
        return live

    def running(self, sandbox_id: str, who: Principal) -> SandboxRecord:
        """The record of a sandbox running on this host, or NotFoundError (also for another
        tenant's)."""
        return self.get_live(sandbox_id, who).record

    async def refresh(self, sandbox_id: str, seconds: int, who: Principal) -> None:
        """Keep a running sandbox at least `seconds` more (E2B's refresh: never shortens)."""
        rec = self.running(sandbox_id, who)
        if rec.expires_at is not None and now() + timedelta(seconds=seconds) > rec.expires_at:
            await self.set_timeout(sandbox_id, seconds, who=who)

    def running_here(self) -> list[str]:
        """The ids of the sandboxes this host runs."""
        return list(self.live)

    async def running_elsewhere(self) -> list[tuple[str, str]]:
        """(sandbox id, host) of the running sandboxes of the deployment's other hosts."""
        return [(d["sandbox_id"], d["host"]) for d in await self.db.sandboxes(("running",))
                if d.get("host") and d.get("host") != self.host_id]

    async def locate(self, sandbox_id: str) -> Location | None:
        """Where a sandbox is, for routing a request about it to its host (whose answer,
        not this one, checks who asks); None if there is no such sandbox. A sandbox not
        running here is remembered for error messages."""
        live = self.live.get(sandbox_id)
        if live is not None:
            return Location(self.host_id, live.record.state, live.record.owner)
        doc = await self.db.get_sandbox(sandbox_id)
        if doc is None:
            return None
        location = Location(doc.get("host"), SandboxState(doc.get("state")), doc.get("owner"))
        self.seen(sandbox_id, location.state.value, location.owner)
        return location

    def holder_of(self, sandbox_id: str) -> Principal:
        """Who a credential of one running sandbox (an envd access token, a URL signed with
        it) acts for: the sandbox's tenant (a sandbox not running here: nobody)."""
        live = self.live.get(sandbox_id)
        return tenant_of(live.record.owner) if live else NOBODY

    def is_running(self, sandbox_id: str, who: Principal) -> bool:
        """Whether the sandbox runs on this host and `who` sees it."""
        live = self.live.get(sandbox_id)
        return live is not None and who.sees(live.record.owner)

    async def get(self, sandbox_id: str, who: Principal) -> SandboxRecord:
        live = self.live.get(sandbox_id)
        if live is not None:
            rec = live.record
        else:
            doc = await self.db.get_sandbox(sandbox_id)
            rec = SandboxRecord.model_validate(doc) if doc is not None else None
        if rec is None or not who.sees(rec.owner):
            raise NotFoundError(f"sandbox {sandbox_id!r} not found")
        return rec

    async def list(self, metadata: dict[str, str] | None = None, all: bool = False,
                   states: tuple[SandboxState, ...] | None = None, *,
                   who: Principal) -> list[SandboxRecord]:
        """Running, paused and lost sandboxes of every host (or those in `states`); `all`:
        every record. This host's running ones come from memory, the rest from the store.
        Only `who`'s tenant's (an admin: every tenant's)."""
        if all:
            docs = await self.db.sandboxes()
        else:
            docs = await self.db.sandboxes(tuple(s.value for s in LISTED))
        recs = [lv.record for lv in self.live.values()]
        recs += [r for r in (SandboxRecord.model_validate(d) for d in docs)
                 if r.sandbox_id not in self.live]
        recs = [r for r in recs if who.sees(r.owner)]
        if states:
            recs = [r for r in recs if r.state in states]
        if metadata:
            recs = [r for r in recs if all_items_in(metadata, r.metadata)]
        return sorted(recs, key=lambda r: r.created_at)

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        live = self.live.get(sandbox_id)
        if live is not None:
            return live.lock
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    # ---- create / restore -----------------------------------------------------------------

    async def resolve_source(self, req: CreateSandbox, who: Principal) -> Source:
        if req.snapshot_id:
            return await self.snapshots.source(req.snapshot_id, who)
        if req.image:
            return await self.templates.image_source(req.image)
        source = await self.templates.source(req.template or "base", who)
        if source.started_from:  # built through the API: the snapshot its build took
            snap = await self.snapshots.source(source.started_from, tenant_of(source.owner))
            return replace(snap, template=source.template, env=source.env,
                           workdir=source.workdir, user=source.user)
        if source.template in self.settings.pool_templates:
            # a rebuild retargets it
            self.runtime.keep_warm({source.template: source.image}, new_sandbox_id)
        return source

    async def create(self, req: CreateSandbox, forked_from: str | None = None, *,
                     who: Principal) -> SandboxRecord:
        """A new sandbox of `who`'s tenant from a template or a snapshot (a restore either
        way, never a boot), counted against the tenant's limits; `forked_from`: the parent
        of a fork child started here for another host."""
        if sum(1 for s in (req.template, req.snapshot_id, req.image) if s) > 1:
            raise InvalidArgumentError("give one of template, snapshot_id or image")
        self.check_request(req)
        self.check_room()
        owner = who.tenant
        mounts = await self.volumes.resolve(req.volume_mounts, who) if req.volume_mounts else []
        async with self._admitted(owner):
            source = await self.resolve_source(req, who)
            self._check_volume_host(source.volume_host, f"snapshot {source.snapshot_id}")
            async with self.snapshots.holding(source.snapshot_id):  # a delete waits for it
                rec = self._new_record(source, req)
                rec.forked_from, rec.owner = forked_from, owner
                if mounts:
                    rec.volume_host = self.host_id
                    rec.volume_mounts += [MountedVolume(name=info.name, path=m.path)
                                          for info, m in mounts]
                vm = await self.runtime.claim(source.image, plan_of(rec))
                if vm is not None:  # a pooled VM, already given the record's identity
                    rec.sandbox_id = vm.id  # its run dir, disks and namespace are named so
                    rec.pid = vm.pid
                    live = LiveSandbox(rec, vm)
                    await self._register(live)
                else:
                    live = await self._start(rec, source)
            if mounts:
                try:
                    await self.volumes.mount(live.vm, mounts)
                except BaseException:
                    await self.teardown(live, SandboxState.FAILED)
                    raise
        return rec

    def _check_volume_host(self, volume_host: str | None, what: str) -> None:
        """A sandbox with volumes mounted runs on their host only (their files are there)."""
        if volume_host and volume_host != self.host_id:
            raise CapacityError(f"{what} has volumes of host {volume_host} mounted: it runs "
                                f"on that host only, not on {self.host_id}")

    def check_room(self, count: int = 1) -> None:
        """Room on this host for `count` more sandboxes (SANDLOT_MAX_SANDBOXES)."""
        running, slots = self._occupied(), self.settings.max_sandboxes
        if running + count > slots:
            raise CapacityError(f"host {self.host_id} runs {running} of its {slots} sandboxes "
                                f"(SANDLOT_MAX_SANDBOXES); {count} more do not fit")

    @contextlib.asynccontextmanager
    async def _admitted(self, owner: str | None, count: int = 1) -> AsyncIterator[None]:
        """Room for `count` more sandboxes of tenant `owner` in the deployment
        (SANDLOT_MAX_KEY_SANDBOXES), held while they start here."""
        limit = self.settings.limits.key_sandboxes
        if not owner or not limit:
            yield
            return
        elsewhere = 0
        if self.db.shared:  # those running on the deployment's other hosts count too
            elsewhere = sum(1 for d in await self.db.sandboxes(("starting", "running"))
                            if d.get("owner") == owner and d.get("host") != self.host_id)
        # Checked and counted with no await between: concurrent creates see each other.
        have = elsewhere + self._starting.get(owner, 0) + sum(
            1 for lv in self.live.values() if lv.record.owner == owner)
        if have + count > limit:
            raise CapacityError(f"this tenant runs {have} sandboxes, its limit "
                                f"(SANDLOT_MAX_KEY_SANDBOXES={limit}); {count} more do not fit")
        self._starting[owner] = self._starting.get(owner, 0) + count
        try:
            yield
        finally:
            self._starting[owner] -= count
            if not self._starting[owner]:
                del self._starting[owner]

    def free_slots(self) -> int:
        return max(0, self.settings.max_sandboxes - self._occupied())

    def _occupied(self) -> int:
        """This host's slots in use: its running sandboxes and those starting."""
        return len(self._launching.union(self.live))

    def check_request(self, req: CreateSandbox) -> None:
        """The caller's env, metadata and egress rules are within the limits."""
        limits = self.settings.limits
        check_env(limits, req.env)
        check_metadata(limits, req.metadata)
        check_disk(limits, req.disk_mb)
        if req.network is not None:
            check_egress(limits, req.network.allow_out, req.network.deny_out,
                         req.network.dns_servers)

    def _new_record(self, source: Source, req: CreateSandbox,
                    sandbox_id: str | None = None) -> SandboxRecord:
        image = source.image
        memory = req.memory_mb or image.machine.memory_mb
        cpus = req.cpus or image.machine.cpus
        timeout = self.settings.default_timeout if req.timeout is None else req.timeout
        created = now()
        rec = SandboxRecord(
            sandbox_id=sandbox_id or new_sandbox_id(), template=source.template,
            snapshot_id=source.snapshot_id, memory_mb=memory, cpus=cpus, disk_mb=req.disk_mb,
            env={**source.env, **(req.env or {})}, metadata=dict(req.metadata or {}),
            created_at=created, timeout=timeout,
            expires_at=created + timedelta(seconds=timeout) if timeout else None,
            internet=req.internet, network=req.network, generation=new_generation(),
            on_timeout=req.on_timeout, pause_memory=req.pause_memory,
            auto_resume=req.auto_resume, image_key=image.key, build=image.build,
            workdir=source.workdir, user=source.user, public_traffic=req.public_traffic,
            volume_mounts=list(source.volume_mounts), volume_host=source.volume_host,
        )
        self.runtime.check_plan(image, plan_of(rec))
        return rec

    async def _start(self, rec: SandboxRecord, source: Source, boot: bool = False,
                     failed: SandboxState = SandboxState.FAILED) -> LiveSandbox:
        """Restore `source` into the sandbox `rec` describes (`boot`: boot from its disk),
        and register it as live; if that fails, the record goes to `failed`. CapacityError
        if this host has no slot left: those starting count, so concurrent starts (a fork's
        children) see each other."""
        if rec.sandbox_id not in self._launching:  # (a rollback's restart keeps its slot)
            self.check_room()
        self._launching.add(rec.sandbox_id)
        try:
            return await self._restore(rec, source, boot, failed)
        finally:
            self._launching.discard(rec.sandbox_id)

    async def _restore(self, rec: SandboxRecord, source: Source, boot: bool,
                       failed: SandboxState) -> LiveSandbox:
        await self._save(rec)
        try:
            vm = await self.runtime.restore(source.image, plan_of(rec), rec.sandbox_id,
                                            boot=boot)
        except BaseException as e:
            rec.error = str(e) if isinstance(e, SandlotError) else f"{type(e).__name__}: {e}"
            with contextlib.suppress(SandlotError):
                transition(rec, failed)
                await self._save(rec)
            if isinstance(e, SandlotError) or not isinstance(e, Exception):
                raise
            raise VmmError(f"sandbox failed to start: {rec.error}") from e
        rec.pid = vm.pid
        live = LiveSandbox(rec, vm)
        await self._register(live)
        return live

    async def _register(self, live: LiveSandbox) -> None:
        live.key_streams = self.key_streams
        live.record.disk_mb = live.vm.disk_mb or live.record.disk_mb  # its image's, if more
        transition(live.record, SandboxState.RUNNING)
        live.record.error = None
        self.live[live.sandbox_id] = live
        await self._save(live.record)

    # ---- lifecycle ------------------------------------------------------------------------

    async def kill(self, sandbox_id: str, *, who: Principal) -> None:
        """Stop a sandbox for good (a paused one's state is deleted too)."""
        await self.get(sandbox_id, who)
        async with self._lock(sandbox_id):
            live = self.live.get(sandbox_id)
            if live is not None:
                await self.teardown(live, SandboxState.STOPPED)
                return
            rec = await self.get(sandbox_id, who)
            away = rec.host not in (None, self.host_id) and rec.state in (
                SandboxState.RUNNING, SandboxState.STARTING)
            if rec.state == SandboxState.LOST or away:
                # Its host is gone (or not answering: a request about a sandbox of a live
                # host is answered there). Close the record; the host, when it runs again,
                # removes the VM of a sandbox no longer running in the records.
                rec.error = rec.error or f"killed while its host {rec.host} was not answering"
                transition(rec, SandboxState.STOPPED)
                await self._save(rec)
                return
            if rec.state != SandboxState.PAUSED:
                raise NotFoundError(f"sandbox {sandbox_id!r} is not running "
                                    f"(state: {rec.state.value})")
            self._drop_parked_ports(sandbox_id)
            await self._drop_pause_snapshot(rec)
            transition(rec, SandboxState.STOPPED)
            await self._save(rec)
        self._locks.pop(sandbox_id, None)

    async def teardown(self, live: LiveSandbox, state: SandboxState) -> None:
        """End the sandbox's VM; its record says `state` before the VM goes, so no reader
        sees it neither running nor in its new state."""
        rec = live.record
        transition(rec, state)
        self.live.pop(live.sandbox_id, None)
        pid, rec.pid = rec.pid, None
        await self._save(rec)
        try:
            await self.runtime.kill(live.vm)
        except BaseException:
            log.warning("sandbox %s (pid %s): its VM did not go cleanly", live.sandbox_id, pid)
            raise

    async def set_timeout(self, sandbox_id: str, timeout: int, *, who: Principal
                          ) -> SandboxRecord:
        rec = self.get_live(sandbox_id, who).record
        if timeout < 0 or timeout > self.settings.max_timeout:
            raise InvalidArgumentError(
                f"timeout must be between 0 and {self.settings.max_timeout} seconds")
        rec.timeout = timeout
        rec.expires_at = now() + timedelta(seconds=timeout) if timeout else None
        await self._save(rec)
        return rec

    async def reap_expired(self) -> list[str]:
        t = now()
        expired = [lv for lv in self.live.values()
                   if lv.record.expires_at is not None and lv.record.expires_at <= t]
        dead = [lv for lv in self.live.values() if lv.vm.exited and lv not in expired]
        for live in expired:
            if live.record.on_timeout == "pause":
                if live.sandbox_id not in self._pausing:
                    log.info("sandbox %s reached its timeout: pausing it", live.sandbox_id)
                    self._pausing.add(live.sandbox_id)
                    task = asyncio.create_task(self._pause_at_timeout(live))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                continue
            log.info("sandbox %s reached its timeout", live.sandbox_id)
            async with live.lock:
                if live.sandbox_id in self.live:
                    await self.teardown(live, SandboxState.STOPPED)
        for live in dead:
            log.warning("sandbox %s: its VM exited on its own: %s", live.sandbox_id,
                        live.vm.diagnostics())
            live.record.error = live.vm.exit_reason()
            async with live.lock:
                if live.sandbox_id in self.live:
                    await self.teardown(live, SandboxState.FAILED)
        return [lv.sandbox_id for lv in expired + dead]

    async def _pause_at_timeout(self, live: LiveSandbox) -> None:
        try:
            try:
                await self.pause(live.sandbox_id, who=SYSTEM)
            except SandlotError as e:
                if live.record.pause_memory or self.live.get(live.sandbox_id) is not live:
                    raise
                # A filesystem-only pause needs the guest's `sync`: keep memory instead of
                # losing everything to a kill.
                log.warning("sandbox %s: a filesystem-only pause failed (%s); pausing it with "
                            "memory", live.sandbox_id, e.message)
                await self.pause(live.sandbox_id, memory=True, who=SYSTEM)
        except SandlotError as e:
            log.warning("sandbox %s: pausing at its timeout failed, killing it: %s",
                        live.sandbox_id, e.message)
            async with live.lock:
                if self.live.get(live.sandbox_id) is live:
                    await self.teardown(live, SandboxState.STOPPED)
        finally:
            self._pausing.discard(live.sandbox_id)

    # ---- network --------------------------------------------------------------------------

    async def expose_port(self, sandbox_id: str, port: int, *, who: Principal
                          ) -> tuple[str, int]:
        """A host address and port that reach `port` inside the sandbox."""
        live = self.get_live(sandbox_id, who)
        if not 1 <= port <= 65535:
            raise InvalidArgumentError("port must be between 1 and 65535")
        async with live.ports_lock:  # one listener per port; at most `limits.ports` of them
            exposed = live.ports.get(port)
            if exposed is None:
                if len(live.ports) >= self.settings.limits.ports:
                    raise InvalidArgumentError(
                        f"sandbox {sandbox_id} already exposes {len(live.ports)} ports, the "
                        "limit (SANDLOT_MAX_PORTS)")
                owner, key_limit = live.record.owner, self.settings.limits.key_ports
                if owner and key_limit:
                    have = sum(len(lv.ports) for lv in self.live.values()
                               if lv.record.owner == owner)
                    if have >= key_limit:
                        raise InvalidArgumentError(
                            f"this tenant already exposes {have} ports across its sandboxes "
                            f"on this host, the limit (SANDLOT_MAX_KEY_PORTS)")
                exposed = live.ports[port] = await self.runtime.expose(live.vm, port)
        return exposed

    async def set_network(self, sandbox_id: str, internet: bool | None,
                          network: NetworkSpec | None, *, who: Principal) -> SandboxRecord:
        """Change a running sandbox's egress rules (applied outside the guest, atomically)."""
        live = self.get_live(sandbox_id, who)
        if network is not None:
            check_egress(self.settings.limits, network.allow_out, network.deny_out,
                         network.dns_servers)
        rec = live.record.model_copy()
        if internet is not None:
            rec.internet = internet
        if network is not None:
            rec.network = network
        await self.runtime.set_network(live.vm, policy_of(rec))
        live.record.internet, live.record.network = rec.internet, rec.network
        await self._save(live.record)
        return live.record

    # ---- snapshots, fork, rollback --------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str | None = None,
                       kind: SnapshotKind = SnapshotKind.USER, internal: bool = False,
                       memory: bool = True, *, who: Principal):
        """Start a snapshot of a running sandbox, of `who`'s tenant; it goes on in the
        background. Without `memory`, of its filesystem only: sandboxes made from it boot
        from that disk."""
        live = self.get_live(sandbox_id, who)
        rec = await self.snapshots.begin(live, name, kind, internal, memory=memory,
                                         owner=who.tenant)
        self.snapshots.start(live, rec)
        return rec

    async def fork(self, sandbox_id: str, count: int, *, who: Principal,
                   timeout: int | None = None) -> Forked:
        """`count` children of the sandbox's current state, of `who`'s tenant (with the
        parent's timeout, or `timeout`); each succeeds or fails alone."""
        live = self.get_live(sandbox_id, who)
        if not 1 <= count <= MAX_FORK:
            raise InvalidArgumentError(f"count must be between 1 and {MAX_FORK}")
        self.check_room(count)
        async with self._admitted(who.tenant, count):
            return await self._fork(live, count, who.tenant, timeout)

    async def _fork(self, live: LiveSandbox, count: int, owner: str,
                    timeout: int | None) -> Forked:
        parent = live.record
        key = "fork-" + secrets.token_hex(5)
        async with live.lock:
            captured = await self.runtime.capture(live.vm, key, persistent=False)
        try:
            source = Source(image=captured.image, env=dict(parent.env),
                            template=parent.template, workdir=parent.workdir,
                            user=parent.user, volume_mounts=tuple(parent.volume_mounts),
                            volume_host=parent.volume_host)
            req = CreateSandbox(**overrides_of(parent, timeout).model_dump())

            async def child() -> SandboxRecord:
                rec = self._new_record(source, req)
                rec.forked_from, rec.owner = parent.sandbox_id, owner
                await self._start(rec, source)
                return rec

            results = await asyncio.gather(*(child() for _ in range(count)),
                                           return_exceptions=True)
        finally:
            self.runtime.release(key)  # the children hold the image's files while they live
        out: list[SandboxRecord | SandlotError] = []
        for r in results:
            if isinstance(r, SandlotError | SandboxRecord):
                out.append(r)
            elif isinstance(r, Exception):
                out.append(VmmError(f"{type(r).__name__}: {r}"))
            else:
                raise r
        return Forked(out, captured.pause_ms)

    async def rollback(self, sandbox_id: str, snapshot: str, *, who: Principal
                       ) -> SandboxRecord:
        """Return the sandbox to `snapshot`'s state, keeping its id, metadata and timeout."""
        live = self.get_live(sandbox_id, who)
        source = await self.snapshots.source(snapshot, who)
        self._check_volume_host(source.volume_host, f"snapshot {source.snapshot_id}")
        async with self.snapshots.holding(source.snapshot_id):  # a delete waits for it
            return await self._rollback(live, source)

    async def _rollback(self, live: LiveSandbox, source: Source) -> SandboxRecord:
        sandbox_id = live.sandbox_id
        async with live.lock:
            if self.live.get(sandbox_id) is not live:
                raise NotFoundError(f"sandbox {sandbox_id!r} is no longer running")
            rec = live.record
            rec.snapshot_id = source.snapshot_id
            rec.image_key, rec.build = source.image.key, source.image.build
            rec.memory_mb, rec.cpus = source.image.machine.memory_mb, source.image.machine.cpus
            rec.volume_mounts, rec.volume_host = list(source.volume_mounts), source.volume_host
            rec.env = {**source.env, **{k: v for k, v in rec.env.items()
                                        if k not in source.env}}
            rec.generation = new_generation()
            self._launching.add(sandbox_id)  # its slot stays taken through the restart
            try:
                self.live.pop(sandbox_id, None)
                await self.runtime.kill(live.vm)
                transition(rec, SandboxState.STARTING)
                new = await self._start(rec, source)
            finally:
                self._launching.discard(sandbox_id)
            new.lock = live.lock
        return rec

    # ---- pause and resume -----------------------------------------------------------------

    async def pause(self, sandbox_id: str, memory: bool | None = None, *, who: Principal
                    ) -> SandboxRecord:
        """Keep the sandbox's whole state in a snapshot and stop its VM; `resume` brings it
        back under the same id. Answers once the state is stored. InvalidStateError if it
        is paused already. `memory` false (default: the sandbox's `pause_memory`): keep its
        filesystem only; the resume boots it from its disk."""
        await self.get(sandbox_id, who)  # another tenant's: not found, as a missing one
        if sandbox_id not in self.live:
            await self._check_not_paused(sandbox_id, who)
        live = self.get_live(sandbox_id, who)
        async with live.lock:
            if self.live.get(sandbox_id) is not live:
                await self._check_not_paused(sandbox_id, who)  # another pause got there first
                raise NotFoundError(f"sandbox {sandbox_id!r} is no longer running")
            rec = live.record
            keep_memory = rec.pause_memory if memory is None else memory
            snap = await self.snapshots.begin(live, None, SnapshotKind.PAUSE,
                                              memory=keep_memory, owner=rec.owner)
            try:
                captured = await self.snapshots.capture(live, snap)
            except CapacityError:  # no room for its state now: it keeps running
                raise
            except SandlotError as e:
                raise StorageError(f"sandbox {sandbox_id} could not be paused: {e.message}"
                                   ) from e
            rec.paused_snapshot = snap.snapshot_id
            if rec.auto_resume:  # traffic to its exposed ports brings it back (Core.start)
                kept = self.runtime.park_ports(live.vm)
                if kept:
                    self._parked_ports[sandbox_id] = kept
            await self.teardown(live, SandboxState.PAUSED)
            self._locks[sandbox_id] = live.lock
        try:
            await self.snapshots.upload(snap, captured)
        except SandlotError as e:
            # The state is lost: the sandbox cannot come back.
            self._drop_parked_ports(sandbox_id)
            rec.error = f"pausing failed: {e.message}"
            rec.paused_snapshot = None
            transition(rec, SandboxState.STOPPED)
            await self._save(rec)
            raise StorageError(f"sandbox {sandbox_id} could not be paused: {e.message}") from e
        finally:
            self.runtime.release(snap.snapshot_id)
        return rec

    async def _check_not_paused(self, sandbox_id: str, who: Principal) -> None:
        rec = await self.get(sandbox_id, who)
        if rec.state == SandboxState.PAUSED:
            raise InvalidStateError(f"sandbox {sandbox_id} is already paused; resume it first",
                                    current=rec.state.value, allowed=("running",))

    async def resume(self, sandbox_id: str, timeout: int | None = None,
                     reboot: bool = False, *, who: Principal) -> SandboxRecord:
        """Bring a paused sandbox back under its id (and its tenant): exactly where it was,
        or (paused without memory, or `reboot`) booted from its disk as it was at the
        pause."""
        await self.get(sandbox_id, who)
        async with self._lock(sandbox_id):
            rec = await self.get(sandbox_id, who)
            if rec.state != SandboxState.PAUSED or not rec.paused_snapshot:
                raise InvalidStateError(f"sandbox {sandbox_id} is {rec.state.value}",
                                        current=rec.state.value, allowed=("paused",))
            self.check_room()
            snap = await self.snapshots.wait(rec.paused_snapshot, PAUSE_READY_WAIT, who=SYSTEM)
            if snap.state != SnapshotState.READY:
                raise StorageError(f"sandbox {sandbox_id}'s paused state is {snap.state.value}"
                                   f": {snap.error or 'not stored'}")
            source = self.snapshots.source_of(snap)
            boot = reboot or not snap.memory
            if not boot:
                self._check_volume_host(snap.volume_host, f"sandbox {sandbox_id}")
            rec.image_key, rec.build = source.image.key, source.image.build
            if timeout is not None:
                rec.timeout = timeout
            rec.expires_at = now() + timedelta(seconds=rec.timeout) if rec.timeout else None
            rec.generation = new_generation()
            transition(rec, SandboxState.STARTING)
            try:  # a failure leaves it paused: its state is still there, it may try again
                await self._start(rec, source, boot=reboot, failed=SandboxState.PAUSED)
            except SandlotError:
                rec.error = None
                await self._save(rec)
                raise
            if boot and rec.volume_mounts:  # booted afresh: no mounts (they were memory)
                rec.volume_mounts, rec.volume_host = [], None
                await self._save(rec)
            await self._drop_pause_snapshot(rec)
            live = self.live.get(sandbox_id)
            if live is not None:  # the ports it exposed listened on through the pause
                live.ports.update(self._parked_ports.pop(sandbox_id, {}))
        self._locks.pop(sandbox_id, None)
        return rec

    def resumed_elsewhere(self, sandbox_id: str) -> None:
        """A sandbox paused here was resumed on another host: the ports it kept listening
        here close (they cannot reach it there)."""
        self._drop_parked_ports(sandbox_id)

    def refuse_traffic(self, sandbox_id: str) -> None:
        """End the connections that wait on a paused sandbox's kept ports: it is not
        coming back here now (its ports stay kept for the next)."""
        if sandbox_id in self._parked_ports:
            self.runtime.refuse_parked_ports(sandbox_id)

    def _drop_parked_ports(self, sandbox_id: str) -> None:
        if self._parked_ports.pop(sandbox_id, None) is not None:
            self.runtime.drop_parked_ports(sandbox_id)

    async def _drop_pause_snapshot(self, rec: SandboxRecord) -> None:
        if rec.paused_snapshot:
            with contextlib.suppress(SandlotError):
                await self.snapshots.delete(rec.paused_snapshot, who=SYSTEM)
            rec.paused_snapshot = None


@dataclass(frozen=True)
class Location:
    """Where a sandbox is: the host that runs it (or last ran it), its state, its tenant."""

    host: str | None
    state: SandboxState
    owner: str | None


@dataclass
class Forked:
    """A fork's children (each a record, or the error that stopped it), and how long the
    parent was paused for their capture."""

    children: list[SandboxRecord | SandlotError]
    pause_ms: float


def all_items_in(wanted: dict[str, str], have: dict[str, str]) -> bool:
    return all(have.get(k) == v for k, v in wanted.items())
