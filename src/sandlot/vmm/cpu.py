"""The CPU model guests see, and whether a host can give a snapshot's guest its CPU.

Under TCG every guest gets QEMU's `max` model, which depends on the QEMU version only, so a
snapshot loads on any host with the same QEMU. Under KVM a guest's CPU comes from its host, so
a deployment names one model every host runs (`SANDLOT_CPU_MODEL`): an x86-64 level
(`x86-64-v2`, `-v3`, the default, `-v4`: QEMU's `qemu64` plus that level's features, as
QEMU 7.2 has no such models), a named QEMU model (`Skylake-Server-v4`, `EPYC-v4`), or
`host`/`max` (the host's own CPU: one host, or identical ones). A snapshot records its
model, the instruction-set features its guest saw and its CPU vendor (KVM always shows the
host's); a restore is refused, before anything starts and with the reason, where this host
runs another model, lacks one of those features, or is of another vendor.

`missing_features` is the check itself: pure, on /proc/cpuinfo's flag names.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import InvalidArgumentError
from sandlot.vmm.qemu import QEMU

TCG_MODEL = "max"
HOST_MODEL = "host"
DEFAULT_KVM_MODEL = "x86-64-v3"
PASSTHROUGH = (HOST_MODEL, TCG_MODEL)  # under KVM: the host's own CPU
MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# QEMU's "-cpu X,enforce" names each missing feature: "... feature: CPUID.07H:EBX.avx2 [bit 5]"
ENFORCE_RE = re.compile(r"feature:\s*\S*?\.([A-Za-z0-9_.-]+?)\s*\[bit")
PROBE_TIMEOUT = 30.0

# The x86-64 psABI's micro-architecture levels, in /proc/cpuinfo's names (pni is SSE3, abm
# LZCNT). From v3 on also AES-NI and PCLMULQDQ: every CPU of that level has them, and TLS
# wants them.
_V1 = ("cmov", "cx8", "fpu", "fxsr", "lm", "mmx", "nx", "sse", "sse2", "syscall")
_V2 = _V1 + ("cx16", "lahf_lm", "pni", "popcnt", "sse4_1", "sse4_2", "ssse3")
_V3 = _V2 + ("abm", "aes", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe",
             "pclmulqdq", "xsave")
_V4 = _V3 + ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")
LEVELS: dict[str, tuple[str, ...]] = {"x86-64-v1": _V1, "x86-64-v2": _V2, "x86-64-v3": _V3,
                                      "x86-64-v4": _V4}
QEMU64 = frozenset(_V1 + ("cx16", "lahf_lm", "pni"))  # what `qemu64` has of them already
_QEMU_NAMES = {"sse4_1": "sse4.1", "sse4_2": "sse4.2", "lahf_lm": "lahf-lm"}

# Instruction-set and paging features a guest's kernel or programs may use once seen: what a
# named model records of its definition (the rest of a model, e.g. KVM's paravirtual
# features or x2apic, KVM gives any guest).
ISA = frozenset(_V4 + (
    "adx", "avx512_bf16", "avx512_bitalg", "avx512_fp16", "avx512_vbmi2", "avx512_vnni",
    "avx512_vpopcntdq", "avx512ifma", "avx512vbmi", "avx_vnni", "amx_bf16", "amx_int8",
    "amx_tile", "clflushopt", "clwb", "clzero", "erms", "fma4", "fsgsbase", "fsrm", "gfni",
    "invpcid", "la57", "movdir64b", "movdiri", "pcid", "pdpe1gb", "pku", "rdpid", "rdrand",
    "rdseed", "rdtscp", "serialize", "sha_ni", "smap", "smep", "sse4a", "tbm", "umip",
    "vaes", "vpclmulqdq", "xop", "xsavec", "xsaveopt", "xsaves"))
# /proc/cpuinfo flags of a host's that say nothing of what its guests run (Linux's own
# notes, or what KVM gives every guest): not compared when a `host` snapshot moves
NOT_GUEST = frozenset({
    "arat", "constant_tsc", "cpuid", "hypervisor", "ht", "nonstop_tsc", "nopl", "pti",
    "rep_good", "tsc_known_freq", "tsc_reliable", "x2apic", "tsc_deadline_timer",
    "xtopology", "ibrs", "ibpb", "stibp", "ssbd", "md_clear", "flush_l1d",
    "arch_capabilities", "vmx", "svm", "ept", "vpid", "flexpriority", "tpr_shadow", "vnmi",
    "aperfmperf", "cpuid_fault", "epb", "dtherm", "ida", "pln", "pts", "hwp", "hwp_notify",
    "hwp_act_window", "hwp_epp", "hwp_pkg_req", "intel_ppin", "ibrs_enhanced"})
_ALIASES = {"sse3": "pni", "i64": "lm", "xd": "nx", "pclmuldq": "pclmulqdq"}


def _key(name: str) -> str:
    """A feature's name as both QEMU (`sse4.1`, `lahf-lm`, `avx512vbmi2`) and Linux
    (`sse4_1`, `lahf_lm`, `avx512_vbmi2`) spell it."""
    name = _ALIASES.get(name.lower(), name.lower())
    return re.sub(r"[-._]", "", name)


_ISA_BY_KEY = {_key(f): f for f in ISA}


def missing_features(host_flags: Iterable[str], features: Iterable[str]) -> tuple[str, ...]:
    """Which of `features` (a snapshot's guest saw them) a host with /proc/cpuinfo
    `host_flags` lacks, sorted (empty: it has them all)."""
    have = {_key(f) for f in host_flags}
    return tuple(sorted({f for f in features if _key(f) not in have and f not in NOT_GUEST}))


@dataclass(frozen=True)
class CpuModel:
    """A model as a deployment names it: the `-cpu` argument it becomes and the features
    its guests see (None: the host's own, or unknown until QEMU is asked)."""

    name: str
    arg: str
    features: frozenset[str] | None = None


def choose_model(accel: str, configured: str | None) -> str:
    """The model this host's guests get: the configured one, else `max` (TCG) or the
    baseline (KVM)."""
    if configured:
        if not MODEL_RE.match(configured):
            raise InvalidArgumentError(f"SANDLOT_CPU_MODEL {configured!r} is not a QEMU CPU "
                                       "model name")
        return configured.lower() if configured.lower() in LEVELS else configured
    return TCG_MODEL if accel == "tcg" else DEFAULT_KVM_MODEL


def legacy_model(accel: str) -> str:
    """The model of a snapshot that records none (before format 1.2): the accelerator's
    default then."""
    return TCG_MODEL if accel == "tcg" else HOST_MODEL


def resolve(name: str, accel: str) -> CpuModel:
    """`name` as QEMU runs it: a level becomes `qemu64` plus its features; under KVM a model
    that is not the host's own is enforced (QEMU refuses to start without a feature, where
    it would otherwise leave it out unsaid)."""
    level = LEVELS.get(name.lower())
    if level is not None:
        adds = [f"+{_QEMU_NAMES.get(f, f)}" for f in level if f not in QEMU64]
        arg = ",".join(["qemu64", "-svm", *adds])
        features: frozenset[str] | None = frozenset(level)
    else:
        arg, features = name, None
    if accel == "kvm" and name not in PASSTHROUGH:
        arg += ",enforce"
    return CpuModel(name, arg, features)


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo's first processor."""
    return frozenset(_cpuinfo_field(text, "flags").split())


def cpuinfo_vendor(text: str) -> str:
    """/proc/cpuinfo's vendor (GenuineIntel, AuthenticAMD, ...)."""
    return _cpuinfo_field(text, "vendor_id").strip()


def _cpuinfo_field(text: str, field: str) -> str:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value
    return ""


def enforce_missing(output: str) -> tuple[str, ...]:
    """The features QEMU said the host lacks for an enforced model."""
    return tuple(sorted(set(ENFORCE_RE.findall(output))))


def isa_features(props: dict) -> frozenset[str]:
    """The instruction-set features (Linux's names) among a QMP model expansion's
    properties that are on."""
    return frozenset(_ISA_BY_KEY[_key(k)] for k, v in props.items()
                     if v is True and _key(k) in _ISA_BY_KEY)


@dataclass(frozen=True)
class HostCpu:
    """This host's CPU as restores see it: the model its guests get (`model`, run as
    `arg`), the features they see, this host's own flags and vendor (KVM only: empty under
    TCG, where the QEMU decides), and what it lacks to run its model."""

    model: str
    flags: frozenset[str] = frozenset()
    lacks: tuple[str, ...] = ()
    vendor: str = ""
    features: frozenset[str] = frozenset()
    arg: str = ""

    @classmethod
    def detect(cls, accel: str, configured: str | None, qemu: str = QEMU) -> HostCpu:
        model = resolve(choose_model(accel, configured), accel)
        if accel != "kvm":
            return cls(model.name, arg=model.arg)
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
        return cls.under_kvm(model, cpuinfo_flags(text), cpuinfo_vendor(text), qemu)

    @classmethod
    def under_kvm(cls, model: CpuModel, flags: frozenset[str], vendor: str,
                  qemu: str = QEMU) -> HostCpu:
        """The host under KVM with /proc/cpuinfo's `flags` and `vendor`: a level is checked
        against the flags; a named model is asked of QEMU (what it has, what this host
        lacks of it)."""
        if model.name in PASSTHROUGH:
            features, lacks = flags - NOT_GUEST, ()
        elif model.features is not None:
            features, lacks = model.features, missing_features(flags, model.features)
        else:
            features = expand(qemu, model.name)
            lacks = probe(qemu, model.name, "kvm")
        return cls(model.name, flags, lacks, vendor, features, model.arg)

    def to_doc(self) -> dict:
        """What a host advertises of its CPU to the deployment's placement (core/hosts.py):
        enough for `problems` there (`host`'s features are its flags: not sent twice)."""
        own = self.model in PASSTHROUGH
        return {"model": self.model, "vendor": self.vendor, "flags": sorted(self.flags),
                "lacks": list(self.lacks), "features": [] if own else sorted(self.features)}

    @classmethod
    def from_doc(cls, doc: dict) -> HostCpu:
        return cls(str(doc.get("model") or ""), frozenset(doc.get("flags") or ()),
                   tuple(doc.get("lacks") or ()), str(doc.get("vendor") or ""),
                   frozenset(doc.get("features") or ()))

    def recorded_features(self) -> tuple[str, ...]:
        """The features a snapshot of this host records its guest saw (none under TCG)."""
        return tuple(sorted(self.features)) if self.flags else ()

    def recorded_vendor(self) -> str:
        return self.vendor if self.flags else ""

    def problems(self, model: str, features: tuple[str, ...], vendor: str = "") -> list[str]:
        """Why this host cannot give a snapshot's guest the CPU it was taken on (empty: it
        can)."""
        if model != self.model:
            return [f"it was taken with CPU model {model}, this host runs {self.model} "
                    "(SANDLOT_CPU_MODEL: one model for every host of a deployment)"]
        if self.lacks:
            return [f"this host cannot run CPU model {model}: it lacks "
                    f"{', '.join(self.lacks[:12])}"]
        if vendor and self.vendor and vendor != self.vendor:
            return [f"it was taken on a {vendor} CPU, this host's is {self.vendor} (KVM "
                    "shows a guest its host's vendor: a snapshot stays with one vendor)"]
        # what its guest saw, against what this host gives its guests of the model (for a
        # model QEMU could not expand here: against the host's own flags)
        missing = missing_features(self.features or self.flags, features) if self.flags else ()
        if missing:
            more = f" and {len(missing) - 12} more" if len(missing) > 12 else ""
            return [f"this host's CPU lacks features the snapshot's guest may use: "
                    f"{', '.join(missing[:12])}{more} (name a model every host runs: "
                    "SANDLOT_CPU_MODEL)"]
        return []


def _qemu_qmp(qemu: str, options: list[str], commands: list[dict]
              ) -> subprocess.CompletedProcess | str:
    """A QEMU with `options`, given `commands` on QMP and quit at once (a string: why it
    could not be started)."""
    args = [qemu, *options, "-nodefaults", "-display", "none", "-S", "-qmp", "stdio"]
    script = [{"execute": "qmp_capabilities"}, *commands, {"execute": "quit"}]
    try:
        return subprocess.run(args, input="".join(json.dumps(c) + "\n" for c in script),
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)


def probe(qemu: str, model: str, accel: str) -> tuple[str, ...]:
    """The features this host lacks for `model` (empty: it runs it), from a QEMU started
    with `-cpu model,enforce` that quits at once."""
    proc = _qemu_qmp(qemu, ["-machine", "q35", "-accel", accel, "-cpu", f"{model},enforce"],
                     [])
    if isinstance(proc, str):
        return (f"(QEMU could not be asked: {proc})",)
    lacks = enforce_missing(proc.stderr)
    if proc.returncode != 0 and not lacks:
        return (f"(QEMU refused the model: {proc.stderr.strip()[-200:]})",)
    return lacks


def expand(qemu: str, model: str) -> frozenset[str]:
    """The instruction-set features of QEMU's `model` (QMP `query-cpu-model-expansion`,
    its definition as TCG expands it: no KVM needed); empty if QEMU cannot say."""
    query = {"execute": "query-cpu-model-expansion",
             "arguments": {"type": "full", "model": {"name": model}}}
    proc = _qemu_qmp(qemu, ["-machine", "none", "-accel", "tcg"], [query])
    if isinstance(proc, str):
        return frozenset()
    for line in proc.stdout.splitlines():
        try:
            answer = json.loads(line).get("return")
        except (ValueError, AttributeError):
            continue
        if isinstance(answer, dict) and isinstance(answer.get("model"), dict):
            return isa_features(answer["model"].get("props") or {})
    return frozenset()
