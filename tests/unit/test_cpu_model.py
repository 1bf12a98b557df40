"""The guests' CPU model (vmm/cpu.py): which model a host gives, the features of a baseline,
what a snapshot records, and the refusal, before anything starts, of a restore on a host that
cannot give a snapshot's guest its CPU. The KVM path is unit-tested here: this machine runs
TCG."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from sandlot.errors import InvalidArgumentError, InvalidStateError
from sandlot.runtime.host import describe
from sandlot.vmm.accel import accel_args
from sandlot.vmm.cpu import (
    LEVELS,
    HostCpu,
    choose_model,
    cpuinfo_flags,
    cpuinfo_vendor,
    enforce_missing,
    expand,
    isa_features,
    missing_features,
    probe,
    resolve,
)
from sandlot.vmm.description import FORMAT, MachineDescription
from sandlot.vmm.machine import MachineSpec
from sandlot.vmm.qemu import QemuInfo

QEMU = QemuInfo(version="7.2.0", machine_types=frozenset({"pc-q35-7.2"}),
                default_q35="pc-q35-7.2")
ENFORCE_ERROR = (
    "qemu-system-x86_64: warning: host doesn't support requested feature: "
    "CPUID.07H:EBX.avx512f [bit 16]\n"
    "qemu-system-x86_64: warning: host doesn't support requested feature: "
    "CPUID.80000001H:ECX.xop [bit 11]\n"
    "qemu-system-x86_64: Host doesn't support requested features\n")
# a Haswell-era host: x86-64-v3 and AES, no AVX-512 (/proc/cpuinfo's names)
HASWELL = frozenset(LEVELS["x86-64-v3"]) | {"hypervisor", "constant_tsc", "erms", "invpcid"}
SKYLAKE = HASWELL | set(LEVELS["x86-64-v4"])


def machine(accel: str, **kw) -> MachineDescription:
    return MachineDescription(machine_type="pc-q35-7.2", qemu_version="7.2.0",
                              device_model="m", accel=accel, base_mb=512, **kw)


def kvm_host(model: str, flags: frozenset[str], vendor: str = "GenuineIntel") -> HostCpu:
    return HostCpu.under_kvm(resolve(choose_model("kvm", model), "kvm"), flags, vendor)


def taken_on(host: HostCpu, **kw) -> MachineDescription:
    """What a snapshot taken on `host` records (as the runtime's `describe` makes it)."""
    spec = MachineSpec(run_dir=Path("/r"), kernel=Path("/k"), initrd=Path("/i"),
                       disk=Path("/d"), machine_type="pc-q35-7.2",
                       accel="kvm" if host.flags else "tcg", cpu_model=host.arg)
    return replace(describe(spec, 1, host), device_model="m", **kw)


def test_the_model_a_host_gives_its_guests(monkeypatch) -> None:
    assert choose_model("tcg", None) == "max"
    assert choose_model("kvm", None) == "x86-64-v3"  # a baseline, not the host's CPU
    assert choose_model("kvm", "EPYC-Rome") == "EPYC-Rome"
    assert choose_model("kvm", "X86-64-V2") == "x86-64-v2"  # one spelling on every host
    assert choose_model("kvm", "host") == "host"
    with pytest.raises(InvalidArgumentError, match="SANDLOT_CPU_MODEL"):
        choose_model("kvm", "host,+avx;rm -rf")
    from sandlot.config import Settings
    monkeypatch.setenv("SANDLOT_CPU_MODEL", "Skylake-Server-v4")
    assert Settings.from_env().cpu_model == "Skylake-Server-v4"
    monkeypatch.delenv("SANDLOT_CPU_MODEL")
    assert Settings.from_env().cpu_model is None


def test_a_level_is_qemu64_with_its_features_and_kvm_enforces_it() -> None:
    v2, v3, v4 = (set(LEVELS[f"x86-64-v{n}"]) for n in (2, 3, 4))
    assert {"sse4_2", "popcnt", "ssse3", "cx16"} <= v2 < v3 < v4
    assert {"avx", "avx2", "bmi2", "fma", "movbe", "aes"} <= v3 and "avx512f" not in v3
    assert {"avx512f", "avx512bw", "avx512vl"} <= v4
    model = resolve("x86-64-v3", "kvm")
    args = model.arg.split(",")
    assert args[0] == "qemu64" and args[-1] == "enforce" and "-svm" in args
    assert {"+avx2", "+sse4.2", "+fma"} <= set(args)  # QEMU's spelling of sse4_2
    assert model.features == frozenset(LEVELS["x86-64-v3"])
    # a named model is QEMU's; the host's own is never enforced; TCG as before
    assert resolve("EPYC-Rome", "kvm").arg == "EPYC-Rome,enforce"
    assert resolve("host", "kvm").arg == "host" and resolve("max", "tcg").arg == "max"
    assert resolve("x86-64-v3", "tcg").arg == model.arg.removesuffix(",enforce")
    assert accel_args("kvm", model.arg)[-2:] == ["-cpu", model.arg]


def test_what_is_missing_is_a_pure_answer_on_cpuinfo_names() -> None:
    assert missing_features(HASWELL, LEVELS["x86-64-v3"]) == ()
    assert missing_features(HASWELL, LEVELS["x86-64-v4"]) == (
        "avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")
    # QEMU's and Linux's spellings of one feature are one feature
    assert missing_features({"sse4_1", "lahf_lm", "avx512_vbmi2"},
                            ["sse4.1", "lahf-lm", "avx512vbmi2", "pni"]) == ("pni",)
    # a host's flags that say nothing of what its guests run are not asked for
    assert missing_features(set(), ["hypervisor", "constant_tsc", "x2apic"]) == ()


def test_what_qemu_and_proc_say_is_read(tmp_path) -> None:
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2\nbugs\t: x\n"
    assert cpuinfo_flags(text) == {"fpu", "sse2", "avx", "avx2"}
    assert cpuinfo_vendor(text) == "AuthenticAMD" and cpuinfo_vendor("") == ""
    assert enforce_missing(ENFORCE_ERROR) == ("avx512f", "xop")
    props = {"avx512f": True, "sse4.1": True, "sse4_1": True, "sse4-1": True, "xop": False,
             "kvmclock": True, "lahf-lm": True, "avx512vbmi2": True, "family": 6}
    assert isa_features(props) == {"avx512f", "sse4_1", "lahf_lm", "avx512_vbmi2"}
    # query-cpu-model-expansion's answer, from a QEMU that answers QMP on stdin
    answer = {"return": {"model": {"name": "Skylake-Server-v4", "props": props}}}
    fake = tmp_path / "qemu"
    fake.write_text("#!/bin/sh\ncat >/dev/null\necho '{\"QMP\": {}}'\necho '{\"return\": {}}'\n"
                    f"echo '{json.dumps(answer)}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert expand(str(fake), "Skylake-Server-v4") == isa_features(props)
    # a host under KVM with a named model: its features from QEMU, and QEMU ran it
    host = HostCpu.under_kvm(resolve("Skylake-Server-v4", "kvm"), SKYLAKE, "GenuineIntel",
                             str(fake))
    assert host.features == isa_features(props) and host.lacks == ()
    assert host.arg == "Skylake-Server-v4,enforce"
    assert expand(str(tmp_path / "none"), "Skylake-Server-v4") == frozenset()


def test_a_probe_asks_qemu_with_enforce(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "qemu"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *Icelake*) printf '%s' \"$ERR\" >&2; exit 1;; "
                    "esac\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("ERR", ENFORCE_ERROR)
    assert probe(str(fake), "Icelake-Server", "kvm") == ("avx512f", "xop")
    assert probe(str(fake), "Haswell-noTSX", "kvm") == ()
    assert probe(str(tmp_path / "none"), "Haswell", "kvm")[0].startswith("(QEMU could not")


def test_a_snapshot_records_its_model_features_and_vendor() -> None:
    host = kvm_host(None, HASWELL)  # type: ignore[arg-type]
    d = taken_on(host)
    assert d.format == FORMAT == "1.3"
    assert d.cpu_model == "x86-64-v3" and d.cpu_vendor == "GenuineIntel"
    assert set(d.cpu_features) == set(LEVELS["x86-64-v3"]) and "avx2" in d.cpu_features
    again = MachineDescription.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again == d
    # `host`: the host's own flags, less Linux's notes
    own = taken_on(kvm_host("host", HASWELL))
    assert "avx2" in own.cpu_features and "constant_tsc" not in own.cpu_features
    # TCG as before: `max`, no features, no vendor
    tcg = HostCpu.detect("tcg", None)
    assert tcg == HostCpu("max", arg="max")
    d = taken_on(tcg)
    assert (d.cpu_model, d.cpu_features, d.cpu_vendor) == ("max", (), "")


def test_a_restore_is_refused_where_the_guest_would_lose_its_cpu() -> None:
    # a deployment on x86-64-v4: a host without AVX-512 cannot run it, and says what it lacks
    skylake = kvm_host("x86-64-v4", SKYLAKE)
    haswell = kvm_host("x86-64-v4", HASWELL)
    assert skylake.lacks == () and haswell.lacks[:4] == ("avx512bw", "avx512cd", "avx512dq",
                                                          "avx512f")
    snap = taken_on(skylake)
    assert snap.problems(QEMU, "m", "kvm", skylake) == []
    problems = snap.problems(QEMU, "m", "kvm", haswell)
    assert len(problems) == 1 and "cannot run CPU model x86-64-v4" in problems[0]
    assert "avx512f" in problems[0]
    # a snapshot of `host` on a CPU with avx512f: a host without it is refused, naming it
    own = taken_on(kvm_host("host", SKYLAKE))
    problems = own.problems(QEMU, "m", "kvm", kvm_host("host", HASWELL))
    assert len(problems) == 1 and "avx512f" in problems[0] and "SANDLOT_CPU_MODEL" in problems[0]
    assert own.problems(QEMU, "m", "kvm", kvm_host("host", SKYLAKE | {"sha_ni"})) == []
    # a named model: QEMU's probe found this host runs it (no `lacks`); what its guest saw is
    # checked against what this host gives of the model (its QMP expansion here)
    named = HostCpu("Haswell-noTSX-IBRS", SKYLAKE, (), "GenuineIntel",
                    frozenset(LEVELS["x86-64-v3"]) | {"invpcid"}, "Haswell-noTSX-IBRS,enforce")
    rec = machine("kvm", cpu_model="Haswell-noTSX-IBRS", cpu_features=("avx2", "invpcid"))
    assert rec.problems(QEMU, "m", "kvm", named) == []
    rec = machine("kvm", cpu_model="Haswell-noTSX-IBRS", cpu_features=("avx2", "avx512f"))
    assert "avx512f" in rec.problems(QEMU, "m", "kvm", named)[0]
    # a host that cannot run the named model (QEMU's probe said so) names what it lacks
    weak = replace(named, lacks=("avx2",))
    assert "cannot run CPU model Haswell-noTSX-IBRS: it lacks avx2" in rec.problems(
        QEMU, "m", "kvm", weak)[0]
    # another model: both named
    problems = snap.problems(QEMU, "m", "kvm", kvm_host(None, SKYLAKE))  # type: ignore[arg-type]
    assert "taken with CPU model x86-64-v4" in problems[0] and "runs x86-64-v3" in problems[0]
    # another vendor: KVM shows the guest its host's
    amd = kvm_host("x86-64-v4", SKYLAKE, vendor="AuthenticAMD")
    assert "GenuineIntel" in snap.problems(QEMU, "m", "kvm", amd)[0]
    # a filesystem-only snapshot boots: any CPU
    assert machine("kvm", cpu_model="host", cpu_features=("avx512f",), memory=False).problems(
        QEMU, "m", "kvm", haswell) == []
    # TCG as before: max everywhere
    assert machine("tcg", cpu_model="max").problems(QEMU, "m", "tcg", HostCpu("max")) == []


def test_records_before_cpu_features_load_as_before() -> None:
    old = {k: v for k, v in machine("tcg").to_dict().items()
           if k not in ("cpu_model", "cpu_features", "cpu_vendor")}
    old["format"] = "1.1"
    loaded = MachineDescription.from_dict(old)
    assert loaded.cpu_model == "" and loaded.cpu_features == () and loaded.cpu_vendor == ""
    assert loaded.problems(QEMU, "m", "tcg", HostCpu.detect("tcg", None)) == []
    # under KVM a record without a model was taken with `host`: so it loads there, and a host
    # of the new default says why it does not
    kvm_old = MachineDescription.from_dict({**old, "accel": "kvm"})
    assert kvm_old.problems(QEMU, "m", "kvm", kvm_host("host", HASWELL)) == []
    problems = kvm_old.problems(QEMU, "m", "kvm", kvm_host(None, HASWELL))  # type: ignore[arg-type]
    assert "taken with CPU model host" in problems[0] and "x86-64-v3" in problems[0]
    # 1.2: a named model and no features recorded: the model decides
    v12 = MachineDescription.from_dict({**old, "accel": "kvm", "format": "1.2",
                                        "cpu_model": "x86-64-v3"})
    assert v12.problems(QEMU, "m", "kvm", kvm_host(None, HASWELL)) == []  # type: ignore[arg-type]
    with pytest.raises(InvalidStateError, match="format 1.4"):
        MachineDescription.from_dict({**old, "format": "1.4"})


async def test_the_refusal_reaches_the_client_as_a_409_before_anything_starts(tmp_path
                                                                           ) -> None:
    import httpx

    from sandlot.core.tenancy import Principal
    from sandlot.testing import in_process

    async with in_process(tmp_path) as srv:
        async with httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url,
                                     headers={"authorization": f"Bearer {srv.key}"}) as api:
            sid = (await api.post("/v1/sandboxes", json={})).json()["sandbox_id"]
            r = await api.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "wide"})
            await api.post(f"/v1/snapshots/{r.json()['snapshot_id']}/wait",
                           params={"timeout": 5})
            rec = await srv.core.snapshots.get("wide", Principal("test"))
            skylake = kvm_host("x86-64-v4", SKYLAKE)
            rec.machine = {**rec.machine, "accel": "kvm", **{
                k: v for k, v in taken_on(skylake).to_dict().items() if k.startswith("cpu_")}}
            await srv.core.snapshots._save(rec)
            srv.runtime.accel = "kvm"
            srv.runtime.host_cpu = kvm_host("x86-64-v4", HASWELL)
            restores = srv.runtime.restores
            for call in (api.post("/v1/snapshots/wide/restore"),
                         api.post("/v1/snapshots/wide/fork", json={"count": 1})):
                r = await call
                assert r.status_code == 409, r.text
                error = r.json()["error"]
                assert error["type"] == "InvalidStateError" and "avx512f" in error["message"]
            assert srv.runtime.restores == restores
            srv.runtime.host_cpu = skylake
            r = await api.post("/v1/snapshots/wide/restore")
            assert r.status_code == 201, r.text


