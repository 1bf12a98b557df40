"""The CPU model guests see, and whether a host can give a snapshot's guest its CPU.

Under TCG every guest gets QEMU's `max` model, which depends on the QEMU version only, so a
snapshot loads on any host with the same QEMU. Under KVM the model is the host's CPU unless
the operator names one: `-cpu host` (the default) shows the guest its host's features, so a
snapshot taken there may use features another host lacks; a named model (`SANDLOT_CPU_MODEL`,
e.g. `Haswell-noTSX-IBRS` or `EPYC-Rome`) is the same on every host that can run it, which is
what a deployment of mixed hosts wants. A snapshot records its model (and, for `host`, the
features its guest saw); a restore is refused, before anything starts and with the reason,
where this host runs another model or lacks a feature.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import InvalidArgumentError
from sandlot.vmm.qemu import QEMU

TCG_MODEL = "max"
HOST_MODEL = "host"
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# QEMU's "-cpu X,enforce" names each missing feature: "... feature: CPUID.07H:EBX.avx2 [bit 5]"
MISSING_RE = re.compile(r"feature:\s*\S*?\.([A-Za-z0-9_.-]+?)\s*\[bit")
PROBE_TIMEOUT = 30.0


def choose_model(accel: str, configured: str | None) -> str:
    """The `-cpu` model this host's guests get: the configured one, else `max` (TCG) or
    `host` (KVM)."""
    if configured:
        if not MODEL_RE.match(configured):
            raise InvalidArgumentError(f"SANDLOT_CPU_MODEL {configured!r} is not a QEMU CPU "
                                       "model name")
        return configured
    return TCG_MODEL if accel == "tcg" else HOST_MODEL


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo's first processor."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def missing_features(output: str) -> tuple[str, ...]:
    """The features QEMU said the host lacks for an enforced model."""
    return tuple(sorted(set(MISSING_RE.findall(output))))


@dataclass(frozen=True)
class HostCpu:
    """This host's CPU as restores see it: the model its guests get, its own features (for
    `host`), and what it lacks to run its model (a named one, under KVM)."""

    model: str
    flags: frozenset[str] = frozenset()
    lacks: tuple[str, ...] = ()

    @classmethod
    def detect(cls, accel: str, configured: str | None, qemu: str = QEMU) -> HostCpu:
        model = choose_model(accel, configured)
        if accel != "kvm":
            return cls(model)
        try:
            flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
        except OSError:
            flags = frozenset()
        lacks = () if model in (HOST_MODEL, TCG_MODEL) else probe(qemu, model, accel)
        return cls(model, flags, lacks)

    def recorded_features(self) -> tuple[str, ...]:
        """What a snapshot of this host records of its guest's CPU: `host`'s features (the
        model's name says what a named model has)."""
        return tuple(sorted(self.flags)) if self.model == HOST_MODEL else ()

    def problems(self, model: str, features: tuple[str, ...]) -> list[str]:
        """Why this host cannot give a snapshot's guest the CPU it was taken on (empty: it
        can)."""
        if model != self.model:
            return [f"it was taken with CPU model {model}, this host runs {self.model} "
                    "(SANDLOT_CPU_MODEL: one model for every host of a deployment)"]
        if self.lacks:
            return [f"this host cannot run CPU model {model}: it lacks "
                    f"{', '.join(self.lacks[:12])}"]
        missing = sorted(set(features) - self.flags) if model == HOST_MODEL else []
        if missing and self.flags:
            more = f" and {len(missing) - 12} more" if len(missing) > 12 else ""
            return [f"this host's CPU lacks features the snapshot's guest may use: "
                    f"{', '.join(missing[:12])}{more} (name a model every host runs: "
                    "SANDLOT_CPU_MODEL)"]
        return []


def probe(qemu: str, model: str, accel: str) -> tuple[str, ...]:
    """The features this host lacks for `model` (empty: it runs it), from a QEMU started
    with `-cpu model,enforce` that quits at once."""
    args = [qemu, "-machine", "q35", "-accel", accel, "-cpu", f"{model},enforce",
            "-nodefaults", "-display", "none", "-S", "-qmp", "stdio"]
    try:
        proc = subprocess.run(args, input='{"execute": "qmp_capabilities"}\n'
                                          '{"execute": "quit"}\n',
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return (f"(QEMU could not be asked: {e})",)
    lacks = missing_features(proc.stderr)
    if proc.returncode != 0 and not lacks:
        return (f"(QEMU refused the model: {proc.stderr.strip()[-200:]})",)
    return lacks
