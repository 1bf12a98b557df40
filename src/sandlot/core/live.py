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
    ports: dict[int, tuple[str, int]] = field(default_factory=dict)  # guest port -> host's
    ports_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    async def guest(self) -> Guest:
        return await self.vm.guest()

    def mark_unresponsive(self, reason: str) -> None:
        """The guest did not answer in time (e.g. too busy to end a command at its timeout):
        shown as the record's `error` until it answers again. It can still be killed."""
        self.record.error = f"unresponsive: {reason}"

    def mark_responsive(self) -> None:
        if self.record.error and self.record.error.startswith("unresponsive: "):
            self.record.error = None
