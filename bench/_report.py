"""The figures: JSON (a fixed set of keys, plus details) and a rich table."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from _plan import Plan
from _stats import Series
from _steps import Results

PEER_KEYS = ("peer_restore_ms_p50", "peer_fork8_wall_ms")
REQUIRED = (
    "cold_boot_ms", "create_ms_p50", "exec_ms_p50", "file_mb_s", "snapshot_pause_ms_p50",
    "snapshot_ready_ms_p50", "restore_ms_p50", "fork1_ms_p50", "fork8_wall_ms", "fork32_wall_ms",
    "fork_private_mib", "fork_pss_mib", "idle20_pss_mib", "snapshot_stored_mib",
    *PEER_KEYS, "accel", "host",
)
# required key -> the series it is the median of
FROM_SERIES = {
    "cold_boot_ms": "cold_boot_ms", "create_ms_p50": "create_ms", "exec_ms_p50": "exec_ms",
    "file_mb_s": "file_mb_s", "snapshot_pause_ms_p50": "snapshot_pause_ms",
    "snapshot_ready_ms_p50": "snapshot_ready_ms", "restore_ms_p50": "restore_ms",
    "fork1_ms_p50": "fork1_ms", "fork8_wall_ms": "fork8_wall_ms",
    "fork32_wall_ms": "fork32_wall_ms", "fork_private_mib": "fork8_private_mib",
    "fork_pss_mib": "fork8_pss_mib", "snapshot_stored_mib": "snapshot_stored_mib",
    "fork_parent_pause_ms_p50": "fork_parent_pause_ms",
    "incremental_ready_ms_p50": "incremental_ready_ms",
    "incremental_stored_mib_p50": "incremental_stored_mib",
    "restore_empty_cache_ms_p50": "restore_empty_cache_ms",
    "fs_snapshot_ready_ms_p50": "fs_snapshot_ready_ms",
    "fs_snapshot_stored_mib_p50": "fs_snapshot_stored_mib", "fs_boot_ms_p50": "fs_boot_ms",
}
TARGETS = {  # key -> (comparison, limit); from the issues
    "create_ms_p50": ("<=", 150), "snapshot_pause_ms_p50": ("<=", 30),
    "snapshot_pause_big_ms_p50": ("<=", 30),
    "fork1_ms_p50": ("<=", 150), "fork8_wall_ms": ("<=", 800), "fork32_wall_ms": ("<=", 3000),
    "fork_private_mib": ("<=", 8), "fork_pss_mib": ("<=", 60), "create_speedup": (">=", 40),
    "fork_parent_pause_ms_p50": ("<=", 30), "incremental_ready_ms_p50": ("<=", 1000),
    "incremental_stored_ratio": ("<=", 0.15), "incremental_total_ratio": ("<=", 1.5),
    # ratios to gVisor in the same run
    "restore_speedup_vs_peer": (">=", 1), "fork8_speedup_vs_peer": (">=", 1),
    "snapshot_ready_speedup_vs_peer_checkpoint": (">=", 0.33),
}


def host_info() -> dict:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
    try:
        qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                              text=True, timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        qemu = "unknown"
    return {"cores": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1), "cpu_model": model,
            "kernel": platform.release(), "qemu": qemu,
            "kvm": "PVM (no VMX/SVM)" if os.path.exists("/sys/module/kvm_pvm") else
            ("present" if os.path.exists("/dev/kvm") else "absent")}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 2)


def _round(x: object) -> object:
    return round(x, 2) if isinstance(x, float) else x


def build_json(results: Results, plan: Plan, peer: dict, accel: str, run: dict) -> dict:
    s = results.series
    out: dict = {}
    for key, name in FROM_SERIES.items():
        series = s.get(name, Series())
        out[key] = _round(series.p50)
        p90_key = key[:-4] + "_p90" if key.endswith("_p50") else key + "_p90"
        out[p90_key] = _round(series.p90)
    out["idle20_pss_mib"] = _round(results.values.get("idle20_pss_mib"))
    big = s.get(f"snapshot{plan.big_memory_mb}_pause_ms", Series())
    out["snapshot_pause_big_ms_p50"] = _round(big.p50)
    out["snapshot_pause_big_ms_p90"] = _round(big.p90)
    out["snapshot_pause_big_memory_mb"] = plan.big_memory_mb or None
    peer_ok = "unavailable" not in peer
    out["peer_restore_ms_p50"] = _round(peer.get("restore_ms_p50")) if peer_ok else None
    out["peer_fork8_wall_ms"] = _round(peer.get("fork8_wall_ms")) if peer_ok else None
    first = results.values.get("incremental_first_stored_mib")
    out["incremental_stored_ratio"] = _round(_ratio(out["incremental_stored_mib_p50"], first))
    out["incremental_total_ratio"] = _round(_ratio(
        results.values.get("incremental_total_stored_mib"), first))
    out["accel"] = accel
    out["host"] = host_info()
    cold, create = out["cold_boot_ms"], out["create_ms_p50"]
    ratios = {
        "create_speedup_vs_cold_boot": _ratio(cold, create),
        "restore_speedup_vs_cold_boot": _ratio(cold, out["restore_ms_p50"]),
        "fork1_speedup_vs_cold_boot": _ratio(cold, out["fork1_ms_p50"]),
        "restore_speedup_vs_peer": _ratio(out["peer_restore_ms_p50"], out["restore_ms_p50"]),
        "fork8_speedup_vs_peer": _ratio(out["peer_fork8_wall_ms"], out["fork8_wall_ms"]),
        "snapshot_ready_speedup_vs_peer_checkpoint": _ratio(
            peer.get("checkpoint_ms_p50") if peer_ok else None, out["snapshot_ready_ms_p50"]),
    }
    out["ratios"] = ratios
    checks = {}
    for key, (op, limit) in TARGETS.items():
        value = (ratios["create_speedup_vs_cold_boot"] if key == "create_speedup" else
                 ratios[key] if key in ratios else out.get(key))
        met = None if value is None else (value <= limit if op == "<=" else value >= limit)
        if (key == "fork8_wall_ms" and plan.fork_small != 8) or (
                key == "fork32_wall_ms" and plan.fork_big != 32):
            met = None  # a smoke run forks fewer children: the target does not apply
        checks[key] = {"target": f"{op} {limit}", "value": value, "met": met}
    out["targets"] = checks
    out["values"] = {k: _round(v) for k, v in results.values.items()}
    out["series"] = {name: {"p50": _round(x.p50), "p90": _round(x.p90), "n": x.n,
                            "values": [round(v, 2) for v in x.values]}
                     for name, x in sorted(s.items())}
    out["peer"] = peer
    out["plan"] = asdict(plan)
    out["run"] = run
    out["notes"] = results.notes
    out["errors"] = results.errors
    return out


@dataclass(frozen=True)
class Row:
    label: str
    series: str | None  # a series name, or None for a single value
    unit: str
    value_key: str | None = None  # for single values: key in Results.values / the JSON
    target: str = ""  # key into the JSON "targets"
    vs: str = ""  # how to show a ratio: "cold" (speedup vs cold boot) or a peer key
    peer_key: str = ""


ROWS = [
    Row("cold boot (boot to agent ready)", "cold_boot_ms", "ms"),
    Row("create from template", "create_ms", "ms", target="create_ms_p50", vs="cold"),
    Row("  first command after create", "create_first_exec_ms", "ms"),
    Row("create without the warm pool (a restore)", "create_restore_ms", "ms", vs="cold"),
    Row("  first command after it", "create_restore_first_exec_ms", "ms"),
    Row("  network setup (namespace, veth, tap, rules; beside the disk overlay)",
        "network_setup_ms", "ms"),
    Row("  network teardown (on kill)", "network_teardown_ms", "ms"),
    Row("exec `true` round trip", "exec_ms", "ms"),
    Row("file write+read, streamed", "file_mb_s", "MB/s"),
    Row("  write", "file_write_mb_s", "MB/s"),
    Row("  read", "file_read_mb_s", "MB/s"),
    Row("snapshot pause (guest clock vs host clock)", "snapshot_pause_ms", "ms",
        target="snapshot_pause_ms_p50"),
    Row("  host-seen pause (stop -> cont)", "snapshot_host_pause_ms", "ms"),
    Row("  largest guest stall during capture", "snapshot_stall_ms", "ms"),
    Row("    ... in the second before", "snapshot_baseline_stall_ms", "ms"),
    Row("  largest heartbeat arrival gap", "snapshot_arrival_gap_ms", "ms"),
    Row("    ... in the second before", "snapshot_heartbeat_noise_ms", "ms"),
    Row("snapshot pause, {big} MiB sandbox", "snapshot{big}_pause_ms", "ms",
        target="snapshot_pause_big_ms_p50"),
    Row("  host-seen", "snapshot{big}_host_pause_ms", "ms"),
    Row("  largest guest stall", "snapshot{big}_stall_ms", "ms"),
    Row("  largest arrival gap", "snapshot{big}_arrival_gap_ms", "ms"),
    Row("  snapshot call -> ready", "snapshot{big}_ready_ms", "ms"),
    Row("snapshot call -> ready", "snapshot_ready_ms", "ms", vs="peer",
        peer_key="checkpoint_ms_p50", target="snapshot_ready_speedup_vs_peer_checkpoint"),
    Row("  capture (server side, includes the pause)", "snapshot_capture_ms", "ms"),
    Row("snapshot stored (compressed)", "snapshot_stored_mib", "MiB"),
    Row("  size uncompressed (apparent)", "snapshot_size_mib", "MiB"),
    Row("restore -> first command done", "restore_ms", "ms", vs="cold+peer",
        peer_key="restore_ms_p50", target="restore_speedup_vs_peer"),
    Row("restore from S3 with an empty cache -> first command", "restore_empty_cache_ms", "ms",
        vs="cold+peer", peer_key="restore_ms_p50"),
    Row("  again on that server (cache warm)", "restore_warm_cache_ms", "ms"),
    Row("next snapshot after 10 MiB of changes: stored", "incremental_stored_mib", "MiB",
        target="incremental_stored_ratio"),
    Row("  call -> ready", "incremental_ready_ms", "ms", target="incremental_ready_ms_p50",
        vs="peer", peer_key="checkpoint_ms_p50"),
    Row("  pause (server-side)", "incremental_pause_ms", "ms"),
    Row("{incr} snapshots of one sandbox, stored / the first's", None, "x",
        value_key="incremental_total_ratio", target="incremental_total_ratio"),
    Row("filesystem-only snapshot (10 MiB written to disk) call -> ready", "fs_snapshot_ready_ms",
        "ms", vs="peer", peer_key="checkpoint_ms_p50"),
    Row("  stored", "fs_snapshot_stored_mib", "MiB"),
    Row("  a sandbox booted from it -> first command done", "fs_boot_ms", "ms", vs="cold"),
    Row("fork(1) -> child's first command done", "fork1_ms", "ms", target="fork1_ms_p50",
        vs="cold"),
    Row("fork({small}) wall -> all first commands done", "fork8_wall_ms", "ms",
        target="fork8_wall_ms", vs="peer", peer_key="fork8_wall_ms"),
    Row("  parent paused per fork (server-side)", "fork_parent_pause_ms", "ms",
        target="fork_parent_pause_ms_p50"),
    Row("fork({big_fork}) wall -> all first commands done", "fork32_wall_ms", "ms",
        target="fork32_wall_ms"),
    Row("fork({small}) child private guest RAM", "fork8_private_mib", "MiB",
        target="fork_private_mib"),
    Row("fork({small}) child PSS (whole QEMU)", "fork8_pss_mib", "MiB", target="fork_pss_mib"),
    Row("  of which guest RAM", "fork8_ram_pss_mib", "MiB"),
    Row("  of which TCG code cache (rwx anon)", "fork8_jit_pss_mib", "MiB"),
    Row("  PSS per child of fork({big_fork})", "fork32_pss_mib", "MiB"),
    Row("{idle} idle sandboxes, total PSS", None, "MiB", value_key="idle20_pss_mib"),
    Row("  host CPU of each idle sandbox (its QEMU)", "idle_cpu_ms_per_s", "ms/s"),
]


def _fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


COLUMNS = (("figure", "left"), ("p50", "right"), ("p90", "right"), ("n", "right"),
           ("unit", "left"), ("target", "left"), ("vs baseline / peer", "left"))


def table_rows(report: dict, markup: bool = True) -> list[list[str]]:
    """The table's rows as text (`markup`: rich colour tags on met/missed)."""
    plan = report["plan"]
    fmt = {"big": plan["big_memory_mb"], "small": plan["fork_small"],
           "big_fork": plan["fork_big"], "idle": plan["idle_count"],
           "incr": plan.get("incremental_snapshots", 10)}
    series, targets, peer = report["series"], report["targets"], report["peer"]
    cold = report["cold_boot_ms"]
    peer_ok = "unavailable" not in peer
    marks = ({True: "[green]met[/]", False: "[red]missed[/]", None: ""} if markup else
             {True: "met", False: "**missed**", None: ""})
    rows = []
    for row in ROWS:
        name = row.series.format(**fmt) if row.series else None
        if name is not None:
            data = series.get(name)
            if data is None:
                continue
            p50, p90, n = data["p50"], data["p90"], data["n"]
        else:
            p50 = report.get(row.value_key) if row.value_key else None
            p90, n = None, 1 if p50 is not None else 0
        target = ""
        if row.target and row.target in targets:
            t = targets[row.target]
            target = f"{t['target']}: {marks[t['met']]}"
        vs = []
        if "cold" in row.vs and p50 and cold:
            vs.append(f"{cold / p50:.1f}x faster than cold boot")
        if "peer" in row.vs and row.peer_key:
            pv = peer.get(row.peer_key) if peer_ok else None
            if pv and p50:
                r = pv / p50
                word = f"{r:.1f}x faster" if r >= 1 else f"{1 / r:.1f}x slower"
                vs.append(f"{word} than gVisor ({_fmt(pv, 'ms')} ms)")
            elif not peer_ok:
                vs.append("gVisor: n/a")
        if row.series == "create_ms" and "create_speedup" in targets:
            t = targets["create_speedup"]
            target += f"; speedup {t['target']}x: {marks[t['met']]}"
        rows.append([row.label.format(**fmt), _fmt(p50, row.unit), _fmt(p90, row.unit), str(n),
                     row.unit, target, "; ".join(vs)])
    return rows


