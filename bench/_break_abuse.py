"""`break.py abuse`: one sandbox runs, in turn, a fork bomb, a memory hog past its RAM, a disk
filled to ENOSPC and an output flood its client does not read, while another sandbox runs
`true` in a loop (its latency against idle), `/health` is polled, and the host's available
memory, the server's RSS, the abusive QEMU's RSS and cgroup peak and its disk on the host are
sampled. After each abuse the abusive sandbox must answer, or be killed cleanly (its QEMU gone)
and made again."""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from _break import (
    HealthPoller,
    describe,
    du_mb,
    finish,
    make_server,
    mem_available_mb,
    orphans,
    rss_mb,
    stats_ms,
)
from sandlot import Sandbox, SandlotError
from sandlot.vmm.jail import CGROUP_ROOT
from sandlot.vmm.processes import qemus_under


class Lab:
    """The abusive sandbox (replaced when it has to be killed), the phase, the samples."""

    def __init__(self, srv, kw: dict, memory_mb: int) -> None:
        self.srv, self.kw, self.memory_mb = srv, kw, memory_mb
        self.phase = "idle"
        self.abuser = self.new_abuser()
        self.samples: list[dict] = []
        self.victim_lat: list[tuple[str, float]] = []
        self.victim_errors: list[str] = []
        self.done = threading.Event()

    def new_abuser(self) -> Sandbox:
        return Sandbox.create(**self.kw, memory_mb=self.memory_mb, timeout=3600)

    def cgroup_peak_mb(self) -> float:
        sid = self.abuser.sandbox_id
        for f in (CGROUP_ROOT / "memory" / "sandlot" / self.srv.instance / sid
                  / "memory.max_usage_in_bytes",
                  CGROUP_ROOT / "sandlot" / self.srv.instance / sid / "memory.peak"):
            try:
                return int(f.read_text()) / (1 << 20)
            except (OSError, ValueError):
                continue
        return float("nan")

    def sample(self) -> None:
        while not self.done.is_set():
            a = self.abuser
            self.samples.append({
                "t": time.time(), "phase": self.phase, "mem_available_mb": mem_available_mb(),
                "server_rss_mb": rss_mb(self.srv.proc.pid if self.srv.proc else None),
                "abuser_qemu_rss_mb": rss_mb(a.info.pid),
                "abuser_cgroup_peak_mb": self.cgroup_peak_mb(),
                "abuser_disk_mb": du_mb(self.srv.data_dir / "disks" / a.sandbox_id),
                "shm_mb": du_mb(self.srv.shm_root)})
            self.done.wait(0.5)

    def victim(self, sbx: Sandbox) -> None:
        while not self.done.is_set():
            phase = self.phase
            t0 = time.monotonic()
            try:
                sbx.commands.run("true", timeout=30)
                self.victim_lat.append((phase, time.monotonic() - t0))
            except SandlotError as e:
                self.victim_errors.append(f"{phase}: {describe(e)}")
            self.done.wait(0.2)


def settle(lab: Lab, report: dict, patience: float = 60) -> None:
    """After an abuse: the abuser answers (within `patience` s), or is killed (its QEMU must go)
    and made again."""
    deadline = time.monotonic() + patience
    t0 = time.monotonic()
    last = ""
    while time.monotonic() < deadline:
        try:
            if lab.abuser.commands.run("echo alive", timeout=10).stdout == "alive\n":
                report["after"] = f"usable ({time.monotonic() - t0:.1f} s after the phase)"
                return
        except SandlotError as e:
            last = describe(e)
        time.sleep(2)
    pid = lab.abuser.info.pid
    t1 = time.monotonic()
    try:
        killed = lab.abuser.kill()
    except SandlotError as e:
        killed = describe(e)
    gone = pid not in qemus_under(lab.srv.run_root)
    report["after"] = (f"not answering ({last[:100]}); killed: {killed} in "
                       f"{time.monotonic() - t1:.1f} s, QEMU gone: {gone}")
    report["killed_cleanly"] = killed is True and gone
    lab.abuser = lab.new_abuser()


def fork_bomb(lab: Lab, secs: float, report: dict) -> None:
    lab.abuser.commands.start(f"timeout {secs:.0f} bash -c ':(){{ :|:& }};:'")
    time.sleep(secs + 2)


def memory_hog(lab: Lab, secs: float, report: dict) -> None:
    # `tail` of a file with no newline keeps all of it: grows until the guest's OOM killer.
    try:
        r = lab.abuser.commands.run(f"timeout {secs:.0f} tail /dev/zero; echo exit=$?",
                                    timeout=secs + 30)
        report["command"] = (r.stdout + r.stderr).strip()[-200:]
    except SandlotError as e:
        report["command"] = describe(e)


