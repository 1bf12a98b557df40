"""The measurements, each driving the sandlot server through the public SDK.

Every step adds samples to `Results`; a step that fails records why and the rest still runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from _pause import measure_snapshot, start_holder
from _plan import Plan
from _procmem import file_allocated_mib, process_cpu_ms, qemu_memory
from _server import IMAGES_DIR, BenchServer
from _stats import Series, ms_since
from sandlot import Sandbox, Sandlot, SandlotError, Snapshot

T = TypeVar("T")
SANDBOX_TIMEOUT = 1800  # s; the bench kills what it makes, this is the safety net


@dataclass
class Results:
    series: dict[str, Series] = field(default_factory=dict)
    values: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    def s(self, name: str) -> Series:
        return self.series.setdefault(name, Series())


@dataclass
class Ctx:
    server: BenchServer
    plan: Plan
    results: Results
    console: Console

    @property
    def kw(self) -> dict[str, str]:
        return self.server.client_kwargs()

    @property
    def hot_dir(self) -> Path:
        return self.server.shm_root / "hot"

    def create(self, **kw) -> Sandbox:
        return self.timed_create(**kw)[0]

    def timed_create(self, **kw) -> tuple[Sandbox, float]:
        """A new sandbox, and how long `Sandbox.create` took (ms)."""
        return retrying(self, "create", lambda: Sandbox.create(
            timeout=SANDBOX_TIMEOUT, **kw, **self.kw))

    def log(self, msg: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")


def retrying(ctx: Ctx, what: str, fn: Callable[[], T], attempts: int = 3) -> tuple[T, float]:
    """`fn()` and the ms it took, retried when sandlot fails to start a sandbox. Each failure
    goes in the notes (and on screen), so a flaky start is visible without losing the run's
    other figures; the time is that of the attempt that succeeded."""
    for attempt in range(1, attempts + 1):
        t0 = time.monotonic()
        try:
            value = fn()
            return value, ms_since(t0)
        except SandlotError as e:
            msg = f"{what} failed (attempt {attempt}): {str(e).splitlines()[0]}"
            ctx.results.notes.append(msg)
            ctx.log(f"[yellow]{msg}[/]")
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def kill_all(sandboxes: list[Sandbox], close: bool = True) -> None:
    """Kill sandboxes in parallel. Fork children share their parent's HTTP client (closing one
    closes it for all): pass ``close=False`` for them."""

    def kill(sbx: Sandbox) -> None:
        try:
            sbx.kill()
        finally:
            if close:
                sbx.close()

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(kill, sandboxes))


# ---- cold boot ---------------------------------------------------------------------------------

def base_build() -> tuple[Path, dict]:
    info = json.loads((IMAGES_DIR / "templates" / "base.json").read_text())
    return IMAGES_DIR / "builds" / info["hash"], info


async def _cold_boot_once(ctx: Ctx, i: int) -> float:
    """One boot of the base build from scratch, to its agent's first answer."""
    from sandlot.config import Settings
    from sandlot.runtime.base import MachinePlan
    from sandlot.runtime.qemu import QemuRuntime

    _, info = base_build()
    settings = Settings(data_dir=ctx.server.root / f"cold{i}", images_dir=IMAGES_DIR,
                        run_root=ctx.server.run_root, shm_root=ctx.server.shm_root, pool_size=0)
    runtime = QemuRuntime(settings)
    t0 = time.monotonic()
    vm = await runtime.bringup.cold_boot(info["hash"], MachinePlan(cpus=info["cpus"],
                                 memory_mb=info["memory_mb"]), f"cold{i}")
    boot_ms = (time.monotonic() - t0) * 1000
    await runtime.kill(vm)
    shutil.rmtree(settings.data_dir, ignore_errors=True)
    return boot_ms


def step_cold_boot(ctx: Ctx) -> None:
    for i in range(ctx.plan.cold_boots):
        ms = asyncio.run(_cold_boot_once(ctx, i))
        ctx.results.s("cold_boot_ms").add(ms)
        ctx.log(f"cold boot {i + 1}/{ctx.plan.cold_boots}: {ms:.0f} ms")


