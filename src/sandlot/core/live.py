"""A running sandbox as core keeps it: its record, its VM, and the lock its lifecycle changes
(snapshots, forks, rollback, pause, kill) take."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sandlot.core.models import SandboxRecord
from sandlot.runtime.base import Guest, Vm


def _settled() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass(eq=False)
class LiveSandbox:
    record: SandboxRecord
    vm: Vm
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _captures: int = 0
    _settled: asyncio.Event = field(default_factory=_settled)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    def capture_asked(self) -> None:
        """A snapshot was asked for: commands and file operations asked for after it wait
        until it is captured, so they are never in it."""
        self._captures += 1
        self._settled.clear()

    def capture_done(self) -> None:
        self._captures = max(0, self._captures - 1)
        if not self._captures:
            self._settled.set()

    async def guest(self) -> Guest:
        await self._settled.wait()
        return await self.vm.guest()
