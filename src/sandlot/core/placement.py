"""Where new sandboxes run, in a deployment of several hosts (core/hosts.py ranks them).

A create, restore or resume that another host should take is asked of it through `Peers`
(the server implements it over HTTP); a fork whose children do not all fit on the parent's
host (or all of them, when it is draining) starts the rest elsewhere from one snapshot of the
parent. A sandbox with volumes mounted (and a snapshot of one, with memory) runs on the
volumes' host only, where their files are: its create, restore, resume and fork children go
there or fail with CapacityError naming that host, never elsewhere. With one host (SQLite), or
for a call a peer placed here already, everything is local. REST and E2B routes make the same
calls, so both spread and place alike.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from sandlot.core.hosts import HostInfo, Hosts, HostState, Need
from sandlot.core.models import (
    CreateSandbox,
    SandboxOverrides,
    SandboxRecord,
    SandboxState,
    SnapshotRecord,
    SnapshotState,
    overrides_of,
)
from sandlot.core.sandboxes import MAX_FORK, Forked, SandboxManager
from sandlot.core.snapshots import SnapshotManager
from sandlot.core.sources import Source
from sandlot.core.tenancy import SYSTEM, Principal
from sandlot.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
    StorageError,
)
from sandlot.runtime.base import MachineDescription

log = logging.getLogger(__name__)
DEFAULT_MEMORY_MB = 512
SPREAD_SNAPSHOT_WAIT = 600.0


class Peers(Protocol):
    """What core asks of the deployment's other hosts. Each call acts for `who` there and
    raises the peer's error as the typed `SandlotError` (CapacityError: no room after all)."""

    async def create(self, host: HostInfo, req: CreateSandbox, who: Principal,
                     forked_from: str | None = None) -> SandboxRecord: ...

    async def resume(self, host: HostInfo, sandbox_id: str, timeout: int | None,
                     reboot: bool, who: Principal) -> SandboxRecord: ...