async def test_placement_puts_an_image_first_where_its_cpu_can_be_given(tmp_path) -> None:
    from sandlot.config import Settings
    from sandlot.core.db.common import HostRow
    from sandlot.core.hosts import Hosts, Need, _cpu_doc

    skylake = kvm_host("x86-64-v4", SKYLAKE)
    cpus = {"h-old": kvm_host("x86-64-v4", HASWELL),  # lacks AVX-512: cannot run the model
            "h-amd": kvm_host("x86-64-v4", SKYLAKE, vendor="AuthenticAMD"),
            "h-good": skylake, "h-unknown": None}  # (a host of before: advertises nothing)

    class Db:
        shared = True

        async def hosts(self) -> list[HostRow]:
            return [HostRow(h, f"http://{h}", "active", {
                "slots": 4, "memory_free_mb": 4096, **self.hosts_doc(h),
                **_cpu_doc(("kvm", cpu) if cpu else None)}, 0.1) for h, cpu in cpus.items()]

        def hosts_doc(self, host: str) -> dict:
            return {}

    hosts = Hosts(Settings(data_dir=tmp_path), Db(), None, "h-old",  # type: ignore[arg-type]
                  running=lambda: 0)
    assert HostCpu.from_doc(skylake.to_doc()) == replace(skylake, arg="")
    placed = [h.id for h in await hosts.place(Need(memory_mb=512, machine=taken_on(skylake)))]
    assert set(placed[:2]) == {"h-good", "h-unknown"} and set(placed[2:]) == {"h-old", "h-amd"}
    # an image without a CPU to give (or a filesystem-only one): this host first, as before
    assert [h.id for h in await hosts.place(Need(memory_mb=512))][0] == "h-old"
    fs_only = replace(taken_on(skylake), memory=False)
    assert [h.id for h in await hosts.place(Need(memory_mb=512, machine=fs_only))][0] == "h-old"
    # a host short of disk for the sandbox (as it last said) is tried after those with room
    disk = {"h-old": 1024, "h-amd": 8192, "h-good": 8192, "h-unknown": 8192}
    Db.hosts_doc = lambda self, h: {"disk_free_mb": disk[h]}
    assert [h.id for h in await hosts.place(Need(memory_mb=512))][-1] == "h-old"
    assert [h.id for h in await hosts.place(Need(memory_mb=512, disk_mb=512))][0] == "h-old"
