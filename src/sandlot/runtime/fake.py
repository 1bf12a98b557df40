"""A runtime without VMs, for fast tests of the server, core and SDKs in one process.

Each `FakeVm` has an in-memory file system and runs a tiny shell (runtime/fake_guest.py).
A capture copies a VM's files and env, and a restore copies them back, so snapshots, forks,
rollback and pause behave as they do on real VMs, as far as files, env and generations go. It
never stands in for a feature's test on real VMs (tests/vm); it lets the REST contract and
core's lifecycles be tested in seconds.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field, replace

from sandlot.errors import InvalidStateError, NotFoundError, StorageError
from sandlot.runtime.base import (
    Captured,
    Image,
    MachineDescription,
    MachinePlan,
    NetworkPolicy,
    Runtime,
    Stored,
    Usage,
    Vm,
)
from sandlot.runtime.fake_guest import FakeGuest, GuestState, drop_memory, next_pid
from sandlot.vmm.cpu import HostCpu, legacy_model
from sandlot.vmm.qemu import QemuInfo

FAKE_QEMU = QemuInfo(version="7.2.0", machine_types=frozenset({"pc-q35-7.2"}),
                     default_q35="pc-q35-7.2")
FAKE_DEVICE_MODEL = "fake"


@dataclass(eq=False)
class FakeVm(Vm):
    id: str
    image: Image
    cpus: int
    memory_mb: int
    agent: FakeGuest
    network: NetworkPolicy | None = None
    disk_mb: int = 2048
    _pid: int = field(default_factory=next_pid)
    gone: bool = False
    booted: bool = False  # booted from its image's disk

    @property
    def pid(self) -> int | None:
        return None if self.gone else self._pid

    @property
    def exited(self) -> bool:
        return self.gone

    async def guest(self) -> FakeGuest:
        if self.gone:
            raise NotFoundError(f"sandbox {self.id} is not running (its VM exited)")
        return self.agent


class FakeRuntime(Runtime):
    """Images and VMs in memory. Knobs for tests: `fail_restores` (that many next restores
    fail), `persist_delay` (s an upload takes), `fail_persist` (uploads fail with it),
    `listeners` (guest port -> a real host address its `expose` gives, e.g. a test's
    server; other ports: an address nothing listens on), `accel` and `host_cpu` (the host's
    CPU restores are checked against; None: the accelerator's default before CPU models)."""

    accel = "tcg"
    host_cpu: HostCpu | None = None

    def __init__(self, qemu: QemuInfo = FAKE_QEMU) -> None:
        self.qemu = qemu
        self.images: dict[str, GuestState] = {}
        self.vms: dict[str, FakeVm] = {}
        self.captures: dict[str, tuple[Image, GuestState]] = {}
        self.templates: dict[str, dict] = {}  # the store's template index
        self.metas: dict[str, dict] = {}  # what persist stored with each image
        self.fail_restores = 0
        self.persist_delay = 0.0
        self.fail_persist: str | None = None
        self.restores = 0
        self.listeners: dict[int, tuple[str, int]] = {}
        self.kept_ports: dict[int, tuple[str, int]] = {}  # what `park_ports` keeps
        # What `wanted` answers: put a paused VM's id for a connection to a port it kept.
        self.traffic: asyncio.Queue[str] = asyncio.Queue()
        self.refused: list[str] = []  # refuse_parked_ports, in order
        self.dropped: list[str] = []  # drop_parked_ports, in order


    def usage(self, vm: Vm) -> Usage | None:
        assert isinstance(vm, FakeVm)
        if vm.gone:
            return None
        return Usage(cpu_seconds=0.01 * len(vm.agent.procs), memory_bytes=64 << 20,
                     memory_total_bytes=vm.memory_mb << 20, disk_bytes=8 << 20,
                     disk_total_bytes=vm.disk_mb << 20, cpus=vm.cpus)

    def describe(self, memory_mb: int = 512, cpus: int = 1,
                 machine_type: str = "pc-q35-7.2") -> MachineDescription:
        return MachineDescription(machine_type=machine_type, qemu_version=self.qemu.version,
                                  device_model=FAKE_DEVICE_MODEL, accel=self.accel,
                                  base_mb=memory_mb, cpus=cpus)

    def cpu(self) -> tuple[str, HostCpu]:
        return self.accel, self.host_cpu or HostCpu(legacy_model(self.accel))

    def check_loadable(self, machine: MachineDescription) -> None:
        problems = machine.problems(self.qemu, FAKE_DEVICE_MODEL, *self.cpu())
        if problems:
            raise InvalidStateError("; ".join(problems))

    async def claim(self, image: Image, plan: MachinePlan) -> Vm | None:
        return None

    async def restore(self, image: Image, plan: MachinePlan, vm_id: str, *,
                      boot: bool = False) -> Vm:
        self.check_loadable(image.machine)
        self.check_plan(image, plan, boot)
        if self.fail_restores:
            self.fail_restores -= 1
            raise InvalidStateError(f"restore of {vm_id} failed (FakeRuntime.fail_restores)")
        if image.key in self.images:
            state = copy.deepcopy(self.images[image.key])
        elif image.key in self.captures:
            state = copy.deepcopy(self.captures[image.key][1])
        elif image.is_template:
            state = GuestState()
        else:
            raise NotFoundError(f"image {image.key} is not in the store")
        booted = boot or not image.machine.memory
        if booted:  # a boot from the disk: what lived in memory (tmpfs) is gone
            drop_memory(state)
        state.env = dict(plan.env)
        await asyncio.sleep(0)
        self.restores += 1
        vm = FakeVm(id=vm_id, image=image, cpus=plan.cpus, memory_mb=plan.memory_mb,
                    agent=FakeGuest(state, plan.generation), network=plan.network,
                    booted=booted, disk_mb=plan.disk_mb or 2048)
        self.vms[vm_id] = vm
        return vm

    async def boot_image(self, build: str, plan: MachinePlan) -> tuple[Image, float]:
        image = Image(key=f"tpl-{build}", build=build,
                      machine=self.describe(plan.memory_mb, plan.cpus))
        self.images[image.key] = GuestState(env=dict(plan.env))
        return image, 1.0

    async def publish_template(self, image: Image, info: dict) -> Stored:
        self.templates[str(info["name"])] = info
        return Stored(size_bytes=1 << 20, stored_bytes=1 << 19)

    async def import_template(self, image: Image, info: dict) -> bool:
        if str(info["name"]) in self.templates:
            return False
        self.templates[str(info["name"])] = info
        return True

    async def template_info(self, name: str) -> dict:
        if name not in self.templates:
            raise NotFoundError(f"template {name!r} is not in the store")
        return self.templates[name]

    async def capture(self, vm: Vm, key: str, *, persistent: bool = True,
                      memory: bool = True, sync: bool = False) -> Captured:
        assert isinstance(vm, FakeVm)
        guest = await vm.guest()
        machine = self.describe(vm.memory_mb, vm.cpus)
        image = Image(key=key, build=vm.image.build, persistent=persistent,
                      machine=machine if memory else replace(machine, memory=False))
        state = copy.deepcopy(guest.state)
        if not memory:
            drop_memory(state)
        self.captures[key] = (image, state)
        return Captured(image=image, pause_ms=1.0 if memory else 0.0, total_ms=2.0)

    async def persist(self, captured: Captured, meta: dict) -> Stored:
        await asyncio.sleep(self.persist_delay)
        if self.fail_persist:
            raise StorageError(self.fail_persist)
        _, state = self.captures[captured.image.key]
        self.images[captured.image.key] = copy.deepcopy(state)
        self.metas[captured.image.key] = meta
        size = sum(len(d) for d in state.files.values())
        return Stored(size_bytes=size, stored_bytes=size)

    async def stored_meta(self, key: str) -> dict:
        if key not in self.metas:
            raise NotFoundError(f"image {key} is not in the store")
        return self.metas[key]

    def release(self, key: str) -> None:
        self.captures.pop(key, None)

    async def discard(self, key: str) -> None:
        self.images.pop(key, None)
        self.metas.pop(key, None)

    async def kill(self, vm: Vm) -> None:
        assert isinstance(vm, FakeVm)
        vm.gone = True
        vm.agent.alive = False
        for proc in vm.agent.procs.values():
            if proc.task is not None:
                proc.task.cancel()
        self.vms.pop(vm.id, None)

    async def set_network(self, vm: Vm, policy: NetworkPolicy) -> None:
        assert isinstance(vm, FakeVm)
        vm.network = policy

    async def expose(self, vm: Vm, port: int) -> tuple[str, int]:
        return self.listeners.get(port, ("127.0.0.1", 40000 + port))

    def park_ports(self, vm: Vm) -> dict[int, tuple[str, int]]:
        return dict(self.kept_ports)

    async def wanted(self) -> str:
        return await self.traffic.get()

    def refuse_parked_ports(self, vm_id: str) -> None:
        self.refused.append(vm_id)

    def drop_parked_ports(self, vm_id: str) -> None:
        self.dropped.append(vm_id)

    async def recover(self, expected: dict[str, NetworkPolicy | None],
                      keep_images: set[str]) -> dict[str, Vm]:
        for vm_id in [i for i in self.vms if i not in expected]:
            await self.kill(self.vms[vm_id])
        return {i: vm for i, vm in self.vms.items() if not vm.gone}

    async def close(self, vms: list[Vm], kill: bool) -> None:
        if kill:
            for vm in vms:
                await self.kill(vm)
