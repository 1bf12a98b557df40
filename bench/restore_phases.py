"""Where the time and CPU of one restore and one fork child go (issue #11, "cheaper children").

Runs the QEMU runtime in this process (no HTTP server: its own instance, data dir under
/var/tmp, the images dir's `base` template, networking on as in a server) and times every
step of `QemuRuntime.restore` by wrapping the functions it calls, then the first
`run("true")`. CPU is read per QEMU thread (/proc/<pid>/task/*/schedstat, ns) at each point.

    python bench/restore_phases.py [--runs 8] [--template base] [--build HASH] [--fork N]
        [--accel tcg,thread=multi,tb-size=N ...]

Per run: a restore of the template; then a capture of that sandbox (a fork's image) and a
restore of it (a fork child); with `--fork N` also a fork(N) of it (N restores at once).
Prints the p50 of each phase (ms since the restore began, and the QEMU process's CPU there)
and of the QEMU process's CPU (ms) and its TCG code cache (PSS of its anonymous rwx mappings)
after the first command; for fork(N) also the wall and the CPU per child of this process and
of the host commands it ran. `--accel` (repeatable) runs the restores with other `-accel`
options, in turn (an experiment: the device model fingerprint is not changed, so templates still
load).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import resource
import secrets
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path

INSTANCE = f"ph{secrets.token_hex(3)}"
os.environ["SANDLOT_INSTANCE"] = INSTANCE
os.environ.setdefault("SANDLOT_POOL_SIZE", "0")
os.environ.setdefault("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images")

from _procmem import qemu_memory  # noqa: E402
from sandlot.config import Settings  # noqa: E402
from sandlot.core.templates import TemplateStore  # noqa: E402
from sandlot.guest import client as guest_client  # noqa: E402
from sandlot.images.pipeline import image_of  # noqa: E402
from sandlot.runtime import bringup as rt_bringup  # noqa: E402
from sandlot.runtime import qemu as rt_qemu  # noqa: E402
from sandlot.runtime.base import MachinePlan  # noqa: E402
from sandlot.runtime.network import Networking  # noqa: E402
from sandlot.vmm import disk as vmm_disk  # noqa: E402
from sandlot.vmm import hotplug  # noqa: E402
from sandlot.vmm import jail as vmm_jail  # noqa: E402
from sandlot.vmm import machine as vmm_machine  # noqa: E402
from sandlot.vmm import snapshot as vmm_snapshot  # noqa: E402
from sandlot.vmm.network import NetworkPolicy  # noqa: E402

TRACE: ContextVar[list | None] = ContextVar("trace", default=None)
T0: ContextVar[float] = ContextVar("t0", default=0.0)
PID: ContextVar[int | None] = ContextVar("pid", default=None)
QEMU_CPU: dict = defaultdict(lambda: defaultdict(list))  # label -> mark -> QEMU CPU ms there


def thread_cpu_ms(pid: int) -> float:
    """CPU so far of a process's live threads (schedstat, ns precision)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e6


MEASURING = [0.0]  # CPU (s) this process spent measuring: not counted as the server's


def mark(name: str, t: float | None = None) -> None:
    trace = TRACE.get()
    if trace is not None:
        c0 = time.process_time()
        at = ((t or time.monotonic()) - T0.get()) * 1000
        pid = PID.get()
        cpu = None
        if pid is not None:
            with contextlib.suppress(OSError):
                cpu = thread_cpu_ms(pid)
        trace.append((name, at, cpu))
        MEASURING[0] += time.process_time() - c0


def timed(obj, attr: str, name: str | None = None) -> None:
    fn = getattr(obj, attr)
    label = name or attr
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*a, **kw):
            mark(f"{label} start")
            try:
                return await fn(*a, **kw)
            finally:
                mark(f"{label} end")
    else:
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            mark(f"{label} start")
            try:
                return fn(*a, **kw)
            finally:
                mark(f"{label} end")
    setattr(obj, attr, wrapper)


