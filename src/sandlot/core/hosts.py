"""The hosts of a deployment: this host's registration and heartbeat, lost hosts, placement.

Every `sandlot serve` sharing one database (PostgreSQL) is a host. Each writes a heartbeat
with what it can still take (`Room`) every `heartbeat_interval` seconds; each also marks hosts
silent for `host_timeout` seconds `lost`, with their running sandboxes, in one transaction
(the store's row locks make that happen once). Placement orders the hosts that can take a
new sandbox: room first, then those that can give its image's guest its CPU (each host
advertises its accelerator and CPU: vmm/cpu.py), then those whose cache already holds its
image, then this host, then the least loaded. With SQLite (one host) there is nothing to
place: everything is local.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel

from sandlot.config import Settings
from sandlot.core.background import stop_task
from sandlot.core.db import HostRow, MetadataStore
from sandlot.errors import CapacityError, NotFoundError
from sandlot.runtime.base import VM_OVERHEAD_MB, HostCpu, MachineDescription, Runtime

log = logging.getLogger(__name__)
LOST_REASON = "its host {host} stopped answering"


class HostState(StrEnum):
    ACTIVE = "active"
    DRAINING = "draining"  # takes no new sandboxes; those it runs run to their end
    LOST = "lost"  # stopped heartbeating: its sandboxes are `lost`
    STOPPED = "stopped"  # shut down cleanly


class HostInfo(BaseModel):
    """A host of the deployment, as `GET /v1/hosts` shows it."""

    id: str
    url: str
    state: HostState
    cores: int = 0
    memory_mb: int = 0
    memory_free_mb: int = 0  # beyond its reserve
    disk_free_mb: int = 0
    cache_free_mb: int = 0
    slots: int = 0  # sandboxes it may run (SANDLOT_MAX_SANDBOXES)
    sandboxes: int = 0  # sandboxes it runs
    heartbeat_age_s: float = 0.0

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.sandboxes)


@dataclass(frozen=True)
class Need:
    """What a new sandbox asks of a host."""

    memory_mb: int
    image_key: str | None = None  # a snapshot id or tpl-<build>: preferred where cached
    disk_mb: int = 0  # its disk (0: the deployment's SANDLOT_DISK_QUOTA_MB)
    count: int = 1
    machine: MachineDescription | None = None  # its image's: hosts that can run it first


def _info(row: HostRow) -> HostInfo:
    doc = row.doc
    return HostInfo(id=row.host_id, url=row.url, state=row.state,
                    heartbeat_age_s=round(row.age, 2),
                    **{k: doc.get(k, 0) for k in ("cores", "memory_mb", "memory_free_mb",
                                                  "disk_free_mb", "cache_free_mb", "slots",
                                                  "sandboxes")})


class Hosts:
    """This host in the deployment, and what it knows of the others."""

    def __init__(self, settings: Settings, db: MetadataStore, runtime: Runtime, host_id: str,
                 running: Callable[[], int]) -> None:
        self.settings = settings
        self.db = db
        self.runtime = runtime
        self.id = host_id
        self.url = settings.advertise_url or ""
        self.state = HostState.ACTIVE
        self._running = running
        self._cached: dict[str, tuple[str, ...]] = {}  # host -> image keys its cache holds
        self._cpus: dict[str, tuple[str, HostCpu]] = {}  # host -> its accelerator and CPU
        self._task: asyncio.Task | None = None
        self._connected_since: float | None = None  # of this run of good heartbeats
        # called when this host finds itself marked lost (it was silent too long) and is back
        self.on_back: Callable[[], Awaitable[None]] | None = None

    @property
    def shared(self) -> bool:
        """Several hosts may share the store: place, forward and watch for lost hosts."""
        return self.db.shared

    # ---- this host ------------------------------------------------------------------------

    def _doc(self) -> dict:
        room = self.runtime.room()
        return {"cores": os.cpu_count() or 1, "memory_mb": _mem_total_mb(),
                "memory_free_mb": room.memory_free_mb, "disk_free_mb": room.disk_free_mb,
                "cache_free_mb": room.cache_free_mb, "slots": self.settings.max_sandboxes,
                "sandboxes": self._running(), "cached": list(room.cached),
                **_cpu_doc(self.runtime.cpu())}

    async def heartbeat(self) -> None:
        was = None
        if self.shared:
            was = next((r.state for r in await self.db.hosts() if r.host_id == self.id), None)
        await self.db.heartbeat(self.id, self.url, self.state.value, self._doc())
        if was == HostState.LOST and self.on_back is not None:
            log.warning("host %s was marked lost and is back", self.id)
            await self.on_back()

    async def start(self, url: str) -> None:
        self.url = self.settings.advertise_url or url
        await self.heartbeat()
        self._connected_since = time.monotonic()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await stop_task(self._task)
        with contextlib.suppress(Exception):
            await self.db.set_host_state(self.id, HostState.STOPPED.value)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                await self.heartbeat()
                now = time.monotonic()
                if self._connected_since is None:
                    self._connected_since = now
                # Only a host that has reached the database for a whole timeout judges others:
                # after an outage of the database every host is silent for a while, and the
                # first one back must not take the others for lost.
                if self.shared and now - self._connected_since >= self.settings.host_timeout:
                    lost = await self.db.mark_lost(self.settings.host_timeout, LOST_REASON)
                    for host in lost:
                        log.warning("host %s stopped answering: its sandboxes are lost", host)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the heartbeat must keep going
                self._connected_since = None
                log.warning("heartbeat failed: %s", e)

    # ---- the deployment -------------------------------------------------------------------

    async def list(self) -> list[HostInfo]:
        rows = await self.db.hosts()
        self._cached = {r.host_id: tuple(r.doc.get("cached") or ()) for r in rows}
        self._cpus = {r.host_id: (str(r.doc["accel"]), HostCpu.from_doc(r.doc["cpu"]))
                      for r in rows if r.doc.get("accel") and isinstance(r.doc.get("cpu"), dict)}
        for r in rows:
            if r.host_id == self.id and r.state in (HostState.ACTIVE, HostState.DRAINING):
                self.state = HostState(r.state)
        return [_info(r) for r in rows]

    async def get(self, host_id: str) -> HostInfo:
        for info in await self.list():
            if info.id == host_id:
                return info
        raise NotFoundError(f"host {host_id!r} not found")

    async def set_state(self, host_id: str, state: HostState) -> HostInfo:
        """Drain a host (no new sandboxes) or make it active again."""
        info = await self.get(host_id)
        if info.state in (HostState.LOST, HostState.STOPPED) and state == HostState.ACTIVE:
            raise NotFoundError(f"host {host_id} is {info.state.value}; it becomes active "
                                "when it runs again")
        await self.db.set_host_state(host_id, state.value)
        if host_id == self.id:
            self.state = state
        return await self.get(host_id)

    async def url_of(self, host_id: str) -> str | None:
        """The URL of a live host other than this one, or None (this host, or not live)."""
        if host_id == self.id:
            return None
        for row in await self.db.hosts():
            if row.host_id == host_id:
                live = row.state in (HostState.ACTIVE, HostState.DRAINING)
                return row.url if live and row.age < self.settings.host_timeout else None
        return None

    async def place(self, need: Need) -> list[HostInfo]:
        """The hosts that may take `need`, best first; CapacityError naming what each lacks
        when none can."""
        hosts = await self.list()
        fits, why = [], []
        for h in hosts:
            if h.state != HostState.ACTIVE or h.heartbeat_age_s >= self.settings.host_timeout:
                if h.state not in (HostState.STOPPED, HostState.LOST):
                    why.append(f"{h.id}: {h.state.value}")
                continue
            if h.id == self.id:  # fresher than its last heartbeat
                h.sandboxes, h.slots = self._running(), self.settings.max_sandboxes
            if h.free_slots < 1:
                why.append(f"{h.id}: all {h.slots} sandbox slots taken")
            elif h.memory_free_mb < need.memory_mb + VM_OVERHEAD_MB:
                why.append(f"{h.id}: {h.memory_free_mb} MiB free, needs "
                           f"{need.memory_mb + VM_OVERHEAD_MB} MiB")
            else:
                fits.append(h)
        if not fits:
            raise CapacityError(f"no host can take a {need.memory_mb} MiB sandbox: "
                                + ("; ".join(why) or "no host is active"))

        disk_mb = need.disk_mb or self.settings.disk_quota_mb

        def rank(h: HostInfo) -> tuple:
            cached = need.image_key is not None and need.image_key in self._cached.get(h.id, ())
            # A host short of disk for it (as of its last heartbeat) would refuse: tried last.
            return (not self._runs(h.id, need.machine), h.disk_free_mb < disk_mb, not cached,
                    h.id != self.id, -h.free_slots, -h.memory_free_mb)

        return sorted(fits, key=rank)


    def _runs(self, host_id: str, machine: MachineDescription | None) -> bool:
        """Whether that host can give `machine`'s guest its CPU (unknown: taken as yes). One
        that cannot is still tried last: its refusal says why."""
        cpu = self._cpus.get(host_id)
        return machine is None or cpu is None or not machine.cpu_problems(*cpu)


def _cpu_doc(cpu: tuple[str, HostCpu] | None) -> dict:
    return {} if cpu is None else {"accel": cpu[0], "cpu": cpu[1].to_doc()}


def _mem_total_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return 0
