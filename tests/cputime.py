"""Which test modules cost the host's CPUs the most: the CPU time the whole host spent
(`/proc/stat`: user, system, interrupts; every process, the servers and QEMUs a test started
included) while each module's tests ran, set-up and teardown included, summed per module and
printed at the end of the run beside pytest's `--durations`.

Wall time says which module is slow; this says which one keeps the CPUs busy, which is what
running modules side by side could not hide (issue 27: a run keeps 2 CPUs ~62% busy). The
figure counts whatever else ran on the host meanwhile, so read it from a run with nothing
beside it (`make ci`).
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

TICK = os.sysconf("SC_CLK_TCK")
SHOWN = 25

_cpu_s: dict[str, float] = defaultdict(float)
_wall_s: dict[str, float] = defaultdict(float)


def _busy_and_total() -> tuple[int, int]:
    """The host's busy and total CPU ticks since boot (idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy0, total0 = _busy_and_total()
    try:
        return (yield)
    finally:
        busy1, total1 = _busy_and_total()
        module = item.nodeid.split("::", 1)[0]
        _cpu_s[module] += (busy1 - busy0) / TICK
        _wall_s[module] += (total1 - total0) / TICK / (os.cpu_count() or 1)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _cpu_s:
        return
    cpus = os.cpu_count() or 1
    total_cpu, total_wall = sum(_cpu_s.values()), sum(_wall_s.values())
    terminalreporter.write_sep("=", f"host CPU time by test module (top {SHOWN})")
    terminalreporter.write_line(
        f"all tests: {total_cpu:.0f} CPU-s in {total_wall:.0f} s of wall time; "
        f"{cpus} CPUs fully busy could not run them in under {total_cpu / cpus:.0f} s")
    for module, cpu in sorted(_cpu_s.items(), key=lambda kv: -kv[1])[:SHOWN]:
        wall = _wall_s[module]
        terminalreporter.write_line(
            f"{cpu:8.0f} CPU-s {wall:7.0f} s wall {100 * cpu / max(wall * cpus, 1e-9):4.0f}% "
            f"busy  {module}")