def instrument() -> None:
    timed(rt_bringup.BringUp, "_hot", "lease")
    timed(vmm_jail.Jails, "make", "jail")
    timed(vmm_disk.DiskChain, "create", "disk")
    timed(Networking, "attach", "net")
    timed(Networking, "begin", "net: namespace, tap")
    timed(Networking, "finish", "net: addresses, rules")
    timed(vmm_machine.Machine, "launch", "launch")
    timed(vmm_machine.Machine, "_connect_qmp", "qmp connect")
    timed(vmm_snapshot, "_send_file", "send devstate")
    timed(vmm_machine.Machine, "wait_incoming", "load")
    timed(hotplug, "apply", "hotplug")
    timed(vmm_machine.Machine, "wait_chardev_connected", "chardev")
    timed(vmm_machine.Machine, "cont", "cont")
    timed(guest_client.AgentClient, "sync_clock", "sync_clock")
    orig_exec = asyncio.create_subprocess_exec

    async def spawn(*a, **kw):
        mark("spawn start")
        proc = None
        try:
            proc = await orig_exec(*a, **kw)
            return proc
        finally:
            if proc is not None:
                PID.set(proc.pid)
            mark("spawn end")
    vmm_machine.asyncio.create_subprocess_exec = spawn  # type: ignore[attr-defined]
    orig_dispatch = guest_client.AgentClient._dispatch

    async def dispatch(self, header, payload):
        if "hello" in header:
            mark("hello reply")
        elif "time_ns" in header and self.state == guest_client.LinkState.CONNECTING:
            mark("configure reply")
        return await orig_dispatch(self, header, payload)
    guest_client.AgentClient._dispatch = dispatch  # type: ignore[method-assign]


