"""A warm pool: VMs restored from template images ahead of demand.

Under TCG a fresh QEMU spends most of a create translating the guest code the agent's first
exchange runs (the translation cache starts empty on every restore). A pooled VM has done
that, and a warm-up command, before anyone asks: a claim only gives it its identity (fresh
entropy, generation, env, clock, egress rules).

Only plans with the image's own memory are served from the pool (CPUs are onlined or offlined
at the claim); everything else, and every request while the pool is empty, is an ordinary
restore. Pooled VMs belong to no sandbox: after a crash they are orphans like any other and
are removed at the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sandlot.errors import SandlotError
from sandlot.runtime.base import Image, Vm

log = logging.getLogger(__name__)

REFILL_DELAY = 0.25  # s after a claim: the claimed VM's first commands go first
RETRY_DELAYS = (1.0, 5.0, 30.0)


@dataclass
class PoolStats:
    size: int
    ready: int = 0  # filled in by `stats()`
    claimed: int = 0
    misses: int = 0
    failures: int = 0


@dataclass
class WarmPool:
    """Pooled VMs per name (a template's); `take` hands one out, a background task refills."""

    make: Callable[[Image], Awaitable[Vm]]  # restore and warm up one
    discard: Callable[[Vm], Awaitable[None]]
    size: int = 2
    _targets: dict[str, Image] = field(default_factory=dict)
    _entries: dict[str, list[Vm]] = field(default_factory=dict)
    _stats: dict[str, PoolStats] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task | None = None

    def keep(self, images: dict[str, Image]) -> None:
        """Keep `size` VMs of each image; an image that changed (a rebuilt template) replaces
        its name's older VMs."""
        for name, image in images.items():
            if name not in self._targets or self._targets[name].key != image.key:
                self._targets[name] = image
            self._entries.setdefault(name, [])
            self._stats.setdefault(name, PoolStats(size=self.size))
        self._wake.set()

    def start(self) -> None:
        if self.size:
            self._task = asyncio.get_running_loop().create_task(self._refill_loop())
            self._wake.set()

    def take(self, image: Image) -> Vm | None:
        """A pooled VM of `image`, or None (counted as a miss if the image is pooled)."""
        name = next((n for n, img in self._targets.items() if img.key == image.key), None)
        if name is None:
            return None
        entries = self._entries[name]
        while entries:
            vm = entries.pop(0)
            if vm.image.key == image.key and not vm.exited:
                self._stats[name].claimed += 1
                self._wake.set()
                return vm
            self._spawn_discard(vm)
        self._stats[name].misses += 1
        self._wake.set()
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
                await self.discard(entries.pop())

    def _spawn_discard(self, vm: Vm) -> None:
        task = asyncio.get_running_loop().create_task(self.discard(vm))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _refill_loop(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(REFILL_DELAY)
            for name, image in list(self._targets.items()):
                entries = self._entries[name]
                for stale in [vm for vm in entries if vm.image.key != image.key]:
                    entries.remove(stale)
                    self._spawn_discard(stale)
                while len(entries) < self.size:
                    try:
                        vm = await self.make(image)
                    except SandlotError as e:
                        self._stats[name].failures += 1
                        delay = RETRY_DELAYS[min(failures, len(RETRY_DELAYS) - 1)]
                        failures += 1
                        log.warning("warm pool: could not restore a %r VM (%s); retrying in "
                                    "%.0f s", name, e.message, delay)
                        await asyncio.sleep(delay)
                        self._wake.set()
                        break
                    failures = 0
                    if self._targets.get(name, image).key == image.key:
                        entries.append(vm)
                    else:  # the template changed while this one was restored
                        self._spawn_discard(vm)