def disk_fill(lab: Lab, secs: float, report: dict) -> None:
    disks = lab.srv.data_dir / "disks" / lab.abuser.sandbox_id
    report["disk_before_mb"] = round(du_mb(disks))
    limit = max(120, 6 * secs)
    try:
        r = lab.abuser.commands.run(
            f"timeout {limit:.0f} dd if=/dev/zero of=/root/fill bs=1M 2>&1 | grep -v records; "
            "sync; df -m / | tail -1", timeout=limit + 60)
        report["command"] = r.stdout.strip()[-300:]
        report["enospc"] = "No space left" in r.stdout
    except SandlotError as e:
        report["command"] = describe(e)
    report["disk_full_mb"] = round(du_mb(disks))
    report["disk_virtual_mb"] = virtual_mb(disks)
    try:
        r = lab.abuser.commands.run("rm -f /root/fill; sync; fstrim -v / 2>&1; df -m / | tail -1",
                                    timeout=120)
        report["after_rm"] = r.stdout.strip()[-200:]
    except SandlotError as e:
        report["after_rm"] = describe(e)
    time.sleep(2)
    report["disk_after_rm_mb"] = round(du_mb(disks))


def virtual_mb(disks: Path) -> int:
    """The largest virtual size among the qcow2 files of a VM's disk chain."""
    sizes = [0]
    for f in disks.glob("*.qcow2"):
        r = subprocess.run(["qemu-img", "info", "-U", "--output", "json", str(f)],
                           capture_output=True, text=True)
        if r.returncode == 0:
            sizes.append(json.loads(r.stdout)["virtual-size"] >> 20)
    return max(sizes)


def output_flood(lab: Lab, secs: float, report: dict) -> None:
    """A command that prints without end, its client reads one chunk and then nothing."""
    url = f"{lab.srv.url}/v1/sandboxes/{lab.abuser.sandbox_id}/commands"
    body = {"cmd": f"timeout {secs:.0f} base64 /dev/zero", "timeout": secs + 30}
    headers = {"authorization": f"Bearer {lab.srv.key}"}
    rss0 = rss_mb(lab.srv.proc.pid)
    with httpx.stream("POST", url, json=body, headers=headers, timeout=secs + 60) as r:
        first = next(r.iter_bytes(65536))
        report["first_chunk_bytes"] = len(first)
        time.sleep(secs + 5)  # reads nothing more
    report["server_rss_before_mb"] = round(rss0)


PHASES = [("fork bomb", fork_bomb), ("memory hog", memory_hog), ("disk fill", disk_fill),
          ("output flood", output_flood)]


