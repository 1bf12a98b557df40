"""A warm pool: sandboxes restored from a template ahead of demand.

Under TCG a fresh QEMU spends most of a create translating the guest code the agent's first
exchange runs (the translation cache starts empty on every restore). A pooled sandbox has
done that, and a warm-up command, before anyone asks: a create that finds one only gives it
its identity (fresh entropy, generation, env, clock, egress rules) and registers it.

Only creates with the template's own memory are served from the pool (CPUs are onlined or
offlined at the claim); everything else, and every create while the pool is empty, is an
ordinary restore. Pooled sandboxes are in no record: after a crash they are orphans like
any other and are cleaned up at the next start. Settings (core/config.py): SANDLOT_POOL_SIZE
(per template, default 2; 0 turns the pool off), SANDLOT_POOL_TEMPLATES (default "base").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sandlot.core.models import CreateSandbox
from sandlot.core.runtime import LiveSandbox
from sandlot.core.sources import Source
from sandlot.errors import SandlotError

log = logging.getLogger(__name__)

REFILL_DELAY = 0.25  # s after a claim: the claimed sandbox's first commands go first
RETRY_DELAYS = (1.0, 5.0, 30.0)


@dataclass
class PoolStats:
    size: int
    ready: int = 0  # filled in by `stats()`
    claimed: int = 0
    misses: int = 0
    failures: int = 0


@dataclass
class _Entry:
    live: LiveSandbox
    source_key: str


@dataclass
class WarmPool:
    """Pooled sandboxes per template name; `take` hands one out, a background task refills."""

    make: Callable[[str], Awaitable[tuple[LiveSandbox, Source]]]  # restore one, unregistered
    discard: Callable[[LiveSandbox], Awaitable[None]]
    templates: tuple[str, ...] = ("base",)
    size: int = 2
    _entries: dict[str, list[_Entry]] = field(default_factory=dict)
    _stats: dict[str, PoolStats] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None

    def start(self) -> None:
        for name in self.templates:
            self._entries.setdefault(name, [])
            self._stats.setdefault(name, PoolStats(size=self.size))
        if self.size and self.templates:
            self._task = asyncio.get_running_loop().create_task(self._refill_loop())
            self._wake.set()

    def take(self, source: Source, req: CreateSandbox) -> LiveSandbox | None:
        """A pooled sandbox of `source` if `req` asks for nothing a pooled one lacks."""
        name = source.template
        if name not in self._entries or req.snapshot_id or source.snapshot_id:
            return None
        stats = self._stats[name]
        shape_ok = req.memory_mb in (None, source.memory_mb + source.dimm_mb)  # CPUs: at claim
        entries = self._entries[name]
        while shape_ok and entries:
            entry = entries.pop(0)
            if entry.source_key == source.key and not entry.live.machine.exited:
                stats.claimed += 1
                self._refill_soon()
                return entry.live
            self._spawn_discard(entry.live)  # a template rebuilt since, or a dead VM
        stats.misses += 1
        self._refill_soon()
        return None

    def stats(self) -> dict[str, dict]:
        for name, entries in self._entries.items():
            self._stats[name].ready = len(entries)
        return {name: vars(s).copy() for name, s in self._stats.items()}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for entries in self._entries.values():
            while entries:
                await self.discard(entries.pop().live)

    # ---- refill -------------------------------------------------------------------------

    def _refill_soon(self) -> None:
        self._wake.set()

    def _spawn_discard(self, live: LiveSandbox) -> None:
        task = asyncio.get_running_loop().create_task(self.discard(live))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _refill_loop(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(REFILL_DELAY)
            for name in self.templates:
                while len(self._entries[name]) < self.size:
                    try:
                        live, source = await self.make(name)
                    except SandlotError as e:
                        self._stats[name].failures += 1
                        delay = RETRY_DELAYS[min(failures, len(RETRY_DELAYS) - 1)]
                        failures += 1
                        log.warning("warm pool: could not restore a %r sandbox (%s); "
                                    "retrying in %.0f s", name, e.message, delay)
                        await asyncio.sleep(delay)
                        self._wake.set()
                        break
                    failures = 0
                    self._entries[name].append(_Entry(live, source.key))