def peer_line(report: dict) -> str:
    peer = report["peer"]
    if "unavailable" in peer:
        return f"peer (gVisor) not measured: {peer['unavailable']}"

    def ms(key: str) -> str:
        return f"{peer[key]:.0f} ms" if isinstance(peer.get(key), int | float) else "-"

    return (f"peer this run: gVisor runsc {peer.get('version', '?')} "
            f"({peer.get('platform', '?')} platform): checkpoint {ms('checkpoint_ms_p50')}, "
            f"restore {ms('restore_ms_p50')} (p90 {ms('restore_ms_p90')}), fork(8) "
            f"{ms('fork8_wall_ms')}, container start {ms('start_ms_p50')}")


def render(report: dict, console: Console) -> None:
    plan, host = report["plan"], report["host"]
    table = Table(title=f"sandlot bench ({plan['mode']}, {report['accel']}, {host['cores']} cores, "
                  f"{host['ram_gib']} GiB, {host['cpu_model']})", title_justify="left")
    for col, just in COLUMNS:
        table.add_column(col, justify=just, no_wrap=True)
    for row in table_rows(report):
        table.add_row(*row)
    console.print(table)
    console.print(peer_line(report), markup=False)
    for step, err in report["errors"].items():
        console.print(f"[red]step failed[/] {step}: {err}")
    for note in report["notes"]:
        console.print(f"note: {note}", markup=False)


def markdown(report: dict) -> str:
    """The table as GitHub markdown (for docs/benchmarks.md)."""
    lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |",
             "|" + "|".join("---:" if j == "right" else "---" for _, j in COLUMNS) + "|"]
    for row in table_rows(report, markup=False):
        row[0] = row[0].replace("  ", "&nbsp;&nbsp;")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines + ["", peer_line(report)]) + "\n"