def template_ram_mib(ctx: Ctx) -> float | None:
    """tmpfs space the base template's hot RAM file takes (shared by all its sandboxes)."""
    _, info = base_build()
    ram = ctx.hot_dir / f"tpl-{info['hash']}" / "ram"
    return file_allocated_mib(ram) if ram.exists() else None


# ---- create, exec, files -----------------------------------------------------------------------

def wait_for_full_pool(ctx: Ctx, timeout: float = 60) -> bool:
    """Until the server's warm pool of `base` is full (False if it has none)."""
    deadline = time.monotonic() + timeout
    with Sandlot(**ctx.kw) as client:
        while time.monotonic() < deadline:
            pool = client.health().get("pool", {}).get("base")
            if not pool:
                return False
            if pool["ready"] >= pool["size"]:
                return True
            time.sleep(0.05)
    raise RuntimeError("the warm pool did not fill up")


def _creates(ctx: Ctx, name: str, pooled: bool) -> None:
    """Create, run a first command, kill; `pooled`: with a full warm pool before each."""
    r = ctx.results
    for _ in range(ctx.plan.creates):
        if pooled:
            wait_for_full_pool(ctx)
        sbx, ms = ctx.timed_create(template="base")
        r.s(f"{name}_ms").add(ms)
        try:
            t0 = time.monotonic()
            sbx.commands.run("true", check=True)
            r.s(f"{name}_first_exec_ms").add(ms_since(t0))
        finally:
            kill_all([sbx])
    ctx.log(f"{name.replace('_', ' ')}: p50 {r.s(f'{name}_ms').p50:.0f} ms, first command "
            f"{r.s(f'{name}_first_exec_ms').p50:.0f} ms")


def step_create_without_pool(ctx: Ctx) -> None:
    """The same creates with the warm pool off (the server restarted so): every one a restore."""
    server = ctx.server
    server.stop()
    server.extra_env["SANDLOT_POOL_SIZE"] = "0"
    server.start()
    try:
        _creates(ctx, "create_restore", pooled=False)
    finally:
        server.stop()
        server.extra_env.pop("SANDLOT_POOL_SIZE")
        server.start()


def step_create_exec_files(ctx: Ctx) -> None:
    r = ctx.results
    first, ms = ctx.timed_create(template="base")  # may hydrate the template's hot files
    r.values["create_first_ms"] = ms
    r.values["template_ram_file_mib_first"] = template_ram_mib(ctx)
    made = [first]
    try:
        _creates(ctx, "create", pooled=wait_for_full_pool(ctx))
        for _ in range(3):
            first.commands.run("true", check=True)
        for _ in range(ctx.plan.execs):
            t0 = time.monotonic()
            first.commands.run("true", check=True)
            r.s("exec_ms").add(ms_since(t0))
        ctx.log(f"exec: p50 {r.s('exec_ms').p50:.1f} ms over {r.s('exec_ms').n}")
        for i in range(ctx.plan.file_runs):
            file_roundtrip(ctx, first, i)
    finally:
        kill_all(made)


def _payload(total: int, seed: bytes, chunk: int = 1 << 20) -> Iterator[bytes]:
    block = hashlib.shake_256(seed).digest(chunk)
    sent = 0
    i = 0
    while sent < total:
        n = min(chunk, total - sent)
        piece = i.to_bytes(8, "little") + block[8:n] if n > 8 else block[:n]
        yield piece
        sent += n
        i += 1


