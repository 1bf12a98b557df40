"""A live sandbox: its record, its QEMU machine, its agent session."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.core.models import SandboxRecord
from sandlot.errors import GuestError, NotFoundError
from sandlot.guest.client import AgentClient
from sandlot.vmm.machine import Machine


def new_generation() -> str:
    return "g-" + secrets.token_hex(6)


@dataclass
class LiveSandbox:
    record: SandboxRecord
    machine: Machine
    agent: AgentClient
    run_dir: Path
    disk_dir: Path
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    network: object | None = None  # vmm.network.SandboxNetwork when networking is on
    pending_merge: Path | None = None  # a frozen disk layer still in the chain

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    @property
    def base(self) -> str:
        return self.record.base

    async def session(self) -> AgentClient:
        """The agent session, reconnecting once if the link dropped."""
        if self.agent.alive:
            return self.agent
        if self.machine.exited:
            raise NotFoundError(f"sandbox {self.sandbox_id} is not running (its VM exited)")
        try:
            self.agent = await AgentClient.connect(str(self.machine.spec.agent_socket), timeout=10)
        except GuestError as e:
            raise GuestError(f"sandbox {self.sandbox_id}: agent unreachable: {e}") from e
        return self.agent

    async def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self.agent.close()
        await self.machine.kill()
