"""What the loops of bench/break.py share: a server of their own, a census of what a server
instance holds on the host (to find what a crash left behind), the classification of errors
into typed and untyped, host samplers, and the JSON result."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sandlot import Sandbox, SandlotError, Snapshot
from sandlot.runtime.network import network_owner
from sandlot.testing import ServerProcess
from sandlot.vmm.jail import CGROUP_ROOT, FSTAB_DIR, UID_DIR
from sandlot.vmm.processes import qemus_under

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20


def make_server(root: Path, tag: str, **env: str) -> ServerProcess:
    """A server in `root` with an instance of its own and no warm pool (every QEMU under it
    belongs to a sandbox, so the census can account for each)."""
    srv = ServerProcess.in_dir(root, f"{tag}{os.getpid()}", key="sl_break_" + secrets.token_hex(8))
    srv.extra_env.update({"SANDLOT_POOL_SIZE": "0", **env})
    return srv


def finish(srv: ServerProcess, keep: bool = False) -> None:
    """Stop the server and remove what it left (VMs, run dir, tmpfs files); unless `keep`,
    its data dir too (disks, the store: a few hundred MB). Its log stays."""
    srv.close()
    if not keep:
        shutil.rmtree(srv.data_dir, ignore_errors=True)


# ---- errors ---------------------------------------------------------------------------------


def typed(e: BaseException) -> bool:
    """An error the SDK raised from a typed server answer: a subclass of SandlotError.
    A bare SandlotError is a connection problem or an untyped 500."""
    return isinstance(e, SandlotError) and type(e) is not SandlotError


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


@dataclass
class Calls:
    """Outcomes of API calls: ok, typed errors by class, untyped errors with their text."""

    ok: int = 0
    typed: dict[str, int] = field(default_factory=dict)
    untyped: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, what: str, fn, *args, **kw):
        """Call fn; count the outcome; return its result or None on an error."""
        try:
            out = fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - every outcome is counted
            self.error(what, e)
            return None
        with self.lock:
            self.ok += 1
        return out

    def error(self, what: str, e: BaseException) -> None:
        with self.lock:
            if typed(e):
                key = f"{what}: {type(e).__name__}"
                self.typed[key] = self.typed.get(key, 0) + 1
            else:
                self.untyped.append(f"{what}: {describe(e)}")

    def to_dict(self) -> dict:
        return {"ok": self.ok, "typed_errors": self.typed, "untyped_errors": self.untyped}


# ---- what a server instance holds on the host --------------------------------------------


def census(srv: ServerProcess) -> dict[str, set[str]]:
    """Everything of this server's instance on the host, by kind, named by sandbox id where
    it has one: QEMU processes (pid), run dirs, disk dirs, network namespaces, VM uids,
    cgroups, mount tables (uid), hot-cache entries."""
    out: dict[str, set[str]] = {}
    out["qemu"] = {str(p) for p in qemus_under(srv.run_root)}
    out["run_dirs"] = {p.name for p in srv.run_root.iterdir()} if srv.run_root.is_dir() else set()
    disks = srv.data_dir / "disks"
    out["disk_dirs"] = {p.name for p in disks.iterdir()} if disks.is_dir() else set()
    prefix = f"sl-{network_owner(srv.instance)}."
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out["netns"] = {line.split()[0][len(prefix):] for line in ns.splitlines()
                    if line.startswith(prefix)}
    uids: dict[str, str] = {}
    for f in UID_DIR.iterdir() if UID_DIR.is_dir() else ():
        try:
            instance, vm_id = f.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if instance == srv.instance:
            uids[f.name] = vm_id
    out["uids"] = set(uids.values())
    out["fstabs"] = {uids.get(p.name.removesuffix(".fstab"), p.name) for p in
                     FSTAB_DIR.glob("*.fstab") if p.name.removesuffix(".fstab") in uids}
    cgroups: set[str] = set()
    for controller in ("", "memory", "pids", "cpu"):
        d = CGROUP_ROOT / controller / "sandlot" / srv.instance
        if d.is_dir():
            cgroups |= {c.name for c in d.iterdir() if c.is_dir()}
    out["cgroups"] = cgroups
    hot = srv.shm_root / "hot"
    out["hot_entries"] = {p.name for p in hot.iterdir()} if hot.is_dir() else set()
    return out


def orphans(srv: ServerProcess, kw: dict) -> dict[str, list[str]]:
    """What the census holds that no live sandbox (or ready snapshot, for the hot cache)
    accounts for; and live sandboxes without a QEMU."""
    live = {s.sandbox_id: s for s in Sandbox.list(**kw)}
    running = {i for i, s in live.items() if s.state == "running"}
    pids = {str(s.pid) for i, s in live.items() if i in running and s.pid}
    snaps = {s.snapshot_id: s.state for s in Snapshot.list(**kw)}
    c = census(srv)
    out = {"qemu": sorted(c["qemu"] - pids),
           "running_without_qemu": sorted(i for i in running
                                          if str(live[i].pid) not in c["qemu"])}
    for kind in ("run_dirs", "disk_dirs", "netns", "uids", "fstabs", "cgroups"):
        out[kind] = sorted(c[kind] - running)
    # Hot entries: templates (hashes) and stored snapshots stay cached; an entry named after a
    # failed or unknown snapshot, or a fork's capture with no child left, is left over.
    out["hot_entries"] = sorted(k for k in c["hot_entries"]
                                if (k.startswith("snap") and snaps.get(k) != "ready")
                                or k.startswith("fork-"))
    return {k: v for k, v in out.items() if v}


# ---- host samplers ------------------------------------------------------------------------


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(pid: int | None) -> float:
    if not pid:
        return float("nan")
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def du_mb(path: Path) -> float:
    """Blocks allocated under `path` (what the disk holds, not apparent sizes)."""
    total = 0
    for p in [path, *path.rglob("*")] if path.exists() else ():
        try:
            total += p.lstat().st_blocks * 512
        except OSError:
            pass
    return total / MiB


class HealthPoller(threading.Thread):
    """GET /health every `interval` s until stopped: latencies and failures."""

    def __init__(self, url: str, interval: float = 0.25, timeout: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.url, self.interval, self.timeout = url, interval, timeout
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self.done.is_set():
                t0 = time.monotonic()
                try:
                    r = client.get(f"{self.url}/health")
                    if r.status_code != 200:
                        self.failures.append(f"{time.strftime('%X')} HTTP {r.status_code}")
                except httpx.HTTPError as e:
                    self.failures.append(f"{time.strftime('%X')} {type(e).__name__}")
                self.latencies.append(time.monotonic() - t0)
                self.done.wait(self.interval)

    def stop(self) -> dict:
        self.done.set()
        self.join(self.timeout + 5)
        return {"polls": len(self.latencies), "failures": self.failures,
                **stats_ms(self.latencies)}


def stats_ms(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p50_ms": round(1000 * statistics.median(xs), 1),
            "p90_ms": round(1000 * xs[int(0.9 * (len(xs) - 1))], 1),
            "max_ms": round(1000 * xs[-1], 1)}


def server_exceptions(log_path: Path) -> list[str]:
    """Unhandled exceptions in a server's log (an ASGI application's, a task's nobody
    awaited), each as its last line: a request can fail this way after its status went out,
    so no status code shows it."""
    out: list[str] = []
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for i, line in enumerate(lines):
        if "Exception in ASGI application" in line or "exception was never retrieved" in line:
            for follow in lines[i + 1:i + 400]:
                if follow and not follow.startswith((" ", "Traceback", "The above", "During")):
                    out.append(f"{line.strip()[:60]} -> {follow.strip()[:200]}")
                    break
    return out


def write_result(name: str, result: dict, path: str | None = None) -> Path:
    out = Path(path) if path else RESULTS / f"break-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return out


def took(fn, *args, **kw) -> float:
    t0 = time.monotonic()
    fn(*args, **kw)
    return time.monotonic() - t0