def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="sandlot-break-abuse-"))
    srv = make_server(root, "a")
    srv.start()
    kw = srv.client_kwargs()
    t_start = time.monotonic()
    failures: list[str] = []
    phases: dict[str, dict] = {}
    lab = Lab(srv, kw, args.memory_mb)
    victim = Sandbox.create(**kw, timeout=3600)
    idle_direct = []
    for _ in range(40):  # the first commands after a restore fault its pages in: warm up
        t0 = time.monotonic()
        victim.commands.run("true")
        idle_direct.append(time.monotonic() - t0)
    idle_direct = idle_direct[20:]
    health = HealthPoller(srv.url)
    threads = [threading.Thread(target=lab.sample, daemon=True),
               threading.Thread(target=lab.victim, args=(victim,), daemon=True)]
    try:
        health.start()
        for t in threads:
            t.start()
        time.sleep(max(5.0, args.phase_seconds / 2))  # the victim's idle latency, in the loop
        for name, fn in PHASES:
            report: dict = {}
            lab.phase = name
            t0 = time.monotonic()
            try:
                fn(lab, args.phase_seconds, report)
            except (SandlotError, httpx.HTTPError) as e:
                report["error"] = describe(e)
            report["seconds"] = round(time.monotonic() - t0, 1)
            lab.phase = f"{name} (after)"
            settle(lab, report)
            if report.get("killed_cleanly") is False:
                failures.append(f"{name}: the abusive sandbox was neither usable nor cleanly "
                                f"killed: {report['after']}")
            phases[name] = report
            print(f"{name}: {report}", flush=True)
        lab.phase = "idle (end)"
        time.sleep(max(5.0, args.phase_seconds / 2))
    finally:
        lab.done.set()
        for t in threads:
            t.join(60)
        hp = health.stop()
        try:
            victim.kill()
            lab.abuser.kill()
            time.sleep(1)
            left = orphans(srv, kw)
        except SandlotError as e:
            left = {"error": [describe(e)]}
        finish(srv, args.keep)
    if left:
        failures.append(f"left over after both sandboxes were killed: {left}")
    if hp["failures"]:
        failures.append(f"/health failed {len(hp['failures'])} times: {hp['failures'][:5]}")
    if lab.victim_errors:
        failures.append(f"the quiet sandbox's `true` failed: {lab.victim_errors[:5]}")

    # Idle: the quieter of the windows before and after the abuse (the host is shared; other
    # load comes and goes), so a ratio errs high rather than low.
    idle_windows = {w: [x for p, x in lab.victim_lat if p == w] for w in ("idle", "idle (end)")}
    idle = min((xs for xs in idle_windows.values() if xs), key=statistics.median,
               default=idle_direct)
    idle_p50 = statistics.median(idle)
    victim_rows = {}
    for name in [n for n, _ in PHASES] + ["idle (end)"]:
        xs = [x for p, x in lab.victim_lat if p == name]
        if xs:
            row = stats_ms(xs)
            row["p50_ratio_to_idle"] = round(statistics.median(xs) / idle_p50, 2)
            row["p90_ratio_to_idle"] = round(sorted(xs)[int(0.9 * (len(xs) - 1))] / idle_p50, 2)
            row["max_ratio_to_idle"] = round(max(xs) / idle_p50, 2)
            victim_rows[name] = row
            if row["p50_ratio_to_idle"] > 3:
                failures.append(f"{name}: the quiet sandbox's `true` p50 is "
                                f"{row['p50_ratio_to_idle']}x idle (target <= 3x)")
    host = {}
    for name, _ in [("idle", None), *PHASES]:
        rows = [s for s in lab.samples if s["phase"] in (name, f"{name} (after)")]
        if not rows:
            continue
        host[name] = {
            "mem_available_min_mb": round(min(s["mem_available_mb"] for s in rows)),
            "server_rss_max_mb": round(max(s["server_rss_mb"] for s in rows)),
            "abuser_qemu_rss_max_mb": round(max(s["abuser_qemu_rss_mb"] for s in rows)),
            "abuser_cgroup_peak_mb": round(max(s["abuser_cgroup_peak_mb"] for s in rows)),
            "abuser_disk_max_mb": round(max(s["abuser_disk_mb"] for s in rows)),
            "shm_max_mb": round(max(s["shm_mb"] for s in rows))}
    limit_mb = args.memory_mb + 256
    over = [s for s in lab.samples if s["abuser_qemu_rss_mb"] > limit_mb]
    if over:
        failures.append(f"the abusive QEMU's RSS went over its cgroup limit {limit_mb} MiB: "
                        f"{max(s['abuser_qemu_rss_mb'] for s in over):.0f}")
    virtual = phases.get("disk fill", {}).get("disk_virtual_mb") or 0
    disk_max = max((s["abuser_disk_mb"] for s in lab.samples), default=0)
    if virtual and disk_max > virtual + 64:
        failures.append(f"the abusive sandbox's disk grew to {disk_max:.0f} MiB on the host, "
                        f"past its virtual size {virtual} MiB")
    flood = [s["server_rss_mb"] for s in lab.samples if s["phase"].startswith("output flood")]
    before = phases.get("output flood", {}).get("server_rss_before_mb")
    if flood and before and max(flood) > before + 256:
        failures.append(f"the server's RSS grew from {before} to {max(flood):.0f} MiB behind a "
                        "client that does not read")
    result = {"args": vars(args), "seconds": round(time.monotonic() - t_start),
              "idle_true": {**stats_ms(idle), "direct": stats_ms(idle_direct),
                            **{w: stats_ms(xs) for w, xs in idle_windows.items()}},
              "victim": victim_rows, "victim_errors": lab.victim_errors, "health": hp,
              "host": host, "phases": phases, "samples": lab.samples, "orphans": left,
              "failures": failures, "server_log": str(srv.log_path)}
    result["summary"] = {
        "idle `true` p50 ms": stats_ms(idle).get("p50_ms"),
        "quiet sandbox `true` p50 / p90 / max ratio to idle, per phase": {
            k: (v["p50_ratio_to_idle"], v["p90_ratio_to_idle"], v["max_ratio_to_idle"])
            for k, v in victim_rows.items()},
        "/health polls, failures, max ms": (hp["polls"], len(hp["failures"]), hp.get("max_ms")),
        "abusive sandbox after each phase": {k: v.get("after") for k, v in phases.items()},
        "host per phase": host, "seconds": result["seconds"], "failures": len(failures)}
    return result
