"""The guests' CPU model (vmm/cpu.py): which model a host gives, what a snapshot records, and
the refusal, before anything starts, of a restore on a host that cannot give a snapshot's
guest its CPU. The KVM path is unit-tested here: this machine runs TCG."""

from __future__ import annotations

import stat

import pytest

from sandlot.errors import InvalidArgumentError
from sandlot.vmm.accel import accel_args
from sandlot.vmm.cpu import HostCpu, choose_model, cpuinfo_flags, missing_features, probe
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.qemu import QemuInfo

QEMU = QemuInfo(version="7.2.0", machine_types=frozenset({"pc-q35-7.2"}),
                default_q35="pc-q35-7.2")
ENFORCE_ERROR = (
    "qemu-system-x86_64: warning: host doesn't support requested feature: "
    "CPUID.07H:EBX.avx512f [bit 16]\n"
    "qemu-system-x86_64: warning: host doesn't support requested feature: "
    "CPUID.80000001H:ECX.xop [bit 11]\n"
    "qemu-system-x86_64: Host doesn't support requested features\n")


def machine(accel: str, **kw) -> MachineDescription:
    return MachineDescription(machine_type="pc-q35-7.2", qemu_version="7.2.0",
                              device_model="m", accel=accel, base_mb=512, **kw)


def test_the_model_a_host_gives_its_guests() -> None:
    assert choose_model("tcg", None) == "max"
    assert choose_model("kvm", None) == "host"
    assert choose_model("kvm", "EPYC-Rome") == "EPYC-Rome"
    with pytest.raises(InvalidArgumentError):
        choose_model("kvm", "host,+avx;rm -rf")
    assert accel_args("kvm", "EPYC-Rome")[-2:] == ["-cpu", "EPYC-Rome"]
    assert accel_args("kvm")[-1] == "host" and accel_args("tcg")[-1] == "max"
    assert HostCpu.detect("tcg", None) == HostCpu("max")


def test_what_qemu_and_proc_say_is_read() -> None:
    text = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2\nbugs\t: x\n"
    assert cpuinfo_flags(text) == {"fpu", "sse2", "avx", "avx2"}
    assert missing_features(ENFORCE_ERROR) == ("avx512f", "xop")


def test_a_probe_asks_qemu_with_enforce(tmp_path) -> None:
    fake = tmp_path / "qemu"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *Icelake*) printf '%s' \"$ERR\" >&2; exit 1;; "
                    "esac\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    import os
    os.environ["ERR"] = ENFORCE_ERROR
    try:
        assert probe(str(fake), "Icelake-Server", "kvm") == ("avx512f", "xop")
        assert probe(str(fake), "Haswell-noTSX", "kvm") == ()
    finally:
        del os.environ["ERR"]
    assert probe(str(tmp_path / "none"), "Haswell", "kvm")[0].startswith("(QEMU could not")


def test_a_restore_is_refused_where_the_guest_would_lose_its_cpu() -> None:
    host = HostCpu("host", frozenset({"sse2", "avx", "avx2"}))
    # taken with `host` on a CPU with avx512f: this host lacks it
    snap = machine("kvm", cpu_model="host", cpu_features=("avx", "avx512f", "sse2"))
    problems = snap.problems(QEMU, "m", "kvm", host)
    assert len(problems) == 1 and "avx512f" in problems[0] and "SANDLOT_CPU_MODEL" in problems[0]
    # a host with all of them takes it
    assert machine("kvm", cpu_model="host", cpu_features=("avx", "sse2")).problems(
        QEMU, "m", "kvm", host) == []
    # a deployment's named model: the same model loads, another is refused with both names
    named = HostCpu("Haswell-noTSX-IBRS", frozenset({"avx"}))
    assert machine("kvm", cpu_model="Haswell-noTSX-IBRS").problems(QEMU, "m", "kvm", named) == []
    problems = snap.problems(QEMU, "m", "kvm", named)
    assert "taken with CPU model host" in problems[0] and "Haswell-noTSX-IBRS" in problems[0]
    # a host that cannot run its own model says so
    weak = HostCpu("Icelake-Server", lacks=("avx512f",))
    assert "cannot run CPU model Icelake-Server" in machine(
        "kvm", cpu_model="Icelake-Server").problems(QEMU, "m", "kvm", weak)[0]
    # TCG as before: max everywhere
    assert machine("tcg", cpu_model="max").problems(QEMU, "m", "tcg", HostCpu("max")) == []
    # a filesystem-only snapshot boots: any CPU
    assert machine("kvm", cpu_model="host", cpu_features=("avx512f",), memory=False).problems(
        QEMU, "m", "kvm", named) == []


def test_records_before_cpu_models_load_as_the_accelerators_default() -> None:
    old = {k: v for k, v in machine("tcg").to_dict().items()
           if k not in ("cpu_model", "cpu_features")}
    old["format"] = "1.1"
    loaded = MachineDescription.from_dict(old)
    assert loaded.cpu_model == "" and loaded.cpu_features == ()
    assert loaded.problems(QEMU, "m", "tcg", HostCpu("max")) == []
    kvm_old = MachineDescription.from_dict({**old, "accel": "kvm"})
    assert kvm_old.problems(QEMU, "m", "kvm", HostCpu("host", frozenset({"avx"}))) == []
    assert kvm_old.problems(QEMU, "m", "kvm", HostCpu("EPYC-Rome"))  # taken with host
    again = MachineDescription.from_dict(machine("kvm", cpu_model="host",
                                                 cpu_features=("avx",)).to_dict())
    assert again.cpu_features == ("avx",)


def test_settings_probe_the_accelerator_only_when_asked(monkeypatch) -> None:
    from sandlot import config

    probes = []
    monkeypatch.setattr(config, "detect_accel", lambda: probes.append(1) or "tcg")
    monkeypatch.delenv("SANDLOT_ACCEL", raising=False)
    settings = config.Settings.from_env()
    assert config.Settings().accel is None and settings.accel is None and probes == []
    assert settings.accelerator == "tcg" and settings.accelerator == "tcg" and probes == [1]
    monkeypatch.setenv("SANDLOT_ACCEL", "kvm")
    assert config.Settings.from_env().accelerator == "kvm" and probes == [1]
    monkeypatch.setenv("SANDLOT_ACCEL", "xen")
    with pytest.raises(InvalidArgumentError, match="SANDLOT_ACCEL must be kvm or tcg"):
        config.Settings.from_env()
