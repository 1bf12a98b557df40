"""A running QEMU VM as the runtime keeps it: machine, agent session, disk chain, network, and
the lease on the image it maps; saved to its run dir so a restarted server can adopt it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import GuestError, NotFoundError
from sandlot.guest.client import AgentClient
from sandlot.runtime.base import Image, Vm
from sandlot.runtime.cache import Lease
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.disk import DiskChain
from sandlot.vmm.machine import Machine
from sandlot.vmm.network import SandboxNetwork

STATE_FILE = "vm.json"


@dataclass(eq=False)
class QemuVm(Vm):
    id: str
    image: Image
    cpus: int
    memory_mb: int
    machine: Machine
    agent: AgentClient
    disks: DiskChain
    run_dir: Path
    lease: Lease | None = None  # on the image's hot files (None: a cold-booted template VM)
    network: SandboxNetwork | None = None
    last_capture: str | None = None  # the last image captured of it (stored ones only)
    # (its last stored capture with memory, per RAM region the pages written since), while
    # every capture since was tracked (vmm/write_tracking.py); not kept across restarts
    ram_base: tuple[str, dict] | None = field(default=None, repr=False)
    booted: bool = False  # booted from its image's disk: its RAM is its own (anonymous)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # captures and disk merges
    # A stored capture's disk, flattened from the frozen layer while its RAM is hashed:
    # the frozen layer is merged or removed only after it.
    flattening: asyncio.Task | None = field(default=None, repr=False)
    # its disk being grown to its quota (`quota` bytes) just after it came up
    growing: asyncio.Task | None = field(default=None, repr=False)
    quota: int = 0

    @property
    def pid(self) -> int | None:
        return self.machine.pid

    @property
    def disk_mb(self) -> int:  # type: ignore[override]
        return max(self.quota, self.disks.size) >> 20

    @property
    def exited(self) -> bool:
        return self.machine.exited

    async def guest(self) -> AgentClient:
        if self.agent.alive:
            return self.agent
        if self.machine.exited:
            raise NotFoundError(f"sandbox {self.id} is not running (its VM exited)")
        try:
            self.agent = await AgentClient.connect(str(self.machine.spec.agent_socket),
                                                   timeout=10, volumes=self.agent.volumes)
        except GuestError as e:
            raise GuestError(f"sandbox {self.id}: agent unreachable: {e}") from e
        return self.agent

    def exit_reason(self) -> str:
        lazy = self.lease.lazy if self.lease is not None else None
        failed = lazy.failed() if lazy is not None else None
        if failed is not None:  # it touched memory or disk its image could not fetch
            return f"the VM stopped: {failed}"
        return super().exit_reason()

    def diagnostics(self) -> str:
        return (f"console: {self.machine.console_tail() or 'empty'}; "
                f"qemu: {self.machine.log_tail(300) or 'empty'}")

    async def disconnect(self) -> None:
        with contextlib.suppress(Exception):
            await self.agent.close()
        await self.machine.disconnect()

    # ---- persistence ----------------------------------------------------------------------

    def save(self) -> None:
        """machine.json (the command line) and vm.json (what the runtime knows of it)."""
        self.machine.spec.save()
        state = {
            "image": {"key": self.image.key, "build": self.image.build,
                      "machine": self.image.machine.to_dict(),
                      "persistent": self.image.persistent},
            "cpus": self.cpus, "memory_mb": self.memory_mb, "last_capture": self.last_capture,
            "booted": self.booted,
            "disks": {"dir": str(self.disks.dir), "source": str(self.disks.source),
                      "size": self.disks.size, "source_fmt": self.disks.source_fmt},
        }
        tmp = self.run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.run_dir / STATE_FILE)


def load_state(run_dir: Path) -> dict:
    """What `QemuVm.save` wrote (ValueError/OSError if it is not there or not readable)."""
    state = json.loads((run_dir / STATE_FILE).read_text())
    img = state["image"]
    state["image"] = Image(key=img["key"], build=img["build"],
                           machine=MachineDescription.from_dict(img["machine"]),
                           persistent=bool(img.get("persistent", True)))
    return state
