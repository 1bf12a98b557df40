"""The core service: wires the stores and managers, recovers after a restart, reaps timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
from pathlib import Path

from sandlot.core.commands import Commands
from sandlot.core.config import Settings
from sandlot.core.files import Files
from sandlot.core.models import SandboxRecord, SandboxState, to_doc, transition
from sandlot.core.networking import Networking
from sandlot.core.pool import WarmPool
from sandlot.core.runtime import LiveSandbox
from sandlot.core.sandboxes import SandboxManager
from sandlot.core.snapshots import SnapshotManager
from sandlot.core.sources import HotCache
from sandlot.core.store import MetadataStore
from sandlot.core.templates import TemplateStore
from sandlot.errors import SandlotError
from sandlot.guest.client import AgentClient
from sandlot.vmm.machine import Machine, MachineSpec
from sandlot.vmm.processes import qemu_alive, qemus_under

log = logging.getLogger(__name__)


class Core:
    """Everything below the HTTP layer. `await start()` before use, `await stop()` after."""

    def __init__(self, settings: Settings | None = None, network="auto") -> None:
        self.settings = settings or Settings.from_env()
        if network == "auto":
            network = Networking.from_env()
        self.network = network
        self.settings.ensure()
        self.db = MetadataStore(self.settings.db_path)
        self.hot = HotCache(self.settings.hot_dir)
        self.templates = TemplateStore(self.settings)
        self.snapshots = SnapshotManager(self.settings, self.db, self.hot, self.templates)
        self.sandboxes = SandboxManager(self.settings, self.db, self.hot, self.templates,
                                        self.snapshots, network=network)
        self.commands = Commands(self.sandboxes.get_live)
        self.files = Files(self.sandboxes.get_live)
        self._reaper: asyncio.Task | None = None
        s = self.settings
        self.pool = WarmPool(make=self.sandboxes.make_pooled, discard=self.sandboxes._dispose,
                             templates=s.pool_templates, size=s.pool_size,
                             ) if s.pool_size and s.pool_templates else None
        self.sandboxes.pool = self.pool

    async def start(self) -> None:
        await self.recover()
        self._reaper = asyncio.create_task(self._reap_loop())
        if self.pool is not None:
            self.pool.start()

    async def stop(self, kill_sandboxes: bool = False) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self.pool is not None:
            await self.pool.close()  # pooled VMs are in no record: they cannot be re-adopted
        await self.snapshots.close()
        await self.sandboxes.close(kill=kill_sandboxes)
        self.db.close()

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reap_interval)
            try:
                await self.sandboxes.reap_expired()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("reaper failed")

    # ---- recovery -------------------------------------------------------------------------

    async def recover(self) -> None:
        """Re-adopt sandboxes whose QEMU still runs; clean up everything else an earlier
        server process left: orphan QEMUs (holders included), run dirs, disks, hot files."""
        self.snapshots.recover()
        adopted: dict[str, LiveSandbox] = {}
        for doc in self.db.sandboxes(("starting", "running")):
            rec = SandboxRecord.model_validate(doc)
            live = await self._adopt(rec)
            if live is not None:
                adopted[rec.sandbox_id] = live
                self.sandboxes.live[rec.sandbox_id] = live
            else:
                rec.pid = None
                rec.error = rec.error or "lost when the server restarted"
                with contextlib.suppress(SandlotError):
                    transition(rec, SandboxState.STOPPED)
                self.db.put_sandbox(rec.sandbox_id, rec.state.value, to_doc(rec))
        if self.network is not None:
            lost = await self.network.recover([lv.record for lv in adopted.values()])
            for sandbox_id in lost:
                live = adopted.pop(sandbox_id)
                live.record.error = "its network could not be recovered after a restart"
                await self.sandboxes._teardown(live, SandboxState.FAILED)
        keep_pids = {lv.machine.pid for lv in adopted.values()}
        kill_orphans(self.settings.run_root, keep_pids)
        for root in (self.settings.run_root, self.settings.disks_dir):
            for d in root.iterdir() if root.exists() else ():
                if d.name not in adopted:
                    shutil.rmtree(d, ignore_errors=True)
        current = {f"tpl-{t.hash}" for t in self.templates.list()}
        used = {lv.record.source_key for lv in adopted.values()}
        for key in self.hot.keys():
            if key.startswith("tpl-"):
                if key not in current and key not in used:
                    self.hot.remove(key)  # an old build of a template: 100s of MB of tmpfs
                continue
            self.snapshots.release(key)
        if adopted:
            log.info("re-adopted %d sandboxes", len(adopted))

    async def _adopt(self, rec: SandboxRecord) -> LiveSandbox | None:
        run_dir = self.settings.run_root / rec.sandbox_id
        spec_file = run_dir / "machine.json"
        if rec.pid is None or not spec_file.exists() or not qemu_alive(rec.pid, run_dir):
            return None
        try:
            spec = MachineSpec.from_json(spec_file.read_text())
            machine = await Machine.adopt(spec, rec.pid)
            agent = await AgentClient.connect(str(spec.agent_socket), timeout=10)
            await agent.sync_clock()
        except (SandlotError, OSError, ValueError) as e:
            log.warning("cannot re-adopt %s: %s", rec.sandbox_id, e)
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGKILL)
            return None
        machine.spec.save()
        live = LiveSandbox(record=rec, machine=machine, agent=agent, run_dir=run_dir,
                           disk_dir=self.settings.disks_dir / rec.sandbox_id)
        source_disk = str(self.hot.paths(rec.source_key)["disk"])
        if machine.backing_file and machine.backing_file != source_disk:
            live.pending_merge = Path(machine.backing_file)  # a snapshot's merge never ran
        return live


def kill_orphans(run_root: Path, keep: set[int]) -> list[int]:
    """SIGKILL every QEMU whose sockets live under `run_root` and that is not in `keep`."""
    killed = []
    for pid in qemus_under(run_root):
        if pid not in keep:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed
