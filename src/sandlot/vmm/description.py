"""What machine a snapshot was taken of: the versioned record every restore checks first.

Stored in each snapshot's manifest and record. A restore refuses, before anything starts and
with the reason, a snapshot whose machine this host cannot load: a machine type its QEMU lacks,
another device model, another accelerator's CPU model, another guest protocol, or a record
format it does not know (a different major version, or a newer minor one; Firecracker's
snapshot versioning works the same way).

Memory has one name per quantity: `base_mb` is the main RAM backend, `dimm_mb` the hotplugged
DIMM, `memory_mb` their sum (the size users ask for).

A filesystem-only image (`memory` false: a disk, no RAM or device state) is booted, not loaded:
any host whose guest protocol matches can start it, whatever its QEMU, device model or
accelerator (format 1.1; a 1.0 record is an image with memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from sandlot.errors import InvalidStateError
from sandlot.guest.protocol import PROTO_VERSION
from sandlot.vmm.cpu import HostCpu, legacy_model
from sandlot.vmm.qemu import QemuInfo

FORMAT = "1.3"  # major.minor of this record (1.2: the CPU model; 1.3: its features, vendor)


def _version(text: str) -> tuple[int, int]:
    major, _, minor = str(text).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return (-1, 0)


@dataclass(frozen=True)
class MachineDescription:
    machine_type: str  # versioned, e.g. "pc-q35-7.2"
    qemu_version: str  # the QEMU that took it (informational: the type decides loadability)
    device_model: str  # fingerprint of the device command line (vmm/machine.DEVICE_MODEL)
    accel: str  # kvm or tcg: they run different CPU models
    base_mb: int
    dimm_mb: int = 0
    cpus: int = 1  # online when taken
    guest_proto: int = PROTO_VERSION
    format: str = FORMAT
    memory: bool = True  # False: filesystem only (booted from its disk on restore)
    # the guest's CPU model ("": the accelerator's default before 1.2: max, or host under
    # KVM), the features its guest saw (1.2: for `host` only; 1.3: every model under KVM)
    # and, under KVM, its host's vendor (1.3) (vmm/cpu.py)
    cpu_model: str = ""
    cpu_features: tuple[str, ...] = ()
    cpu_vendor: str = ""

    @property
    def memory_mb(self) -> int:
        return self.base_mb + self.dimm_mb

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> MachineDescription:
        """Parse a stored record; refuses formats this version cannot read."""
        if not isinstance(data, dict):
            raise InvalidStateError("the snapshot does not describe its machine (it was taken "
                                    "by an older sandlot); it cannot be restored")
        fmt = str(data.get("format", "0.0"))
        have, mine = _version(fmt), _version(FORMAT)
        if have[0] != mine[0] or have[1] > mine[1]:
            raise InvalidStateError(f"the snapshot's machine record has format {fmt}; this "
                                    f"sandlot reads {mine[0]}.0 to {FORMAT}")
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["cpu_features"] = tuple(data.get("cpu_features") or ())
        try:
            return cls(**data)
        except TypeError as e:
            raise InvalidStateError(f"the snapshot's machine record is incomplete: {e}") from e

    def problems(self, host: QemuInfo, device_model: str, accel: str, cpu: HostCpu
                 ) -> list[str]:
        """Why this host, with its QEMU and `cpu`, cannot load it (empty: it can)."""
        out = []
        if not self.memory:  # booted from its disk: only the guest inside must match
            return self._guest_problems()
        if self.machine_type not in host.machine_types:
            out.append(f"it was taken with machine type {self.machine_type} (QEMU "
                       f"{self.qemu_version}), which this host's QEMU {host.version} lacks")
        if self.device_model != device_model:
            out.append(f"it was taken with VM device model {self.device_model}, this server "
                       f"runs model {device_model}")
        return out + self.cpu_problems(accel, cpu) + self._guest_problems()

    def cpu_problems(self, accel: str, cpu: HostCpu) -> list[str]:
        """Why a host running `accel` on `cpu` cannot give its guest its CPU (empty: it
        can; a filesystem-only image boots on any)."""
        if not self.memory:
            return []
        if self.accel != accel:
            return [f"it was taken under {self.accel}, this server runs {accel}"]
        return cpu.problems(self.cpu_model or legacy_model(self.accel), self.cpu_features,
                            self.cpu_vendor)

    def _guest_problems(self) -> list[str]:
        if self.guest_proto != PROTO_VERSION:
            return [f"its guest agent speaks protocol {self.guest_proto}, this server "
                    f"{PROTO_VERSION}"]
        return []