class Placement:
    """Creates, forks and resumes, placed on the deployment's hosts."""

    def __init__(self, hosts: Hosts, sandboxes: SandboxManager, snapshots: SnapshotManager,
                 peers: Peers | None = None) -> None:
        self.hosts = hosts
        self.sandboxes = sandboxes
        self.snapshots = snapshots
        self.peers = peers

    def _placing(self, placed: bool) -> bool:
        """Whether to place (a deployment with peers, and not placed here by a peer)."""
        return self.hosts.shared and self.peers is not None and not placed

    async def create(self, req: CreateSandbox, who: Principal, *, placed: bool = False,
                     forked_from: str | None = None) -> SandboxRecord:
        """A new sandbox of `who`'s, on the host placement picks (`placed`: a peer picked
        this one)."""
        if not self._placing(placed):
            return await self.sandboxes.create(req, forked_from, who=who)
        try:
            source = await self.sandboxes.resolve_source(req, who)
        except SandlotError:
            source = None  # the create here or there says why
        need = _need(req, source)
        home = await self._volumes_home(req, source, who)
        if not home:
            return await self._start_on(await self.hosts.place(need), req, who, forked_from)
        try:
            return await self._start_on(await self._at_home(need, home), req, who,
                                        forked_from)
        except CapacityError as e:
            if e.message.startswith(AWAY):
                raise
            raise away(home, e.message) from None

    async def _volumes_home(self, req: CreateSandbox, source: Source | None, who: Principal
                            ) -> str | None:
        """The host a new sandbox's volumes live on: those it mounts, and those its
        snapshot has mounted (None: it has none)."""
        homes = {(await self.sandboxes.volumes.get(m.volume, who)).host
                 for m in req.volume_mounts}
        if source is not None and source.volume_host:
            homes.add(source.volume_host)
        if len(homes) > 1:
            raise InvalidArgumentError("these volumes live on different hosts; a sandbox "
                                       "mounts volumes of one host")
        return homes.pop() if homes else None

    async def _at_home(self, need: Need, home: str) -> list[HostInfo]:
        """[`home`], the host of a sandbox's volumes, if it may take `need`: the sandbox runs
        there only. CapacityError naming it if not (draining, lost, or, this host, full).
        Another active host whose last heartbeat said it was full is asked all the same:
        that report lags the sandboxes it has ended since, and it answers for itself."""
        try:
            picked = [h for h in await self.hosts.place(need) if h.id == home]
        except CapacityError:
            picked = []
        if picked:
            return picked
        known = {h.id: h for h in await self.hosts.list()}
        if home not in known:
            raise away(home, "it is not a host of this deployment")
        info = known[home]
        if info.state != HostState.ACTIVE:
            raise away(home, f"it is {info.state.value}")
        if info.heartbeat_age_s >= self.hosts.settings.host_timeout:
            raise away(home, f"it has not reported for {info.heartbeat_age_s:.0f} s")
        if home == self.hosts.id:  # placement counted this host's room as of now
            raise away(home, "no room")
        return [info]

    async def resume(self, sandbox_id: str, timeout: int | None = None, reboot: bool = False,
                     *, who: Principal, placed: bool = False) -> SandboxRecord:
        """A paused sandbox back under its id, on whichever host placement picks."""
        if self._placing(placed):
            rec = await self.sandboxes.get(sandbox_id, who)
            if rec.state == SandboxState.PAUSED and rec.paused_snapshot:
                snap = await self._snapshot(rec.paused_snapshot, who)
                need = Need(memory_mb=rec.memory_mb, image_key=rec.paused_snapshot,
                            machine=_machine(snap.machine) if snap else None)
                # its volume mounts are in its memory: a resume that boots has none
                home = None if reboot else snap.volume_host if snap else rec.volume_host
                hosts = await self._at_home(need, home) if home else await self.hosts.place(
                    need)
                for host in hosts:
                    if host.id == self.hosts.id:
                        break
                    try:
                        rec = await self.peers.resume(host, sandbox_id, timeout, reboot, who)
                    except CapacityError as e:
                        if home:
                            raise away(home, e.message) from None
                        log.info("host %s could not resume %s (%s); trying the next",
                                 host.id, sandbox_id, e.message)
                        continue
                    self.sandboxes.resumed_elsewhere(sandbox_id)
                    return rec
        return await self.sandboxes.resume(sandbox_id, timeout, reboot, who=who)

    async def resume_on_use(self, sandbox_id: str, who: Principal, *, placed: bool = False
                            ) -> SandboxRecord | None:
        """A paused sandbox made with `auto_resume` comes back when a request of `who` (its
        tenant) needs it running, placed as `resume` places it: its record (which names the
        host it now runs on) if it was resumed now or meanwhile, else None."""
        if self.sandboxes.is_running(sandbox_id, SYSTEM):
            return None
        try:
            rec = await self.sandboxes.get(sandbox_id, who)
        except NotFoundError:
            return None
        if rec.state != SandboxState.PAUSED or not rec.auto_resume:
            return None
        try:
            return await self.resume(sandbox_id, who=who, placed=placed)
        except InvalidStateError:  # resumed meanwhile
            return await self.sandboxes.get(sandbox_id, who)

    async def fork(self, sandbox_id: str, count: int, who: Principal,
                   timeout: int | None = None) -> Forked:
        """`count` children of the sandbox, of `who`'s tenant (with the parent's timeout, or
        `timeout`): on its host as far as it has room, the rest on other hosts (with volumes
        mounted: those past its room fail). A paused sandbox forks from its paused state,
        wherever there is room (with volumes mounted: on their host)."""
        if not self.sandboxes.is_running(sandbox_id, who):
            parent = await self.sandboxes.get(sandbox_id, who)
            if parent.state == SandboxState.PAUSED and parent.paused_snapshot:
                return await self.fork_snapshot(parent.paused_snapshot, count, who,
                                                overrides_of(parent, timeout),
                                                forked_from=sandbox_id)
        here = self._children_here(count)
        if here == count:
            return await self.sandboxes.fork(sandbox_id, count, who=who, timeout=timeout)
        home = (self.sandboxes.running(sandbox_id, who).volume_host
                if self.sandboxes.is_running(sandbox_id, who) else None)
        children: list[SandboxRecord | SandlotError] = []
        pause_ms = 0.0
        if here:
            forked = await self.sandboxes.fork(sandbox_id, here, who=who, timeout=timeout)
            children, pause_ms = list(forked.children), forked.pause_ms
        if home:  # its children have its volumes mounted: on their host only
            why = (f"it is {self.hosts.state.value}" if self.hosts.state != HostState.ACTIVE
                   else f"{here} of the {count} children fit there")
            children += [away(home, why)] * (count - here)
        else:
            children += await self._spread(sandbox_id, count - here, who, timeout)
        return Forked(children, pause_ms)

    async def fork_snapshot(self, id_or_name: str, count: int, who: Principal,
                            overrides: SandboxOverrides | None = None,
                            forked_from: str | None = None) -> Forked:
        """`count` new sandboxes of `who`'s from a ready snapshot, no running parent needed:
        spread over the hosts with room (each starts where the snapshot is cached first),
        each with `overrides`; each succeeds or fails alone. `forked_from`: the paused
        sandbox whose state the snapshot is."""
        if not 1 <= count <= MAX_FORK:
            raise InvalidArgumentError(f"count must be between 1 and {MAX_FORK}")
        source = await self.snapshots.source(id_or_name, who)  # ready, and `who`'s
        fields = (overrides or SandboxOverrides()).model_dump(exclude_unset=True)
        req = CreateSandbox(**fields, snapshot_id=source.snapshot_id)
        if not self._placing(False):
            hosts = [HostInfo(id=self.hosts.id, url="", state=HostState.ACTIVE)]
        else:
            need = Need(memory_mb=req.memory_mb or source.image.machine.memory_mb,
                        image_key=source.snapshot_id, machine=source.image.machine,
                        disk_mb=req.disk_mb or 0)
            try:
                if source.volume_host:
                    hosts = await self._at_home(need, source.volume_host)
                else:
                    hosts = await self.hosts.place(need)
            except CapacityError as e:
                return Forked([e] * count, 0.0)
        return Forked(await self._start_spread(hosts, count, req, who, forked_from), 0.0)

    async def _start_on(self, hosts: list[HostInfo], req: CreateSandbox, who: Principal,
                        forked_from: str | None) -> SandboxRecord:
        """One sandbox on the first of `hosts` that has room: this host by a create here,
        the others through `Peers`; CapacityError from each means the next."""
        last = CapacityError("no host has room for the sandbox")
        for host in hosts:
            try:
                if host.id == self.hosts.id:
                    return await self.sandboxes.create(req, forked_from, who=who)
                return await self.peers.create(host, req, who, forked_from)
            except CapacityError as e:
                log.info("host %s had no room after all (%s); trying the next", host.id,
                         e.message)
                last = e
        raise last

    async def _start_spread(self, hosts: list[HostInfo], count: int, req: CreateSandbox,
                            who: Principal, forked_from: str | None
                            ) -> list[SandboxRecord | SandlotError]:
        """`count` sandboxes of `req` spread over `hosts` by free slots (each tries its own
        host first, then the others); each succeeds or fails alone."""
        async def child(first: int) -> SandboxRecord | SandlotError:
            try:
                return await self._start_on(hosts[first:] + hosts[:first], req, who,
                                            forked_from)
            except SandlotError as e:
                return e

        return list(await asyncio.gather(*(child(i) for i in spread(hosts, count))))

    def _children_here(self, count: int) -> int:
        if not self._placing(False):
            return count
        if self.hosts.state != HostState.ACTIVE:
            return 0
        return min(count, self.sandboxes.free_slots())

    async def _snapshot(self, snapshot_id: str, who: Principal) -> SnapshotRecord | None:
        """A snapshot's record (None: not readable here)."""
        try:
            return await self.snapshots.get(snapshot_id, who)
        except SandlotError:
            return None

    async def _spread(self, parent_id: str, count: int, who: Principal,
                      timeout: int | None) -> list[SandboxRecord | SandlotError]:
        """`count` children of `parent_id` on other hosts: one snapshot of the parent,
        restored where placement puts each child (spread by free slots); the snapshot goes
        once they run."""
        parent = await self.sandboxes.get(parent_id, who)
        snap = await self.sandboxes.snapshot(parent_id, internal=True, who=who)
        try:
            snap = await self.snapshots.wait(snap.snapshot_id, SPREAD_SNAPSHOT_WAIT, who=who)
            if snap.state != SnapshotState.READY:
                error = StorageError(f"the parent's state could not be stored for children on "
                                     f"other hosts: {snap.error or snap.state.value}")
                return [error] * count
            req = CreateSandbox(snapshot_id=snap.snapshot_id,
                                **overrides_of(parent, timeout).model_dump())
            try:
                hosts = [h for h in await self.hosts.place(Need(
                    memory_mb=parent.memory_mb, image_key=snap.snapshot_id,
                    machine=_machine(snap.machine)))
                    if h.id != self.hosts.id]
            except CapacityError as e:
                return [e] * count
            return await self._start_spread(hosts, count, req, who, parent_id)
        finally:
            try:
                await self.snapshots.delete(snap.snapshot_id, who=who)
            except SandlotError as e:
                log.warning("fork snapshot %s not deleted: %s", snap.snapshot_id, e.message)


