"""An Inspect AI eval on the sandlot provider, from a warmed snapshot against the same provider
set up per sample (issue #24, docs/benchmarks.md), and best-of-4 from a mid-sample fork against
four fresh samples. One server, the runs one after the other in one process.

    python bench/inspect_warm.py [--samples 32] [--setup-seconds 25] [--max-samples 8]
        [--work-iterations 400000] [--json bench/results/inspect_warm.json]

The task's setup stands for a package install: it waits `--setup-seconds` (the download) and
writes 20 MB of files (the unpack). Each sample reads one of the setup's files and answers.
Per sample "start" is Inspect's `sample_init` on the provider: a restore of the task snapshot
(warm) or a create plus the setup (per-sample setup). Host memory: the peak of the summed PSS of
the server's QEMUs, sampled every 0.5 s. Best-of-4: a sample does some CPU work
(`--work-iterations` rounds of SHA-256 in the guest's python), then either forks 4 copies of
its sandbox and runs one attempt in each, or four fresh samples each do the work and one attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _procmem import process_pss_kib
from _server import BenchServer, qemu_pids
from _stats import percentile
from sandlot.integrations import inspect_ai as provider


class MemoryPeak:
    """The peak of the summed PSS (MiB) of a server's QEMUs while running."""

    def __init__(self, run_root: Path) -> None:
        self.run_root = run_root
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            total = 0
            for pid in qemu_pids(self.run_root):
                try:
                    total += process_pss_kib(pid)
                except (OSError, RuntimeError):
                    pass
            self.peak_mib = max(self.peak_mib, total / 1024)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


STARTS: list[float] = []
TASK_INITS: list[float] = []
_sample_init = provider.SandlotSandboxEnvironment.sample_init.__func__
_task_init = provider.SandlotSandboxEnvironment.task_init.__func__


async def _timed_sample_init(cls, task_name, config, metadata):
    t0 = time.monotonic()
    try:
        return await _sample_init(cls, task_name, config, metadata)
    finally:
        STARTS.append(time.monotonic() - t0)


async def _timed_task_init(cls, task_name, config):
    t0 = time.monotonic()
    try:
        return await _task_init(cls, task_name, config)
    finally:
        TASK_INITS.append(time.monotonic() - t0)


provider.SandlotSandboxEnvironment.sample_init = classmethod(_timed_sample_init)
provider.SandlotSandboxEnvironment.task_init = classmethod(_timed_task_init)


def setup_command(seconds: int) -> str:
    return (f"sleep {seconds} && mkdir -p /opt/env && for i in $(seq 200); do "
            "head -c 100000 /dev/urandom > /opt/env/f$i; done && echo ready > /opt/env/marker")


def run_eval(task, max_samples: int, log_dir: Path, server: BenchServer) -> dict:
    from inspect_ai import eval

    STARTS.clear()
    TASK_INITS.clear()
    with MemoryPeak(server.run_root) as mem:
        t0 = time.monotonic()
        [log] = eval(task, model="mockllm/model", log_dir=str(log_dir), display="none",
                     max_samples=max_samples, max_sandboxes=max_samples)
        wall = time.monotonic() - t0
    assert log.status == "success", log.error
    assert all(s.scores and next(iter(s.scores.values())).value == "C" for s in log.samples)
    starts = sorted(STARTS)
    return {"wall_s": round(wall, 1), "samples": len(log.samples),
            "task_init_s": round(sum(TASK_INITS), 1),
            "start_p50_s": round(statistics.median(starts), 2),
            "start_p90_s": round(percentile(starts, 90), 2),
            "qemu_pss_peak_mib": round(mem.peak_mib)}


def warm_vs_setup(args, server: BenchServer, log_dir: Path) -> dict:
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox

    @solver
    def read_env():
        async def solve(state, generate_):
            echo = f"echo {state.input}-$(cat /opt/env/marker)"
            result = await sandbox().exec(["sh", "-c", echo])
            state.output.completion = result.stdout
            return state
        return solve

    out = {}
    for label, snapshot in (("warm snapshot", True), ("setup per sample", False)):
        task = Task(name=f"warm-{int(snapshot)}",
                    dataset=[Sample(input=f"s{i}", target=f"s{i}-ready")
                             for i in range(args.samples)],
                    solver=read_env(), scorer=includes(),
                    sandbox=("sandlot", provider.SandlotConfig(
                        setup=setup_command(args.setup_seconds), snapshot=snapshot,
                        timeout=3600)))
        out[label] = run_eval(task, args.max_samples, log_dir, server)
        print(label, out[label], flush=True)
    return out


def best_of_four(args, server: BenchServer, log_dir: Path) -> dict:
    from inspect_ai import Task
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import includes
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox

    work = ("python3 -c 'import hashlib\nh=b\"\"\n"
            f"for _ in range({args.work_iterations}): h=hashlib.sha256(h).digest()\n"
            "open(\"/tmp/state\",\"w\").write(h.hex())'")

    async def attempt(env, i: int) -> str:
        result = await env.exec(["sh", "-c", f"test -s /tmp/state && echo attempt-{i}"])
        return result.stdout.strip()

    @solver
    def forked():
        async def solve(state, generate_):
            env = sandbox()
            t0 = time.monotonic()
            await env.exec(["sh", "-c", work], timeout=3600)
            state.metadata["work_s"] = time.monotonic() - t0
            children = await provider.fork(4)
            answers = [await attempt(child, i) for i, child in enumerate(children)]
            state.output.completion = " ".join(answers)
            return state
        return solve

    @solver
    def fresh():
        async def solve(state, generate_):
            env = sandbox()
            await env.exec(["sh", "-c", work], timeout=3600)
            state.output.completion = await attempt(env, int(state.input))
            return state
        return solve

    config = ("sandlot", provider.SandlotConfig(setup=setup_command(1), timeout=3600))
    fork_task = Task(name="best-of-4-fork", dataset=[Sample(input="0", target="attempt-3")],
                     solver=forked(), scorer=includes(), sandbox=config)
    fresh_task = Task(name="best-of-4-fresh",
                      dataset=[Sample(input=str(i), target=f"attempt-{i}") for i in range(4)],
                      solver=fresh(), scorer=includes(), sandbox=config)
    out = {"fork(4) mid-sample": run_eval(fork_task, 4, log_dir, server),
           "4 fresh samples": run_eval(fresh_task, 4, log_dir, server)}
    for label, figures in out.items():
        print(label, figures, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--setup-seconds", type=int, default=25)
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("--work-iterations", type=int, default=400_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sandlot-bench-") as tmp:
        server = BenchServer.make(Path(tmp))
        server.start()
        try:
            os.environ.update(SANDLOT_URL=server.url, SANDLOT_API_KEY=server.key)
            report = {"args": vars(args) | {"json": str(args.json)},
                      "eval": warm_vs_setup(args, server, Path(tmp) / "logs"),
                      "best_of_4": best_of_four(args, server, Path(tmp) / "logs")}
        finally:
            server.close()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
