"""The machine layer core runs on: what it asks of a runtime, and the typed values that cross.

`Runtime` owns the machine protocol: bringing a VM up from an image (restore, or a claim of one
the warm pool restored ahead), capturing a running VM into a new image, storing and deleting
images, a VM's network, and recovery after a restart. `QemuRuntime` (runtime/qemu.py) does it
with QEMU VMs; `FakeRuntime` (runtime/fake.py) in memory, for tests of server and core that
need no VM. Core depends on this module only, never on vmm or guest directly.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from sandlot.errors import InvalidStateError
from sandlot.guest.client import (
    Configure,
    ExecEvent,
    Exited,
    FileEntry,
    Output,
    ProcessInfo,
    Started,
    TerminalSize,
)
from sandlot.guest.volserve import VolumeServer
from sandlot.runtime.capacity import mem_available_mb
from sandlot.vmm import hotplug
from sandlot.vmm.cpu import HostCpu
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.jail import QEMU_OVERHEAD_MB
from sandlot.vmm.network import NetworkPolicy

# What a VM costs its host beyond its guest RAM (placement ranks hosts by it).
VM_OVERHEAD_MB = QEMU_OVERHEAD_MB

__all__ = [
    "Captured", "Configure", "ExecEvent", "Exited", "FileEntry", "Guest", "HostCpu", "Image",
    "MachineDescription", "MachinePlan", "NetworkPolicy", "Output", "ProcessInfo", "Runtime",
    "Started", "Stored", "Vm",
]


@dataclass(frozen=True)
class Image:
    """A set of snapshot files a VM is restored from: a template's boot snapshot (key
    ``tpl-<build>``) or a snapshot (its id)."""

    key: str
    build: str  # the template build: kernel, initramfs, root filesystem
    machine: MachineDescription
    persistent: bool = True  # in the store; False: a fork's, gone with its last VM

    @property
    def is_template(self) -> bool:
        return self.key.startswith("tpl-")


@dataclass(frozen=True)
class MachinePlan:
    """What a new VM should be. Memory above the image's is hotplugged; CPUs go either way."""

    cpus: int
    memory_mb: int
    env: dict[str, str] = field(default_factory=dict)
    generation: str = ""
    network: NetworkPolicy | None = None  # None: no network (networking off)
    # the disk the guest sees (its quota), MiB; None: the host's default; never less than
    # the image's own disk
    disk_mb: int | None = None


@dataclass
class Captured:
    """A capture's image, on local files held until `release` (or handed to `persist`)."""

    image: Image
    pause_ms: float
    total_ms: float


@dataclass(frozen=True)
class Room:
    """What a host can still take: memory beyond its reserve, disk, and the images its cache
    holds (a restore of those fetches nothing)."""

    memory_free_mb: int
    disk_free_mb: int = 0  # beyond the reserve and what its sandboxes' disks may still take
    cache_free_mb: int = 0
    disk_promised_mb: int = 0  # its sandboxes' disks (their quotas)
    cached: tuple[str, ...] = ()


@dataclass(frozen=True)
class Usage:
    """What a VM uses now, measured from the host: CPU time so far, memory that is its own
    (pages it changed or allocated, not the image pages it shares), the bytes its own disk
    layers hold, and its sizes."""

    cpu_seconds: float
    memory_bytes: int
    memory_total_bytes: int
    disk_bytes: int
    disk_total_bytes: int
    cpus: int
    disk_errors: int = 0  # its disk I/Os the host failed (a full host filesystem)


@dataclass(frozen=True)
class Stored:
    size_bytes: int  # logical size of the image's files
    stored_bytes: int  # what storing it added to the store