def cpu_ms(pid: int) -> dict[str, float]:
    """CPU so far of each QEMU thread kind (ns schedstat of live threads) and the process
    total from /proc/pid/stat (ticks; includes exited threads)."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue
        kind = "vcpu" if "TCG" in comm or comm.startswith("CPU") else \
            "main" if comm.startswith("qemu") else comm
        out[kind] += ns / 1e6
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    out["stat total"] = (int(fields[11]) + int(fields[12])) * 1000 / tick
    out["code cache PSS (MiB)"] = qemu_memory(pid, Path("/nonexistent")).jit_pss_mib
    return dict(out)


async def one(runtime, image, label: str, results: dict, cpus: dict, keep: bool = False,
              second: bool = True):
    trace: list = []
    TRACE.set(trace)
    T0.set(time.monotonic())
    PID.set(None)
    vm_id = "sb-" + secrets.token_hex(5)
    plan = MachinePlan(cpus=image.machine.cpus, memory_mb=image.machine.memory_mb,
                       generation=secrets.token_hex(4), network=NetworkPolicy(),
                       env={"A": "1"})
    vm = await runtime.restore(image, plan, vm_id)
    mark("restore returned")
    agent = await vm.guest()
    await agent.run("true")
    mark("first command done")
    c0 = time.process_time()
    c1 = cpu_ms(vm.pid)
    MEASURING[0] += time.process_time() - c0
    if second:
        t1 = time.monotonic()
        await agent.run("true")
        mark("second command done", None)
        results[label]["(second command, ms)"].append((time.monotonic() - t1) * 1000)
    TRACE.set(None)
    seen: dict[str, tuple[float, float | None]] = {}
    for name, t, cpu in trace:
        seen.setdefault(name, (t, cpu))  # first occurrence (a retried restore adds more)
    for name, (t, cpu) in seen.items():
        results[label][name].append(t)
        if cpu is not None:
            QEMU_CPU[label][name].append(cpu)
    for k, v in c1.items():
        cpus[label][k].append(v)
    if keep:
        return vm
    await runtime.kill(vm)
    return None


async def fork_n(runtime, parent, n: int, tag: str, results: dict, cpus: dict) -> None:
    """fork(n) of `parent` as core does it (a capture, then n restores at once), each child
    to its first command; the wall, and the CPU of this process and of the host commands it
    ran (ip, nft, qemu-img), per child."""
    label = f"fork({n}) child{tag}"
    t0, own0, measuring0 = time.monotonic(), time.process_time(), MEASURING[0]
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    key = "fork-" + secrets.token_hex(4)
    captured = await runtime.capture(parent, key, persistent=False)
    vms = await asyncio.gather(*(one(runtime, captured.image, label, results, cpus, keep=True,
                                     second=False) for _ in range(n)))
    wall = (time.monotonic() - t0) * 1000
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    results[label][f"(fork({n}) wall to all first commands)"].append(wall)
    cpus[label]["server process, per child"].append(
        (time.process_time() - own0 - (MEASURING[0] - measuring0)) * 1000 / n)
    cpus[label]["host commands, per child"].append(
        (kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime) * 1000 / n)
    runtime.release(key)
    for vm in vms:
        await runtime.kill(vm)


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(results: dict, cpus: dict) -> None:
    for label in results:
        print(f"\n== {label} (n={len(results[label].get('restore returned', []))}): ms since "
              "restore() was called, p50 [p10-p90]; QEMU's CPU there (ms, p50, its threads)")
        rows = sorted(results[label].items(), key=lambda kv: p50(kv[1]))
        for name, xs in rows:
            qs = statistics.quantiles(xs, n=10) if len(xs) > 2 else [min(xs), max(xs)]
            cpu = QEMU_CPU[label].get(name)
            at = f"   cpu {p50(cpu):6.1f}" if cpu else ""
            print(f"  {name:32s} {p50(xs):8.1f}   [{qs[0]:.1f}-{qs[-1]:.1f}]{at}")
        print("  CPU after the first command (ms):")
        for kind, xs in sorted(cpus[label].items()):
            print(f"    {kind:30s} {p50(xs):8.1f}")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--template", default="base")
    p.add_argument("--build", help="a build hash to restore instead of the template's")
    p.add_argument("--fork", type=int, default=0, metavar="N",
                   help="also fork(N) the parent each run: its children's steps, the wall to "
                        "all first commands and the server's own CPU")
    p.add_argument("--accel", action="append", default=[],
                   help="-accel options to try in turn (default: sandlot's)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandlot-phases-", dir="/var/tmp"))
    settings = Settings.from_env(root / "data")
    settings.ensure()
    instrument()
    runtime = rt_qemu.QemuRuntime(settings, Networking.from_settings(settings))
    info = TemplateStore(settings).get(args.template)
    image = image_of(info)
    if args.build:
        image = replace(image, key=f"tpl-{args.build}", build=args.build)
    accels = args.accel or [None]
    default_accel = vmm_machine.accel_args
    print(f"template {args.template} = {info.hash}; load average {os.getloadavg()}")
    results: dict = defaultdict(lambda: defaultdict(list))
    cpus: dict = defaultdict(lambda: defaultdict(list))
    try:
        await one(runtime, image, "warm-up", results, cpus)  # hydrates the hot cache
        for _ in range(args.runs):
            for accel in accels:
                tag = f" [-accel {accel}]" if accel else ""
                vmm_machine.accel_args = (  # type: ignore[assignment]
                    default_accel if accel is None else
                    lambda _a, o=accel: ["-accel", o, "-cpu", "max"])
                await one(runtime, image, "restore of the template" + tag, results, cpus)
                parent = await one(runtime, image, "parent", results, cpus, keep=True)
                key = "fork-" + secrets.token_hex(4)
                captured = await runtime.capture(parent, key, persistent=False)
                await one(runtime, captured.image, "fork child" + tag, results, cpus)
                runtime.release(key)
                if args.fork:
                    await fork_n(runtime, parent, args.fork, tag, results, cpus)
                await runtime.kill(parent)
        results.pop("warm-up")
        results.pop("parent")
        cpus.pop("warm-up")
        cpus.pop("parent")
        report(results, cpus)
        print(f"\nload average after {os.getloadavg()}")
    finally:
        await runtime.close([], kill=True)
        from sandlot.testing import remove_networks

        remove_networks(INSTANCE)
        vmm_jail.Jails(INSTANCE).recover(keep=set())
        for d in (settings.run_root, settings.shm_root, root):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