def _need(req: CreateSandbox, source: Source | None) -> Need:
    """What a create asks of a host: its memory, and its image (cached hosts first)."""
    if source is None:
        return Need(memory_mb=req.memory_mb or DEFAULT_MEMORY_MB, disk_mb=req.disk_mb or 0)
    return Need(memory_mb=req.memory_mb or source.image.machine.memory_mb,
                image_key=source.image.key, machine=source.image.machine,
                disk_mb=req.disk_mb or 0)


AWAY = "this sandbox's volumes live on host"


def away(home: str, why: str) -> CapacityError:
    """A sandbox with volumes mounted that its volumes' host cannot take now."""
    return CapacityError(f"{AWAY} {home}, the only host it can run on, and {home} cannot "
                         f"take it now: {why}")


def _machine(doc: dict | None) -> MachineDescription | None:
    try:
        return MachineDescription.from_dict(doc) if doc else None
    except SandlotError:
        return None


def spread(hosts: list[HostInfo], count: int) -> list[int]:
    """Which host (an index into `hosts`, best first) each of `count` children goes to: the
    one with the most free slots left each time, ties to the better ranked."""
    if not hosts:
        return [0] * count
    free = [max(h.free_slots, 0) for h in hosts]
    plan = []
    for _ in range(count):
        i = max(range(len(hosts)), key=lambda j: (free[j], -j))
        plan.append(i)
        free[i] -= 1
    return plan