def file_roundtrip(ctx: Ctx, sbx: Sandbox, i: int) -> None:
    total = ctx.plan.file_mb * 1_000_000
    path = f"/root/bench-{i}.bin"
    want = hashlib.sha256()

    def gen() -> Iterator[bytes]:
        for piece in _payload(total, os.urandom(16)):
            want.update(piece)
            yield piece

    t0 = time.monotonic()
    entry = sbx.files.write(path, gen())
    write_ms = ms_since(t0)
    if entry.size != total:
        raise RuntimeError(f"wrote {total} bytes, the guest has {entry.size}")
    got = hashlib.sha256()
    n = 0
    t0 = time.monotonic()
    with sbx.files.read(path, format="stream") as chunks:
        for chunk in chunks:
            got.update(chunk)
            n += len(chunk)
    read_ms = ms_since(t0)
    sbx.files.remove(path)
    if n != total or got.digest() != want.digest():
        same = "matches" if got.digest() == want.digest() else "differs"
        raise RuntimeError(f"read back {n} of {total} bytes; sha256 {same}")
    r = ctx.results
    r.s("file_mb_s").add(2 * total / 1e6 / ((write_ms + read_ms) / 1000))
    r.s("file_write_mb_s").add(total / 1e6 / (write_ms / 1000))
    r.s("file_read_mb_s").add(total / 1e6 / (read_ms / 1000))
    ctx.log(f"files: {ctx.plan.file_mb} MB write {write_ms / 1000:.1f} s, read "
            f"{read_ms / 1000:.1f} s, sha256 ok")


# ---- snapshot pause, ready, restore ------------------------------------------------------------

def _pause_runs(ctx: Ctx, sbx: Sandbox, runs: int, prefix: str, keep_last: bool = False,
                ) -> Snapshot | None:
    r = ctx.results
    kept = None
    for i in range(runs):
        sample = measure_snapshot(sbx)
        r.s(f"{prefix}pause_ms").add(sample.pause_ms)
        r.s(f"{prefix}stall_ms").add(sample.stall_ms)
        r.s(f"{prefix}stall_at_ms").add(sample.stall_at_ms)
        r.s(f"{prefix}baseline_stall_ms").add(sample.baseline_stall_ms)
        r.s(f"{prefix}arrival_gap_ms").add(sample.arrival_gap_ms)
        r.s(f"{prefix}heartbeat_noise_ms").add(sample.baseline_gap_ms)
        r.s(f"{prefix}heartbeat_hz").add(sample.rate_hz)
        r.s(f"{prefix}host_pause_ms").add(sample.host_pause_ms)
        r.s(f"{prefix}capture_ms").add(sample.capture_ms)
        r.s(f"{prefix}ready_ms").add(sample.ready_ms)
        r.s(f"{prefix}stored_mib").add(sample.stored_mib)
        r.s(f"{prefix}size_mib").add(sample.size_mib)
        ctx.log(f"{prefix}: pause {sample.pause_ms:.1f} ms (host-seen {sample.host_pause_ms} "
                f"ms), largest stall {sample.stall_ms:.1f} ms "
                f"(at +{sample.stall_at_ms:.0f} ms), largest arrival gap "
                f"{sample.arrival_gap_ms:.1f} ms (noise floor {sample.baseline_gap_ms:.1f}), "
                f"ready {sample.ready_ms:.0f} ms, stored {sample.stored_mib:.1f} MiB")
        assert sample.snapshot is not None
        if keep_last and i == runs - 1:
            kept = sample.snapshot
        else:
            sample.snapshot.remove()
    return kept


def step_snapshot_restore(ctx: Ctx) -> None:
    plan, r = ctx.plan, ctx.results
    sbx = ctx.create(template="base")
    try:
        start_holder(sbx, plan.touched_mib)
        r.values["snapshot_memory_mb"] = sbx.info.memory_mb
        _pause_runs(ctx, sbx, plan.pause_runs, "snapshot_")
        # A snapshot without the heartbeat running in it, to restore from.
        t0 = time.monotonic()
        snap = sbx.create_snapshot("bench-restore")
        while snap.refresh().state not in ("ready", "failed"):
            time.sleep(0.02)
        if snap.state != "ready":
            raise RuntimeError(f"snapshot failed: {snap.error}")
        r.s("snapshot_ready_ms").add(ms_since(t0))
        r.values["restore_snapshot_stored_mib"] = snap.info.stored_bytes / 2**20
        ram = ctx.hot_dir / snap.snapshot_id / "ram"
        if ram.exists():
            r.values["snapshot_ram_file_mib"] = file_allocated_mib(ram)
    finally:
        kill_all([sbx])
    for _ in range(plan.runs):
        child, ms = ctx.timed_create(snapshot_id=snap.snapshot_id)
        t0 = time.monotonic()
        try:
            child.commands.run("true", check=True)
            r.s("restore_ms").add(ms + ms_since(t0))
        finally:
            kill_all([child])
    ctx.log(f"restore: p50 {r.s('restore_ms').p50:.0f} ms over {r.s('restore_ms').n}")
    snap.remove()


