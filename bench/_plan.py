"""How much of everything a run does: `full`, `quick` (under 5 minutes on 2 cores) or `smoke`
(each figure once, with tiny counts: it only checks that the benchmark runs)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Plan:
    mode: str
    runs: int  # repetitions of each repeated figure
    cold_boots: int
    creates: int
    execs: int
    file_mb: int  # decimal MB moved each way
    file_runs: int
    touched_mib: int  # memory the snapshotted guest holds (random data)
    pause_runs: int
    big_memory_mb: int  # the second snapshot-pause sandbox (0: skip)
    big_pause_runs: int
    fork1_runs: int
    fork_small: int  # "fork8"
    fork_small_runs: int
    fork_big: int  # "fork32"
    fork_big_runs: int
    idle_count: int  # "idle20"
    settle_s: float  # idle time before memory is read
    idle_cpu_s: float  # then the window over which their host CPU is read
    incremental_snapshots: int  # snapshots of one sandbox, 10 MiB changed between each
    peer: bool
    peer_runs: int


def make_plan(mode: str, runs: int | None = None) -> Plan:
    if mode == "smoke":
        r = runs or 1
        return Plan(mode=mode, runs=r, cold_boots=1, creates=r, execs=3 * r, file_mb=16,
                    file_runs=1, touched_mib=100, pause_runs=r, big_memory_mb=0,
                    big_pause_runs=0, fork1_runs=r, fork_small=2, fork_small_runs=1, fork_big=2,
                    fork_big_runs=1, idle_count=2, settle_s=1.0, idle_cpu_s=2.0,
                    incremental_snapshots=2, peer=False, peer_runs=0)
    if mode == "quick":
        r = runs or 3
        return Plan(mode=mode, runs=r, cold_boots=1, creates=2 * r, execs=10 * r, file_mb=200,
                    file_runs=1, touched_mib=100, pause_runs=r, big_memory_mb=2048,
                    big_pause_runs=1, fork1_runs=r, fork_small=8, fork_small_runs=2,
                    fork_big=32, fork_big_runs=1, idle_count=20, settle_s=2.0, idle_cpu_s=10.0,
                    incremental_snapshots=10, peer=True, peer_runs=r)
    r = runs or 10
    return Plan(mode="full", runs=r, cold_boots=3, creates=r, execs=10 * r, file_mb=200,
                file_runs=3, touched_mib=100, pause_runs=r, big_memory_mb=2048,
                big_pause_runs=3, fork1_runs=r, fork_small=8, fork_small_runs=5, fork_big=32,
                fork_big_runs=3, idle_count=20, settle_s=3.0, idle_cpu_s=20.0,
                incremental_snapshots=10, peer=True, peer_runs=r)


__all__ = ["Plan", "make_plan", "replace"]
