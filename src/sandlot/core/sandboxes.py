"""Sandboxes: create (always a restore, or a claim from the warm pool), fork, rollback,
time-to-live, network rules, kill. Commands and files in them: core/commands.py, core/files.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
from datetime import timedelta

from sandlot.core.commands import exec_fields
from sandlot.core.config import Settings
from sandlot.core.models import (
    CreateSandbox,
    ExecRequest,
    NetworkSpec,
    SandboxRecord,
    SandboxState,
    now,
    to_doc,
    transition,
)
from sandlot.core.pool import WarmPool
from sandlot.core.runtime import LiveSandbox, new_generation
from sandlot.core.snapshots import SnapshotManager
from sandlot.core.sources import HotCache, Source
from sandlot.core.store import MetadataStore
from sandlot.core.templates import TemplateStore
from sandlot.errors import (
    GuestError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
    VmmError,
)
from sandlot.guest.client import AgentClient, configure_fields
from sandlot.vmm import hotplug
from sandlot.vmm import snapshot as vmm_snapshot
from sandlot.vmm.disk import create_overlay
from sandlot.vmm.machine import MAX_CPUS, MachineSpec

log = logging.getLogger(__name__)
MAX_FORK = 64
POOL_WARM_UP = "true"  # a pooled sandbox's first command, so a user's first one finds it warm
PARALLEL_RESTORES = 8


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(5)


class SandboxManager:
    def __init__(self, settings: Settings, db: MetadataStore, hot: HotCache,
                 templates: TemplateStore, snapshots: SnapshotManager, network=None) -> None:
        self.settings = settings
        self.db = db
        self.hot = hot
        self.templates = templates
        self.snapshots = snapshots
        self.network = network
        self.live: dict[str, LiveSandbox] = {}
        self.pool: WarmPool | None = None  # set by Core when the warm pool is on
        self._restore_slots = asyncio.Semaphore(PARALLEL_RESTORES)
        snapshots.in_use = self._source_in_use
        snapshots.on_sandbox_changed = lambda live: self._save(live.record)

    # ---- records --------------------------------------------------------------------------

    def _save(self, rec: SandboxRecord) -> None:
        self.db.put_sandbox(rec.sandbox_id, rec.state.value, to_doc(rec))

    def _source_in_use(self, key: str) -> bool:
        return any(lv.record.source_key == key for lv in self.live.values())

    def get_live(self, sandbox_id: str) -> LiveSandbox:
        live = self.live.get(sandbox_id)
        if live is None:
            rec = self.db.get_sandbox(sandbox_id)
            if rec is None:
                raise NotFoundError(f"sandbox {sandbox_id!r} not found")
            raise NotFoundError(f"sandbox {sandbox_id!r} is not running "
                                f"(state: {rec.get('state')})")
        return live

    def get(self, sandbox_id: str) -> SandboxRecord:
        live = self.live.get(sandbox_id)
        if live is not None:
            return live.record
        doc = self.db.get_sandbox(sandbox_id)
        if doc is None:
            raise NotFoundError(f"sandbox {sandbox_id!r} not found")
        return SandboxRecord.model_validate(doc)

    def list(self, metadata: dict[str, str] | None = None,
             all: bool = False) -> list[SandboxRecord]:
        if all:
            recs = [SandboxRecord.model_validate(d) for d in self.db.sandboxes()]
        else:
            recs = [lv.record for lv in self.live.values()]
        if metadata:
            recs = [r for r in recs if all_items_in(metadata, r.metadata)]
        return sorted(recs, key=lambda r: r.created_at)

    # ---- create / restore -----------------------------------------------------------------

    def resolve_source(self, req: CreateSandbox) -> Source:
        if req.snapshot_id:
            return self.snapshots.source(req.snapshot_id)
        return self.templates.source(req.template or "base")

    async def create(self, req: CreateSandbox) -> SandboxRecord:
        """A new sandbox from a template or a snapshot (a restore either way, never a boot)."""
        if req.template and req.snapshot_id:
            raise InvalidArgumentError("give either template or snapshot_id, not both")
        source = self.resolve_source(req)
        rec = self._new_record(source, req)
        if self.pool is not None and (pooled := self.pool.take(source, req)) is not None:
            try:
                return await self._claim(pooled, rec.model_copy())
            except SandlotError as e:  # e.g. its VM died while pooled: restore one instead
                log.warning("pooled sandbox %s could not be claimed: %s", pooled.sandbox_id, e)
                await self._dispose(pooled)
        await self._start(rec, source)
        return rec

    async def _claim(self, live: LiveSandbox, rec: SandboxRecord) -> SandboxRecord:
        """Give a pooled sandbox the identity `rec` asks for (its id aside), and register it."""
        rec.sandbox_id = live.sandbox_id  # its run dir, disk dir and namespace are named so
        rec.pid = live.machine.pid
        live.record = rec
        agent = await live.session()
        pooled_cpus = live.machine.spec.cpus
        # Reseeds the RNG too; onlines or offlines vCPUs (QEMU always has MAX_CPUS of them).
        await agent.configure(env=rec.env, generation=rec.generation,
                              cpus=rec.cpus if rec.cpus != pooled_cpus else None)
        if rec.cpus != pooled_cpus:
            live.machine.spec = live.machine.spec.with_(cpus=rec.cpus)
            live.machine.spec.save()
        await agent.sync_clock()
        if self.network is not None and (not rec.internet or rec.network):
            await self.network.update(rec)
        self._register(live)
        return rec

    async def make_pooled(self, template: str) -> tuple[LiveSandbox, Source]:
        """A restored, warmed-up sandbox of `template` for the warm pool (not registered)."""
        source = self.templates.source(template)
        rec = self._new_record(source, CreateSandbox(template=template))
        live = await self.restore_unregistered(rec, source)
        try:
            fields = exec_fields(live, ExecRequest(cmd=POOL_WARM_UP)) | {"track": False}
            async for header, _ in live.agent.stream("exec", **fields):
                if header.get("event") == "exit":
                    break
        except BaseException:
            await self._dispose(live)
            raise
        return live, source

    def _new_record(self, source: Source, req: CreateSandbox) -> SandboxRecord:
        source.check_loadable()
        memory = req.memory_mb or (source.memory_mb + source.dimm_mb)
        cpus = req.cpus or source.cpus
        extra = hotplug.check_overrides(source.memory_mb, source.dimm_mb, memory, cpus)
        timeout = self.settings.default_timeout if req.timeout is None else req.timeout
        created = now()
        return SandboxRecord(
            sandbox_id=new_sandbox_id(), template=source.template,
            snapshot_id=source.snapshot_id, memory_mb=memory, cpus=cpus,
            env={**source.env, **(req.env or {})}, metadata=dict(req.metadata or {}),
            created_at=created, timeout=timeout,
            expires_at=created + timedelta(seconds=timeout) if timeout else None,
            internet=req.internet, network=req.network, generation=new_generation(),
            source_key=source.key, base=source.build.name, workdir=source.workdir,
            hotplug_mb=extra,
        )

    async def _start(self, rec: SandboxRecord, source: Source) -> LiveSandbox:
        """Restore `source` into the sandbox `rec` describes, and register it as live."""
        self._save(rec)
        try:
            live = await self.restore_unregistered(rec, source)
        except BaseException as e:
            rec.error = str(e) if isinstance(e, SandlotError) else f"{type(e).__name__}: {e}"
            with contextlib.suppress(SandlotError):
                transition(rec, SandboxState.FAILED)
                self._save(rec)
            if isinstance(e, SandlotError) or not isinstance(e, Exception):
                raise
            raise VmmError(f"sandbox failed to start: {rec.error}") from e
        self._register(live)
        return live

    def _register(self, live: LiveSandbox) -> None:
        transition(live.record, SandboxState.RUNNING)
        self.live[live.sandbox_id] = live
        self._save(live.record)

    async def restore_unregistered(self, rec: SandboxRecord, source: Source) -> LiveSandbox:
        """Restore `source` for `rec`: VM, disk, network, agent session, clock set. On failure
        everything it made is gone again. The caller registers the result (or pools it)."""
        run_dir = self.settings.run_root / rec.sandbox_id
        disk_dir = self.settings.disks_dir / rec.sandbox_id
        machine = None
        net = None
        connecting: asyncio.Task | None = None
        try:
            async with self._restore_slots:
                hot = await self.hot.ensure(source)
                run_dir.mkdir(parents=True, exist_ok=True)
                disk_dir.mkdir(parents=True, exist_ok=True)
                disk = disk_dir / f"disk-{rec.disk_index}.qcow2"
                overlay = create_overlay(disk, hot["disk"], "qcow2", source.rootfs.stat().st_size)
                if self.network is not None:
                    results = await asyncio.gather(overlay, self.network.attach(rec),
                                                   return_exceptions=True)
                    net = results[1] if not isinstance(results[1], BaseException) else None
                    for result in results:
                        if isinstance(result, BaseException):
                            raise result
                else:
                    await overlay
                spec = MachineSpec(
                    run_dir=run_dir, kernel=source.kernel, initrd=source.initrd, disk=disk,
                    memory_mb=source.memory_mb, cpus=source.cpus, accel=self.settings.accel,
                    ram_path=hot["ram"], ram_share=False,
                    dimm_mb=source.dimm_mb, dimm_path=hot.get("dimm"),
                )
                if net is not None:
                    spec = spec.with_(netdev=net.qemu_netdev()[-1],
                                      exec_prefix=tuple(net.netns_exec_prefix()))
                for attempt in (1, 2):
                    machine = await vmm_snapshot.restore(spec, hot["devstate"])
                    await hotplug.apply(machine, rec.hotplug_mb)
                    machine.spec = machine.spec.with_(cpus=rec.cpus)
                    machine.spec.save()
                    # Connect before the VM runs: the snapshot was taken with a host connected,
                    # so the port's state then matches and the guest gets no close/open events,
                    # which QEMU may drop (see AgentClient.connect). Hello and configure wait in
                    # the socket until the guest runs.
                    connecting = asyncio.create_task(AgentClient.connect(
                        str(spec.agent_socket), timeout=15, configure=configure_fields(
                            env=rec.env, generation=rec.generation,
                            cpus=rec.cpus if rec.cpus != source.cpus else None)))
                    await machine.wait_chardev_connected("agent")
                    await machine.execute("cont")
                    try:
                        agent = await connecting
                        break
                    except GuestError as e:
                        console = machine.console_tail()
                        await machine.kill()
                        machine = None
                        if attempt == 2:
                            raise GuestError(f"{e.message}; guest console: {console}") from e
                        # Start over from the snapshot, on a fresh overlay.
                        log.warning("sandbox %s: the restored guest did not answer (%s); "
                                    "console: %s; restoring again", rec.sandbox_id, e.message,
                                    console or "empty")
                        disk.unlink(missing_ok=True)
                        await create_overlay(disk, hot["disk"], "qcow2",
                                             source.rootfs.stat().st_size)
            await agent.sync_clock()
        except BaseException:
            if connecting is not None and not connecting.done():
                connecting.cancel()
            if machine is not None:
                await machine.kill()
            if net is not None:
                with contextlib.suppress(Exception):
                    await self.network.detach(rec.sandbox_id)
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(disk_dir, ignore_errors=True)
            raise
        rec.pid = machine.pid
        return LiveSandbox(record=rec, machine=machine, agent=agent, run_dir=run_dir,
                           disk_dir=disk_dir, network=net)

    # ---- lifecycle ------------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        live = self.live.pop(sandbox_id, None)
        if live is None:
            self.get_live(sandbox_id)  # raises the right NotFoundError
            return
        await self._teardown(live, SandboxState.STOPPED)

    async def _teardown(self, live: LiveSandbox, state: SandboxState) -> None:
        self.live.pop(live.sandbox_id, None)
        await self._dispose(live)
        rec = live.record
        rec.pid = None
        transition(rec, state)
        self._save(rec)
        self.snapshots.release(rec.source_key)

    async def _dispose(self, live: LiveSandbox) -> None:
        """Stop the VM and remove its network, run dir and disks."""
        await live.shutdown()
        if self.network is not None:
            with contextlib.suppress(Exception):
                await self.network.detach(live.sandbox_id)
        shutil.rmtree(live.run_dir, ignore_errors=True)
        shutil.rmtree(live.disk_dir, ignore_errors=True)

    def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        if timeout < 0 or timeout > self.settings.max_timeout:
            raise InvalidArgumentError(
                f"timeout must be between 0 and {self.settings.max_timeout} seconds")
        rec = self.get_live(sandbox_id).record
        rec.timeout = timeout
        rec.expires_at = now() + timedelta(seconds=timeout) if timeout else None
        self._save(rec)
        return rec

    async def reap_expired(self) -> list[str]:
        t = now()
        expired = [lv for lv in self.live.values()
                   if lv.record.expires_at is not None and lv.record.expires_at <= t]
        dead = [lv for lv in self.live.values() if lv.machine.exited and lv not in expired]
        for live in expired:
            log.info("sandbox %s reached its timeout", live.sandbox_id)
            await self._teardown(live, SandboxState.STOPPED)
        for live in dead:
            log.warning("sandbox %s: QEMU exited on its own: %s", live.sandbox_id,
                        live.machine.log_tail(300))
            live.record.error = "the VM exited unexpectedly"
            await self._teardown(live, SandboxState.FAILED)
        return [lv.sandbox_id for lv in expired + dead]

    # ---- network --------------------------------------------------------------------------

    def _networking(self):
        if self.network is None:
            raise InvalidArgumentError("sandbox networking is off on this server "
                                       "(SANDLOT_NETWORK=off or not running as root)")
        return self.network

    async def expose_port(self, sandbox_id: str, port: int) -> tuple[str, int]:
        """A host address and port that reach `port` inside the sandbox."""
        self.get_live(sandbox_id)
        return await self._networking().expose(sandbox_id, port)

    async def set_network(self, sandbox_id: str, internet: bool | None,
                          network: NetworkSpec | None) -> SandboxRecord:
        """Change a running sandbox's egress rules (applied outside the guest, atomically)."""
        live = self.get_live(sandbox_id)
        net = self._networking()
        rec = live.record.model_copy()
        if internet is not None:
            rec.internet = internet
        if network is not None:
            rec.network = network
        await net.update(rec)
        live.record.internet, live.record.network = rec.internet, rec.network
        self._save(live.record)
        return live.record

    # ---- snapshots, fork, rollback --------------------------------------------------------

    def snapshot(self, sandbox_id: str, name: str | None = None):
        live = self.get_live(sandbox_id)
        rec = self.snapshots.begin(live, name)
        self.snapshots.run_in_background(live, rec)
        return rec

    async def fork(self, sandbox_id: str, count: int) -> list[SandboxRecord | SandlotError]:
        """`count` children of the sandbox's current state; each succeeds or fails alone."""
        if not 1 <= count <= MAX_FORK:
            raise InvalidArgumentError(f"count must be between 1 and {MAX_FORK}")
        live = self.get_live(sandbox_id)
        snap = self.snapshots.begin(live, None, internal=True)
        await self.snapshots.capture(live, snap, pause=True)  # quicker; the children wait
        self.snapshots.finish_internal(snap)
        source = self.snapshots.source_of(snap)
        parent = live.record
        req = CreateSandbox(memory_mb=parent.memory_mb, cpus=parent.cpus, env=parent.env,
                            timeout=parent.timeout, metadata=parent.metadata,
                            internet=parent.internet, network=parent.network)

        async def child() -> SandboxRecord:
            rec = self._new_record(source, req)
            rec.template = parent.template
            await self._start(rec, source)
            return rec

        results = await asyncio.gather(*(child() for _ in range(count)), return_exceptions=True)
        out: list[SandboxRecord | SandlotError] = []
        for r in results:
            if isinstance(r, SandlotError | SandboxRecord):
                out.append(r)
            elif isinstance(r, Exception):
                out.append(VmmError(f"{type(r).__name__}: {r}"))
            else:
                raise r
        self.snapshots.release(snap.snapshot_id)
        return out

    async def rollback(self, sandbox_id: str, snapshot: str) -> SandboxRecord:
        """Return the sandbox to `snapshot`'s state, keeping its id, metadata and timeout."""
        live = self.get_live(sandbox_id)
        source = self.snapshots.source(snapshot)
        await self.hot.ensure(source)
        async with live.lock:
            self.live.pop(sandbox_id, None)
            await live.shutdown()
            if self.network is not None:
                with contextlib.suppress(Exception):
                    await self.network.detach(sandbox_id)
            shutil.rmtree(live.disk_dir, ignore_errors=True)
            old_key = live.record.source_key
            rec = live.record
            transition(rec, SandboxState.STARTING)
            rec.snapshot_id = source.snapshot_id
            rec.source_key = source.key
            rec.base = source.build.name
            rec.memory_mb, rec.cpus = source.memory_mb + source.dimm_mb, source.cpus
            rec.hotplug_mb = 0
            rec.env = {**source.env, **{k: v for k, v in rec.env.items()
                                        if k not in source.env}}
            rec.generation = new_generation()
            rec.disk_index = 0
            await self._start(rec, source)
        self.snapshots.release(old_key)
        return rec

    async def restore_as(self, sandbox_id: str, snapshot: str,
                         timeout: int | None = None) -> SandboxRecord:
        """Start a stopped sandbox again from `snapshot`, under its old id, env and metadata.

        E2B's pause and resume are a snapshot and a kill, then this.
        """
        old = self.get(sandbox_id)
        if sandbox_id in self.live or old.state != SandboxState.STOPPED:
            raise InvalidStateError(f"sandbox {sandbox_id} is {old.state.value}",
                                    current=old.state.value, allowed=("stopped",))
        source = self.snapshots.source(snapshot)
        req = CreateSandbox(env=old.env, metadata=old.metadata, internet=old.internet,
                            network=old.network,
                            timeout=old.timeout if timeout is None else timeout)
        rec = self._new_record(source, req)
        rec.sandbox_id = sandbox_id
        rec.template = old.template
        await self._start(rec, source)
        return rec

    # ---- shutdown -------------------------------------------------------------------------

    async def close(self, kill: bool) -> None:
        """Disconnect from every sandbox; `kill` also stops their VMs."""
        for live in list(self.live.values()):
            if kill:
                await self._teardown(live, SandboxState.STOPPED)
            else:
                with contextlib.suppress(Exception):
                    await live.agent.close()
                await live.machine.disconnect()
        self.live.clear()


def all_items_in(wanted: dict[str, str], have: dict[str, str]) -> bool:
    return all(have.get(k) == v for k, v in wanted.items())


__all__ = ["SandboxManager", "MAX_CPUS"]
