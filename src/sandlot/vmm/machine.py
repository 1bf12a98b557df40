"""One QEMU process: its command line, its QMP session, its lifetime and state.

The device model is fixed here and must not vary between a snapshot and its restores: q35 (a
versioned machine type, vmm/qemu.py), RAM in a memory backend named ``mem``, one virtio-blk
disk, virtio-serial with the agent port, virtio-rng, one virtio-net NIC, with room for one
hotplugged DIMM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from pathlib import Path

from qemu.qmp import EventListener, QMPClient, QMPError

from sandlot.errors import InvalidStateError, VmmError
from sandlot.vmm.accel import accel_args
from sandlot.vmm.disk import DISK_ERROR_POLICY, DISK_HOST_OPTIONS
from sandlot.vmm.jail import SECCOMP, Jail
from sandlot.vmm.network import open_tap
from sandlot.vmm.qemu import QEMU
from sandlot.vmm.write_tracking import WriteTracker, open_tracker, qemu_env

log = logging.getLogger(__name__)
# No backend state in the migration stream (QEMU's user network has a 'slirp' section), so a
# snapshot loads whatever backend its restore uses. Packets sent here go nowhere.
NO_NETWORK = "hubport,id=net0,hubid=0"
# Offloads need a vnet-header backend (tap); with them off, the NIC's negotiated features are
# the same on every backend, so its state migrates between a tap and NO_NETWORK.
NIC_FEATURES = ",".join(f"{f}=off" for f in (
    "csum", "guest_csum", "gso", "host_tso4", "host_tso6", "host_ecn", "host_ufo",
    "guest_tso4", "guest_tso6", "guest_ecn", "guest_ufo", "guest_announce"))
MAX_CPUS = 4
MAX_MEM_MB = 16384
MEM_SLOTS = 4
KERNEL_CMDLINE = (
    "console=ttyS0 root=/dev/vda rw quiet loglevel=3 panic=-1 memhp_default_state=online "
    "tsc=reliable no_timer_check random.trust_bootloader=off init_on_free=1 maxcpus=1"
)
# QEMU 7.2's TCG caches translated code by guest *virtual* address, so with address-space
# randomization every new process (every command) translates ld.so, libc and its program
# again: ~3x slower commands. Under TCG the guest runs without it (`norandmaps`).
TCG_CMDLINE = " norandmaps"


# Guest RAM is never merged by the host's KSM, should it run: merging identical pages across
# sandboxes is a side channel between tenants (CVE-2015-2877), and a page KSM turns into the
# shared zero page loses its write-tracking mark (vmm/write_tracking.py). Host-only: out of
# DEVICE_MODEL, like the disks' host options.
RAM_HOST_OPTIONS = ",merge=off"


def kernel_cmdline(accel: str) -> str:
    return KERNEL_CMDLINE + (TCG_CMDLINE if accel == "tcg" else "")


@dataclass(frozen=True)
class MachineSpec:
    """Everything that decides a QEMU command line."""

    run_dir: Path
    kernel: Path
    initrd: Path
    disk: Path
    machine_type: str  # versioned (pc-q35-7.2): a snapshot loads only into its own
    base_mb: int = 512  # the main RAM backend
    cpus: int = 1  # online in the guest; QEMU always has MAX_CPUS
    accel: str = "tcg"
    cpu_model: str = ""  # "": the accelerator's default (vmm/cpu.py)
    ram_path: Path | None = None  # None: anonymous RAM (cold boot)
    ram_share: bool = False
    ram_on_demand: bool = False  # the RAM files are read on demand (a lazy mount)
    dimm_mb: int = 0  # hotplugged memory: one pc-dimm
    dimm_path: Path | None = None  # None: anonymous RAM
    incoming: bool = False
    netdev: str = NO_NETWORK
    exec_prefix: tuple[str, ...] = ()  # e.g. ("ip", "netns", "exec", "sl-..."); unconfined
    jail: Jail | None = None  # its own uid, seccomp, namespace, cgroup (vmm/jail.py)
    write_tracking: bool = True  # preload the write-tracking library (vmm/write_tracking.py)

    def with_(self, **changes) -> MachineSpec:
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps({k: (str(v) if isinstance(v, Path) else v)
                           for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> MachineSpec:
        known = {f.name for f in fields(cls)}
        data = json.loads(text)
        data.setdefault("base_mb", data.get("memory_mb", 512))  # its name before 0.2
        data.setdefault("machine_type", "q35")
        data = {k: v for k, v in data.items() if k in known}
        for key in ("run_dir", "kernel", "initrd", "disk", "ram_path", "dimm_path"):
            if data.get(key) is not None:
                data[key] = Path(data[key])
        data["exec_prefix"] = tuple(data.get("exec_prefix") or ())
        data["jail"] = Jail.from_dict(data["jail"]) if data.get("jail") else None
        return cls(**data)

    def save(self) -> None:
        tmp = self.run_dir / "machine.json.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(self.run_dir / "machine.json")

    @property
    def qmp_socket(self) -> Path:
        return self.run_dir / "qmp.sock"

    @property
    def agent_socket(self) -> Path:
        return self.run_dir / "agent.sock"

    def _backend(self, name: str, size_mb: int, path: Path | None,
                 host_options: bool = True) -> str:
        """Anonymous RAM without a path; else the file, shared or copy-on-write."""
        extra = RAM_HOST_OPTIONS if host_options else ""
        if path is None:
            return f"memory-backend-ram,id={name},size={size_mb}M{extra}"
        share = "on" if self.ram_share else "off"
        return (f"memory-backend-file,id={name},size={size_mb}M,mem-path={path},share={share}"
                f"{extra}")

    def command(self, host_options: bool = True) -> list[str]:
        """QEMU's command line; `host_options` False leaves out the disk options that change
        only what the host does with guest requests (see DISK_HOST_OPTIONS)."""
        mem = f"{self.base_mb}M"
        backend = self._backend("mem", self.base_mb, self.ram_path, host_options)
        cmd = [
            *(self.jail.prefix() if self.jail else self.exec_prefix),
            QEMU, "-nodefaults", "-no-user-config", "-nographic",
            "-machine", f"{self.machine_type},memory-backend=mem,vmport=off,smbus=off,sata=off,"
            "usb=off",
            *accel_args(self.accel, self.cpu_model),
            # Every VM has MAX_CPUS vCPUs; the guest boots with one online (maxcpus=1) and the
            # agent onlines `cpus` of them. No CPU hotplug: snapshots load anywhere.
            "-smp", f"{MAX_CPUS},maxcpus={MAX_CPUS}",
            "-m", f"{mem},slots={MEM_SLOTS},maxmem={MAX_MEM_MB}M",
            "-object", backend,
            "-kernel", str(self.kernel), "-initrd", str(self.initrd),
            "-append", kernel_cmdline(self.accel),
            "-serial", f"file:{self.run_dir / 'console.log'}",
            "-blockdev",
            f"driver=qcow2,node-name=disk0,file.driver=file,file.filename={self.disk},"
            f"file.aio=threads,cache.direct=off{DISK_HOST_OPTIONS if host_options else ''}",
            "-device", "virtio-blk-pci,drive=disk0,id=vda"
            f"{DISK_ERROR_POLICY if host_options else ''}",
            "-device", "virtio-serial-pci,id=vser0",
            "-chardev", f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
            "-device", "virtserialport,bus=vser0.0,chardev=agent,name=org.sandlot.agent",
            "-object", "rng-random,id=rng0,filename=/dev/urandom",
            "-device", "virtio-rng-pci,rng=rng0",
            "-netdev", self.netdev,
            "-device", f"virtio-net-pci,netdev=net0,mac=52:54:00:12:34:56,romfile=,{NIC_FEATURES}",
            # Device state is saved without RAM (xen-save-devices-state) and loaded through
            # migrate-incoming, which then expects no configuration section; the vapic
            # option ROM's state would not survive that round trip.
            "-global", "migration.send-configuration=off", "-global", "apic.vapic=off",
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
            "-pidfile", str(self.run_dir / "qemu.pid"),
            *self.dimm_args(host_options),
        ]
        if self.jail is not None:
            cmd += ["-sandbox", SECCOMP]
        if self.incoming:
            cmd += ["-S", "-incoming", "defer"]
        return cmd


    def dimm_args(self, host_options: bool = True) -> list[str]:
        if not self.dimm_mb:
            return []
        return ["-object", self._backend("dimm0", self.dimm_mb, self.dimm_path, host_options),
                "-device", "pc-dimm,id=pcdimm0,memdev=dimm0"]


class DiskErrors(EventListener):
    """Counts the disk writes and reads the host failed (QMP BLOCK_IO_ERROR: with
    `werror=report` the guest gets an I/O error and runs on); queues no event."""

    def __init__(self, name: str) -> None:
        super().__init__("BLOCK_IO_ERROR")
        self.name = name
        self.count = 0

    def accept(self, event) -> bool:
        if super().accept(event):
            self.count += 1
            if self.count == 1 or self.count % 1000 == 0:
                data = event.get("data") or {}
                log.warning("VM %s: the host failed %d of its disk %ss (%s%s): its guest got "
                            "I/O errors", self.name, self.count, data.get("operation", "I/O"),
                            data.get("reason", "?"), ", no space" if data.get("nospace") else "")
        return False


class MachineState(StrEnum):
    LAUNCHING = "launching"  # process started, QMP not yet connected
    LOADING = "loading"  # waiting for or loading an incoming migration (a restore)
    PAUSED = "paused"
    RUNNING = "running"
    EXITED = "exited"


MACHINE_TRANSITIONS: dict[MachineState, set[MachineState]] = {
    MachineState.LAUNCHING: {MachineState.LOADING, MachineState.PAUSED, MachineState.RUNNING,
                             MachineState.EXITED},
    MachineState.LOADING: {MachineState.PAUSED, MachineState.EXITED},
    MachineState.PAUSED: {MachineState.RUNNING, MachineState.EXITED},
    MachineState.RUNNING: {MachineState.PAUSED, MachineState.EXITED},
    MachineState.EXITED: set(),
}


class Machine:
    """A running QEMU process and its QMP session (async only).

    `state` follows what sandlot did and saw (launch, load, stop, cont, exit); `cont` and
    `stop` check it first and raise InvalidStateError when the machine is not in a state
    that allows them.
    """

    def __init__(self, spec: MachineSpec, pid: int,
                 proc: asyncio.subprocess.Process | None) -> None:
        self.spec = spec
        self.pid = pid
        self._proc = proc
        self.qmp = QMPClient(f"sandlot-{spec.run_dir.name}")
        self._qmp_lock = asyncio.Lock()
        self.state = MachineState.LAUNCHING
        self.disk_errors = DiskErrors(spec.run_dir.name)
        self.qmp.register_listener(self.disk_errors)
        self._tracker: WriteTracker | None | bool = False  # False: not looked for yet

    def write_tracker(self) -> WriteTracker | None:
        """What tracks this QEMU's writes to guest RAM (vmm/write_tracking.py), if it runs
        with it; looked for once."""
        if self._tracker is False:
            self._tracker = open_tracker(self.pid)
        return self._tracker

    def drop_write_tracker(self) -> None:
        """Go on without write tracking (it failed)."""
        if self._tracker:
            self._tracker.close()
        self._tracker = None

    def _move(self, new: MachineState) -> None:
        if new != self.state and new not in MACHINE_TRANSITIONS[self.state]:
            raise InvalidStateError(
                f"QEMU {self.pid} is {self.state.value}, cannot become {new.value}",
                current=self.state.value,
                allowed=tuple(s.value for s, nxt in MACHINE_TRANSITIONS.items() if new in nxt))
        self.state = new

    def _require(self, *allowed: MachineState) -> None:
        if self.exited:
            self._move(MachineState.EXITED)
        if self.state not in allowed:
            raise InvalidStateError(f"QEMU {self.pid} is {self.state.value}",
                                    current=self.state.value,
                                    allowed=tuple(s.value for s in allowed))

    async def cont(self) -> None:
        """Run the paused VM."""
        self._require(MachineState.PAUSED)
        await self.execute("cont")
        self._move(MachineState.RUNNING)

    async def stop(self) -> None:
        """Pause the running VM."""
        self._require(MachineState.RUNNING)
        await self.execute("stop")
        self._move(MachineState.PAUSED)

    async def ensure_running(self) -> None:
        """Run the VM again if it is not running (after a capture, whatever happened)."""
        if await self.status() != "running":
            await self.execute("cont")
        self._move(MachineState.RUNNING)

    @classmethod
    async def launch(cls, spec: MachineSpec, timeout: float = 30.0) -> Machine:
        """Start QEMU and connect QMP; the VM runs unless `spec.incoming` (then it waits paused)."""
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        if spec.jail is not None:
            spec.jail.own(spec.run_dir)  # QEMU writes its sockets, pid file and console here
        for sock in (spec.qmp_socket, spec.agent_socket):
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
        command, fds = spec.command(), []
        if spec.jail is not None and spec.jail.netns and spec.netdev.startswith("tap,"):
            # A confined QEMU may not open /dev/net/tun: it gets the opened tap.
            fds.append(await asyncio.to_thread(open_tap, spec.jail.netns))
            command = spec.with_(netdev=f"tap,id=net0,fd={fds[0]}").command()
        env = {**os.environ, **await asyncio.to_thread(qemu_env, spec.write_tracking,
                                                       spec.ram_on_demand)}
        log_file = open(spec.run_dir / "qemu.log", "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=log_file,
                stderr=log_file, start_new_session=True, pass_fds=fds, env=env,
            )
        except OSError as e:
            raise VmmError(f"cannot start QEMU: {e}", cause=e) from e
        finally:
            log_file.close()
            for fd in fds:
                os.close(fd)
        machine = cls(spec, proc.pid, proc)
        try:
            await machine._connect_qmp(timeout)
        except BaseException:
            await machine.kill()
            raise
        machine._move(MachineState.LOADING if spec.incoming else MachineState.RUNNING)
        return machine

    @classmethod
    async def adopt(cls, spec: MachineSpec, pid: int, timeout: float = 5.0) -> Machine:
        """Re-attach to a QEMU left running by an earlier server process, and resume a VM
        an interrupted snapshot left paused."""
        machine = cls(spec, pid, None)
        await machine._connect_qmp(timeout)
        status = await machine.status()
        if status != "running":
            with contextlib.suppress(VmmError):
                await machine.execute("migrate_cancel")
            await machine.execute("cont")
        machine._move(MachineState.RUNNING)
        return machine

    async def top_disk(self) -> tuple[str, Path, str | None]:
        """(node name, file, backing file) of the disk the guest sees, as QEMU has it."""
        for dev in await self.execute("query-block"):
            inserted = dev.get("inserted") or {}
            if inserted.get("node-name"):
                return (inserted["node-name"], Path(inserted["file"]),
                        inserted.get("backing_file"))
        raise VmmError(f"QEMU {self.pid} has no disk")

    async def _connect_qmp(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._proc is not None and self._proc.returncode is not None:
                raise VmmError(f"QEMU exited at start: {self.log_tail()}")
            if self.spec.qmp_socket.exists():
                try:
                    await self.qmp.connect(str(self.spec.qmp_socket))
                    return
                except (QMPError, OSError) as e:
                    if loop.time() > deadline:
                        raise VmmError(f"QMP connect failed: {e}") from e
            if loop.time() > deadline:
                raise VmmError(f"QEMU did not open QMP within {timeout}s: {self.log_tail()}")
            await asyncio.sleep(0.005)

    def console_tail(self, n: int = 1500) -> str:
        """The end of the guest's serial console (kernel messages: panics land here)."""
        try:
            return (self.spec.run_dir / "console.log").read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.spec.run_dir / "qemu.log").read_text(errors="replace")[-n:].strip()
        except OSError:
            return ""

    async def execute(self, cmd: str, args: dict | None = None, timeout: float = 30.0):
        """Run one QMP command; failures become VmmError."""
        try:
            async with self._qmp_lock:
                return await asyncio.wait_for(self.qmp.execute(cmd, args), timeout)
        except TimeoutError:
            raise VmmError(f"QMP {cmd} timed out after {timeout}s") from None
        except (QMPError, OSError, EOFError) as e:
            raise VmmError(f"QMP {cmd} failed: {e}", cause=e) from e

    async def wait_chardev_connected(self, label: str, timeout: float = 2.0) -> bool:
        """Wait until a client is connected to chardev `label` (QEMU names an unconnected
        socket chardev "disconnected:..."); False if none came within `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for dev in await self.execute("query-chardev"):
                if dev.get("label") == label and not dev.get("filename", "").startswith(
                        "disconnected"):
                    return True
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.002)

    async def status(self) -> str:
        return (await self.execute("query-status"))["status"]

    async def migrate_status(self) -> dict:
        return await self.execute("query-migrate")

    async def wait_running(self, timeout: float = 60.0, poll: float = 0.001) -> None:
        """Poll until the VM runs (QEMU resumes it by itself, e.g. in a background
        snapshot); a migration that fails first raises."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while await self.status() != "running":
            info = await self.migrate_status()
            if info.get("status") in ("failed", "cancelled"):
                raise VmmError(f"migration {info['status']}: {info.get('error-desc', '')} "
                               f"{self.log_tail(500)}")
            if loop.time() > deadline:
                raise VmmError(f"the VM did not run again within {timeout}s")
            await asyncio.sleep(poll)
        self._move(MachineState.RUNNING)

    async def wait_migration(self, states: tuple[str, ...], timeout: float = 120.0,
                             poll: float = 0.002) -> dict:
        """Poll query-migrate until its status is one of `states`; 'failed' raises."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = await self.migrate_status()
            status = info.get("status")
            if status in states:
                return info
            if status in ("failed", "cancelled"):
                raise VmmError(f"migration {status}: {info.get('error-desc', '')} "
                               f"{self.log_tail(500)}")
            if loop.time() > deadline:
                raise VmmError(f"migration stuck in {status} after {timeout}s")
            await asyncio.sleep(poll)

    async def wait_incoming(self, timeout: float = 60.0) -> None:
        """Wait for an incoming migration to finish loading (the VM is then paused)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                status = await self.status()
            except VmmError as e:
                await asyncio.sleep(0.05)
                raise VmmError(f"QEMU failed while loading the snapshot: "
                               f"{self.log_tail(800) or e}") from e
            if status in ("paused", "running", "prelaunch"):
                self._move(MachineState.PAUSED)
                return
            if status not in ("inmigrate",):
                raise VmmError(f"incoming migration ended in state {status}: "
                               f"{self.log_tail(500)}")
            if self.exited:
                raise VmmError(f"QEMU died while loading: {self.log_tail(800)}")
            if loop.time() > deadline:
                raise VmmError(f"incoming migration did not finish in {timeout}s")
            await asyncio.sleep(0.002)

    @property
    def exited(self) -> bool:
        if self.state == MachineState.EXITED:
            return True
        if self._proc is not None:
            gone = self._proc.returncode is not None
        else:
            try:
                os.kill(self.pid, 0)
                gone = False
            except ProcessLookupError:
                gone = True
            except PermissionError:
                gone = False
        if gone:
            self.state = MachineState.EXITED
        return gone

    async def kill(self, grace: float = 0.0) -> None:
        """Stop the process (SIGKILL after `grace` seconds of asking nicely) and reap it."""
        if grace and not self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            await self._reap(grace)
        if not self.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        await self._reap(5.0)
        self.state = MachineState.EXITED
        await self.disconnect()

    async def disconnect(self) -> None:
        """Drop the QMP session without waiting on it for long (qemu.qmp can linger)."""
        self.drop_write_tracker()
        task = asyncio.ensure_future(self.qmp.disconnect())
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            with contextlib.suppress(Exception):
                task.result()

    async def _reap(self, timeout: float) -> None:
        if self._proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), timeout)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.exited and loop.time() < deadline:
            await asyncio.sleep(0.01)


def _device_model() -> str:
    """A fingerprint of the device model: snapshots of one model do not load into another.

    Computed from the command line itself (paths left out), so any change to the devices
    changes it; template builds hash it in and get rebuilt, and restores check it.
    """
    spec = MachineSpec(run_dir=Path("/r"), kernel=Path("/k"), initrd=Path("/i"),
                       disk=Path("/d"), ram_path=Path("/m"), machine_type="<machine>")
    model = " ".join(spec.command(host_options=False))
    return hashlib.sha256(model.encode()).hexdigest()[:12]


DEVICE_MODEL = _device_model()
