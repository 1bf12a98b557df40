"""Recovery after a restart: the VMs whose QEMU still runs are re-adopted (machine, agent,
disk chain, network), and every other VM process, run directory, disk, jail and unheld local
image is removed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from sandlot.errors import SandlotError
from sandlot.guest.client import AgentClient
from sandlot.runtime.base import Image, Vm
from sandlot.runtime.capture import Capturer
from sandlot.runtime.host import Part, QemuHost
from sandlot.runtime.qemu_vm import QemuVm, load_state
from sandlot.vmm.disk import DiskChain
from sandlot.vmm.machine import Machine, MachineSpec
from sandlot.vmm.network import NetworkPolicy
from sandlot.vmm.processes import qemu_alive, qemus_under

log = logging.getLogger(__name__)


class Recovery(Part):
    """Re-adopts the VMs a previous server left running, and clears out the rest."""

    def __init__(self, host: QemuHost, captures: Capturer,
                 kill: Callable[[Vm], Awaitable[None]]) -> None:
        super().__init__(host)
        self._captures = captures
        self._kill = kill

    async def recover(self, expected: dict[str, NetworkPolicy | None],
                      keep_images: set[str]) -> dict[str, Vm]:
        adopted: dict[str, QemuVm] = {}
        for vm_id in expected:
            vm = await self._adopt(vm_id)
            if vm is not None:
                adopted[vm_id] = vm
        if self.network is not None:
            lost = await self.network.recover(
                {i: expected[i] or NetworkPolicy() for i in adopted})
            for vm in adopted.values():
                vm.network = self.network.manager.get(vm.id)
            for vm_id in lost:
                log.warning("VM %s: its network could not be recovered; stopping it", vm_id)
                await self._kill(adopted.pop(vm_id))
        keep_pids = {vm.pid for vm in adopted.values()}
        for pid in qemus_under(self.settings.run_root):
            if pid not in keep_pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for root in (self.settings.run_root, self.settings.disks_dir):
            for d in root.iterdir() if root.exists() else ():
                if d.name not in adopted:
                    shutil.rmtree(d, ignore_errors=True)
        await asyncio.to_thread(self.jails.recover, set(adopted))
        self.cache.prune(keep_images | {vm.image.key for vm in adopted.values()})
        return dict(adopted)

    async def _adopt(self, vm_id: str) -> QemuVm | None:
        run_dir = self.settings.run_root / vm_id
        try:
            pid = int((run_dir / "qemu.pid").read_text().split()[0])
            state = load_state(run_dir)
            spec = MachineSpec.from_json((run_dir / "machine.json").read_text())
        except (OSError, ValueError, KeyError, IndexError, SandlotError):
            return None
        if not qemu_alive(pid, run_dir):
            return None
        try:
            machine = await Machine.adopt(spec, pid)
            agent = await AgentClient.connect(str(spec.agent_socket), timeout=10,
                                              volumes=self.volumes)
            await agent.sync_clock()
            d = state["disks"]
            disks = await DiskChain.adopt(Path(d["dir"]), Path(d["source"]), int(d["size"]),
                                          machine, spec.jail.uid if spec.jail else None)
        except (SandlotError, OSError, ValueError) as e:
            log.warning("cannot re-adopt %s: %s", vm_id, e)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return None
        image: Image = state["image"]
        vm = QemuVm(id=vm_id, image=image, cpus=int(state["cpus"]),
                    memory_mb=int(state["memory_mb"]), machine=machine, agent=agent,
                    disks=disks, run_dir=run_dir, lease=self.cache.adopt(image.key),
                    last_capture=state.get("last_capture"),
                    booted=bool(state.get("booted", False)))
        vm.save()
        self.reserve.disks.hold(vm_id, disks.size, disks.held)
        for leftover in run_dir.glob("devstate-*"):  # saved by a capture the crash cut short
            leftover.unlink(missing_ok=True)
        if disks.frozen is not None:  # a capture's merge never ran
            self._spawn(self._captures.compact_locked(vm))
        return vm