class Guest(Protocol):
    """The typed agent API of a running VM (guest/client.AgentClient, or a fake)."""

    async def sync_clock(self) -> float: ...
    async def configure(self, configure: Configure): ...
    def exec(self, cmd: str, *, env: dict[str, str] | None = None, cwd: str | None = None,
             user: str | None = None, timeout: float | None = None,
             stdin: bytes | None = None) -> AsyncIterator[ExecEvent]: ...
    async def start(self, cmd: str, *, env: dict[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None,
                    timeout: float | None = None, stdin: bytes | None = None,
                    pty: TerminalSize | None = None) -> int: ...
    async def resize(self, pid: int, size: TerminalSize) -> None: ...
    def attach(self, pid: int, replay: bool = True) -> AsyncIterator[ExecEvent]: ...
    async def send_stdin(self, pid: int, data: bytes, eof: bool = False) -> None: ...
    async def kill(self, pid: int, signal: int = 9) -> bool: ...
    async def processes(self, all: bool = False) -> list[ProcessInfo]: ...
    async def read(self, path: str) -> tuple[int, AsyncIterator[bytes]]: ...
    async def write(self, path: str, chunks: AsyncIterator[bytes], user: str | None = None,
                    mode: int | None = None, metadata: dict[str, str] | None = None
                    ) -> FileEntry: ...
    async def list_dir(self, path: str, depth: int = 1, max_entries: int | None = None
                       ) -> list[FileEntry]: ...
    async def stat(self, path: str) -> FileEntry: ...
    async def exists(self, path: str) -> bool: ...
    async def remove(self, path: str) -> None: ...
    async def mkdir(self, path: str, user: str | None = None) -> tuple[bool, FileEntry]: ...
    async def rename(self, src: str, dst: str) -> FileEntry: ...
    async def mount(self, path: str, token: str, user: str | None = None) -> None: ...


class Vm(abc.ABC):
    """A running VM."""

    id: str
    image: Image  # what it was restored from
    cpus: int
    memory_mb: int
    disk_mb: int = 0  # the disk the guest sees: its quota (0: unknown)

    @property
    @abc.abstractmethod
    def pid(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def exited(self) -> bool: ...

    @abc.abstractmethod
    async def guest(self) -> Guest:
        """The agent session, reconnecting once if the link dropped."""

    def diagnostics(self) -> str:
        """What the VM printed last (console, VMM log), for error messages."""
        return ""

    def exit_reason(self) -> str:
        """Why a VM that exited on its own did, as far as the host knows."""
        return "the VM exited unexpectedly"


class Runtime(abc.ABC):
    """See the module docstring. Every VM a runtime hands out is killed by `kill`."""

    # Volumes' directories on this host and the server of their guests' mounts (None: this
    # runtime has no volumes).
    volumes: VolumeServer | None = None

    def _volume_server(self) -> VolumeServer:
        if self.volumes is None:
            raise InvalidStateError("this host has no volumes")
        return self.volumes

    def volume_files(self) -> VolumeServer:
        """The volumes' files on this host (blocking calls: run them in a thread)."""
        return self._volume_server()

    async def create_volume(self, volume_id: str) -> None:
        """An empty directory for a new volume."""
        await asyncio.to_thread(self._volume_server().create, volume_id)

    async def delete_volume(self, volume_id: str) -> None:
        """A volume's directory and files (its mounts answer ESTALE from then on)."""
        await asyncio.to_thread(self._volume_server().delete, volume_id)

    async def mount_volume(self, vm: Vm, volume_id: str, path: str, user: str | None) -> None:
        """Mount a volume of this host in a running VM at `path`, its files `user`'s. The
        mount lives in the guest: snapshots, forks and restores of the VM keep it."""
        token = self._volume_server().token(volume_id)
        await (await vm.guest()).mount(path, token, user)

    @abc.abstractmethod
    def check_loadable(self, machine: MachineDescription) -> None:
        """Raise InvalidStateError saying why this host cannot restore such an image (its
        QEMU, device model, accelerator or CPU)."""

    def check_plan(self, image: Image, plan: MachinePlan, boot: bool = False) -> None:
        """Raise InvalidArgumentError if `plan` cannot be made of `image` (memory, CPUs)."""
        if boot or not image.machine.memory:  # a boot takes any size within the bounds
            hotplug.check_bounds(plan.memory_mb, plan.cpus)
            return
        hotplug.check_overrides(image.machine.base_mb, image.machine.dimm_mb, plan.memory_mb,
                                plan.cpus)

    @abc.abstractmethod
    async def claim(self, image: Image, plan: MachinePlan) -> Vm | None:
        """A VM the warm pool restored from `image` ahead of demand, given `plan`'s identity;
        None when there is none of that image and shape. Its id was chosen by the pool."""

    @abc.abstractmethod
    async def restore(self, image: Image, plan: MachinePlan, vm_id: str, *,
                      boot: bool = False) -> Vm:
        """A new running VM `vm_id` restored from `image`: agent connected, env, generation,
        fresh entropy, CPUs, memory and clock set. A filesystem-only image, or any image
        with `boot`, is booted from the image's disk instead (its memory, if any, unused:
        processes start afresh). On failure nothing of it is left."""

    @abc.abstractmethod
    async def capture(self, vm: Vm, key: str, *, persistent: bool = True,
                      memory: bool = True, sync: bool = False) -> Captured:
        """Snapshot a running VM into image `key`; the VM keeps running, paused for as long
        as copying what it changed since its restore takes. Without `memory`, the disk alone
        (no pause): an image that restores by booting. `sync` (always without `memory`):
        the guest's filesystems are synced first, so its disk holds what it wrote. Its files
        are held until `release(key)`."""

    @abc.abstractmethod
    async def persist(self, captured: Captured, meta: dict) -> Stored:
        """Store a captured image durably (compressed, checksummed, manifest last)."""

    @abc.abstractmethod
    async def stored_meta(self, key: str) -> dict:
        """What `persist` stored with an image (NotFoundError if the store lacks it)."""

    @abc.abstractmethod
    def release(self, key: str) -> None:
        """Drop a hold `capture` gave; a non-persistent image goes with its last VM."""

    @abc.abstractmethod
    async def discard(self, key: str) -> None:
        """Delete a stored image; its local files go once no VM maps them."""

    @abc.abstractmethod
    async def boot_image(self, build: str, plan: MachinePlan) -> tuple[Image, float]:
        """Cold-boot template build `build` once, let it settle and capture its boot image
        (key ``tpl-<build>``), kept with the build. Returns the image and the boot time, ms."""

    @abc.abstractmethod
    async def publish_template(self, image: Image, info: dict) -> Stored:
        """Store a template (its boot image and build) under its name, for every server."""

    @abc.abstractmethod
    async def import_template(self, image: Image, info: dict) -> bool:
        """Store a template built on this host if the store lacks it; True if it did."""

    async def reconcile_template(self, image: Image) -> bool:
        """Make this host's build of a template the store's, if the store has another one
        under the same hash (built on another host); True if it was replaced."""
        return False

    @abc.abstractmethod
    async def template_info(self, name: str) -> dict:
        """A template's record as stored (NotFoundError if the store has no such name)."""

    @abc.abstractmethod
    async def kill(self, vm: Vm) -> None:
        """Stop a VM and remove what it used (disks, network, run files)."""

    @abc.abstractmethod
    async def set_network(self, vm: Vm, policy: NetworkPolicy) -> None:
        """Apply egress rules to a running VM, atomically, outside the guest."""

    @abc.abstractmethod
    async def expose(self, vm: Vm, port: int) -> tuple[str, int]:
        """A host address and port that reach `port` inside the VM."""

    def park_ports(self, vm: Vm) -> dict[int, tuple[str, int]]:
        """Before a pause: keep the VM's exposed ports listening after it is killed. A
        connection waits until a VM of that id is back (which adopts them) or
        `refuse_parked_ports`; the VM is then `wanted` once per wait. Returns the ports kept.
        Default: none are."""
        return {}

    async def wanted(self) -> str:
        """The id of the next paused VM whose kept ports a connection waits on. Default:
        never (no port is kept)."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def refuse_parked_ports(self, vm_id: str) -> None:  # noqa: B027 - optional
        """End the connections waiting on the VM's kept ports (it is not back here)."""

    def drop_parked_ports(self, vm_id: str) -> None:  # noqa: B027 - optional
        """Close the ports `park_ports` kept (the sandbox will not come back)."""

    @abc.abstractmethod
    async def recover(self, expected: dict[str, NetworkPolicy | None],
                      keep_images: set[str]) -> dict[str, Vm]:
        """After a restart: re-adopt the VMs in `expected` whose process still runs; remove
        every other VM, disk, network and unheld local image not in `keep_images`."""

    async def collect_garbage(self, grace: float) -> dict:
        """Free the store's chunks no image references (two passes a grace period apart:
        storage/gc.py). Stats."""
        return {}

    def keep_warm(self, images: dict[str, Image],  # noqa: B027 - optional
                  new_id: Callable[[], str]) -> None:
        """Keep VMs of these images (by name) restored ahead of demand, each under an id
        `new_id` gives (core's: a claimed VM is the sandbox of that id)."""

    def pool_stats(self) -> dict[str, dict]:
        return {}

    def usage(self, vm: Vm) -> Usage | None:
        """The VM's use of CPU, memory and disk (None if it is gone)."""
        return None

    def room(self) -> Room:
        """What this host can still take, for placement across hosts (core/hosts.py)."""
        return Room(memory_free_mb=mem_available_mb())

    def cpu(self) -> tuple[str, HostCpu] | None:
        """This host's accelerator and CPU as restores check them, for placement to put an
        image where its guest's CPU can be given (None: not known; any host)."""
        return None

    async def start(self) -> None:  # noqa: B027 - optional
        """Start background work (the warm pool)."""

    @abc.abstractmethod
    async def close(self, vms: list[Vm], kill: bool) -> None:
        """Stop background work; disconnect from `vms`, or kill them."""