def step_big_pause(ctx: Ctx) -> None:
    plan = ctx.plan
    sbx = ctx.create(template="base", memory_mb=plan.big_memory_mb)
    try:
        start_holder(sbx, plan.touched_mib)
        _pause_runs(ctx, sbx, plan.big_pause_runs, f"snapshot{plan.big_memory_mb}_")
    finally:
        kill_all([sbx])


# ---- fork, memory ------------------------------------------------------------------------------

def _first_commands(children: list[Sandbox]) -> None:
    with ThreadPoolExecutor(max(1, len(children))) as ex:
        for result in ex.map(lambda c: c.commands.run("true"), children):
            if not result.ok:
                raise RuntimeError(f"first command in a fork child exited {result.exit_code}")


def _child_memory(ctx: Ctx, children: list[Sandbox], name: str) -> None:
    r = ctx.results
    for child in children:
        mem = qemu_memory(child.info.pid, ctx.hot_dir)
        r.s(f"{name}_private_mib").add(mem.ram_private_mib)
        r.s(f"{name}_pss_mib").add(mem.pss_mib)
        r.s(f"{name}_ram_pss_mib").add(mem.ram_pss_mib)
        r.s(f"{name}_jit_pss_mib").add(mem.jit_pss_mib)


def step_fork(ctx: Ctx) -> None:
    plan, r = ctx.plan, ctx.results
    parent = ctx.create(template="base")
    try:
        parent.commands.run("true", check=True)
        for _ in range(plan.fork1_runs):
            kids, call_ms = retrying(ctx, "fork(1)", lambda: parent.fork(1))
            t0 = time.monotonic()
            try:
                r.s("fork1_call_ms").add(call_ms)
                if kids.pause_ms is not None:
                    r.s("fork_parent_pause_ms").add(kids.pause_ms)
                _first_commands(kids)
                r.s("fork1_ms").add(call_ms + ms_since(t0))
            finally:
                kill_all(kids, close=False)
        ctx.log(f"fork(1): p50 {r.s('fork1_ms').p50:.0f} ms over {r.s('fork1_ms').n}")
        for count, runs, name in ((plan.fork_small, plan.fork_small_runs, "fork8"),
                                  (plan.fork_big, plan.fork_big_runs, "fork32")):
            for i in range(runs):
                _fork_wall(ctx, parent, count, name, measure_memory=i == 0)
                ctx.log(f"fork({count}) {i + 1}/{runs}: {r.s(f'{name}_wall_ms').values[-1]:.0f}"
                        f" ms wall")
    finally:
        kill_all([parent])


def _fork_wall(ctx: Ctx, parent: Sandbox, count: int, name: str, measure_memory: bool,
               attempts: int = 3) -> None:
    """One fork(count) until every child ran a first command. A fork where a child failed to
    start is recorded in the notes and retried (its time would be of fewer children)."""
    r = ctx.results
    for attempt in range(attempts):
        t0 = time.monotonic()
        try:
            kids = parent.fork(count)
        except SandlotError as e:  # every child failed
            msg = f"fork({count}) failed (attempt {attempt + 1}): {str(e).splitlines()[0]}"
            r.notes.append(msg)
            ctx.log(f"[yellow]{msg}[/]")
            continue
        try:
            if kids.errors:
                msg = (f"fork({count}): {len(kids.errors)} of {count} children failed to start "
                       f"(attempt {attempt + 1}): {str(kids.errors[0]).splitlines()[0]}")
                r.notes.append(msg)
                ctx.log(f"[yellow]{msg}[/]")
                continue
            r.s(f"{name}_call_ms").add(ms_since(t0))
            if kids.pause_ms is not None:
                r.s("fork_parent_pause_ms").add(kids.pause_ms)
            _first_commands(kids)
            r.s(f"{name}_wall_ms").add(ms_since(t0))
            if measure_memory:  # memory of idle children
                time.sleep(ctx.plan.settle_s)
                _child_memory(ctx, kids, name)
            return
        finally:
            kill_all(kids, close=False)
    raise RuntimeError(f"fork({count}) failed {attempts} times; see the notes")


