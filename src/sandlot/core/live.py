"""A running sandbox as core keeps it: its record, its VM, and the lock its lifecycle changes
(snapshots, forks, rollback, pause, kill) take."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sandlot.core.models import SandboxRecord
from sandlot.runtime.base import Guest, Vm


@dataclass(eq=False)
class LiveSandbox:
    record: SandboxRecord
    vm: Vm
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    async def guest(self) -> Guest:
        return await self.vm.guest()