def step_idle(ctx: Ctx) -> None:
    plan, r = ctx.plan, ctx.results
    made: list[Sandbox] = []
    try:
        for _ in range(plan.idle_count):
            sbx, ms = ctx.timed_create(template="base")
            made.append(sbx)
            r.s("create_loaded_ms").add(ms)
        time.sleep(plan.settle_s)
        mems = [qemu_memory(s.info.pid, ctx.hot_dir) for s in made]
        # Host CPU of an idle sandbox: its QEMU's (the guest's timers, the agent's wake-ups).
        pids = [s.info.pid for s in made]
        before, t0 = [process_cpu_ms(p) for p in pids], time.monotonic()
        time.sleep(plan.idle_cpu_s)
        after, seconds = [process_cpu_ms(p) for p in pids], time.monotonic() - t0
        for a, b in zip(before, after, strict=True):
            r.s("idle_cpu_ms_per_s").add((b - a) / seconds)
        r.values["idle20_pss_mib"] = sum(m.pss_mib for m in mems)
        r.values["idle_pss_per_sandbox_mib"] = r.values["idle20_pss_mib"] / len(mems)
        private = sum(m.ram_private_mib for m in mems)
        r.values["idle_private_ram_per_sandbox_mib"] = private / len(mems)
        r.values["idle_jit_per_sandbox_mib"] = sum(m.jit_pss_mib for m in mems) / len(mems)
        r.values["template_ram_file_mib_end"] = template_ram_mib(ctx)
        ctx.log(f"{plan.idle_count} idle sandboxes: {r.values['idle20_pss_mib']:.0f} MiB PSS")
    finally:
        kill_all(made)


Step = Callable[[Ctx], None]
# ---- networking --------------------------------------------------------------------------------

def step_network(ctx: Ctx) -> None:
    """What a sandbox's network costs: namespace, veth, tap and nftables rules set up (on the
    create/fork path, concurrently with the disk overlay) and torn down (on kill). Measured
    in-process with the server's own network code, in a pool and owner of its own."""
    if os.environ.get("SANDLOT_NETWORK", "on") == "off":
        ctx.results.notes.append("network cost not measured: networking is off (--no-network)")
        return
    from sandlot.vmm.network import NetworkManager, NetworkPolicy

    manager = NetworkManager(dns_servers=[], pool="10.206.0.0/16", owner=f"bench{os.getpid()}")
    r = ctx.results
    try:
        for i in range(ctx.plan.creates):
            sandbox_id = f"sb-bench{i:04d}"
            t0 = time.monotonic()
            manager.setup(sandbox_id, NetworkPolicy())
            r.s("network_setup_ms").add(ms_since(t0))
            t0 = time.monotonic()
            manager.teardown(sandbox_id)
            r.s("network_teardown_ms").add(ms_since(t0))
    finally:
        manager.cleanup_stale(set())
    ctx.log(f"network: setup p50 {r.s('network_setup_ms').p50:.0f} ms, teardown p50 "
            f"{r.s('network_teardown_ms').p50:.0f} ms")


STEPS: list[tuple[str, Step]] = [
    ("cold boot", step_cold_boot),
    ("create, exec, files", step_create_exec_files),
    ("create without the warm pool", step_create_without_pool),
    ("network cost", step_network),
    ("snapshot, restore", step_snapshot_restore),
    ("snapshot of a bigger sandbox", step_big_pause),
    ("fork", step_fork),
    ("idle sandboxes", step_idle),
]
