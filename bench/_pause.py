"""The snapshot pause as the guest lives it, measured against the host's clock.

While QEMU is stopped the guest's clocks stop too, so a guest timing itself sees nothing. So a
guest process writes a heartbeat line every ~1 ms (sequence number and its CLOCK_MONOTONIC) to
stdout; the output streams to the host (agent -> server -> NDJSON -> SDK callback), which
stamps each line with the host's monotonic clock as it arrives. For each line,
``host arrival - guest stamp`` is the guest clock's offset plus that line's delivery delay.
From that stream:

- ``pause_ms``: how far the guest's clock fell behind the host's across the snapshot: the step
  in the *minimum* offset (over hundreds of lines, the minimum is a line delivered at once).
  The guest clock loses exactly the time the VM was stopped, so this is the pause, measured in
  the guest against an outside clock, and free of the delivery path's jitter.
- ``stall_ms``: the largest gap between consecutive heartbeats on the guest's own clock while
  the snapshot is taken: times the guest ran but its loop did not (vCPU starved of host CPU or
  blocked in QEMU). ``baseline_stall_ms`` is the same in the second before.
- ``arrival_gap_ms``: the largest gap between heartbeat *arrivals* on the host. An upper bound
  of what an observer outside sees: the pause, stalls, and delays of the guest's output on
  its way out (e.g. QEMU's main loop busy, the server's event loop busy).
  ``baseline_gap_ms`` is the same in the second before: the method's noise floor.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sandlot import Sandbox, Snapshot

HOLDER = """\
import os, time
b = bytearray({mib} << 20)
for i in range(0, len(b), 1 << 20):
    b[i:i + (1 << 20)] = os.urandom(1 << 20)
open('/tmp/holder.ready', 'w').close()
time.sleep(10 ** 6)
"""

HEARTBEAT = """\
import os, time
mono, write, sleep = time.monotonic_ns, os.write, time.sleep
i = 0
while True:
    i += 1
    write(1, b"%d %d\\n" % (i, mono()))
    sleep(0.001)
"""

POLL_S = 0.02


def start_holder(sbx: Sandbox, mib: int) -> None:
    """A guest process holding `mib` MiB of random data (touched, incompressible memory)."""
    sbx.files.write("/tmp/holder.py", HOLDER.format(mib=mib))
    sbx.commands.start("python3 /tmp/holder.py")
    sbx.commands.run("while [ ! -e /tmp/holder.ready ]; do sleep 0.05; done", timeout=300,
                     check=True)


@dataclass
class Heartbeat:
    """Host-stamped heartbeat lines from a guest process: (host_s, seq, guest_s)."""

    lines: list[tuple[float, int, float]] = field(default_factory=list)
    _buf: str = ""

    def feed(self, chunk: str) -> None:
        now = time.monotonic()
        text = self._buf + chunk
        *complete, self._buf = text.split("\n")
        for line in complete:
            parts = line.split()
            if len(parts) == 2:
                self.lines.append((now, int(parts[0]), int(parts[1]) / 1e9))

    def between(self, t0: float, t1: float) -> list[tuple[float, int, float]]:
        return [x for x in self.lines if t0 <= x[0] <= t1]


@dataclass
class PauseSample:
    pause_ms: float | None
    stall_ms: float
    stall_at_ms: float  # when the largest stall began, after the create_snapshot() call
    baseline_stall_ms: float
    arrival_gap_ms: float
    baseline_gap_ms: float
    host_pause_ms: float | None  # SnapshotInfo.pause_ms: stop -> cont as the server saw it
    capture_ms: float | None  # SnapshotInfo.capture_ms
    ready_ms: float  # create_snapshot() call -> state ready (polled every 20 ms)
    captured_ms: float  # create_snapshot() call -> state leaves `creating`
    stored_mib: float | None
    size_mib: float | None
    rate_hz: float  # heartbeat lines per second before the snapshot
    snapshot: Snapshot | None = None
    trace: list[tuple[float, int, float]] = field(default_factory=list, repr=False)
    t_call: float = 0.0  # host monotonic times, for looking at `trace`
    t_captured: float = 0.0


def _largest_gap(lines: list[tuple[float, int, float]], clock: int) -> float:
    """The largest gap in ms between consecutive lines on the host's (0) or guest's (2) clock."""
    return _largest_gap_at(lines, clock)[0]


def _largest_gap_at(lines: list[tuple[float, int, float]], clock: int) -> tuple[float, float]:
    """(largest gap in ms, host time of the line before it)."""
    best = (0.0, 0.0)
    for a, b in zip(lines, lines[1:], strict=False):
        gap = (b[clock] - a[clock]) * 1000
        if gap > best[0]:
            best = (gap, a[0])
    return best


def _min_offset(lines: list[tuple[float, int, float]]) -> float | None:
    return min((h - g for h, _, g in lines), default=None)


def measure_snapshot(sbx: Sandbox, *, baseline_s: float = 1.0, tail_s: float = 0.5,
                     ready_timeout: float = 600) -> PauseSample:
    """Take one snapshot of `sbx` while a heartbeat runs in it; returns the pause figures.

    The snapshot is left in place (``sample.snapshot``); the caller removes it.
    """
    sbx.files.write("/tmp/heartbeat.py", HEARTBEAT)
    hb = Heartbeat()
    handle = sbx.commands.start("exec python3 -u /tmp/heartbeat.py")
    follower = threading.Thread(target=lambda: handle.wait(on_stdout=hb.feed), daemon=True)
    follower.start()
    try:
        deadline = time.monotonic() + 60
        while len(hb.lines) < 50:  # warm up: the stream is flowing
            if time.monotonic() > deadline:
                raise RuntimeError("the heartbeat did not start streaming")
            time.sleep(0.05)
        time.sleep(baseline_s)
        t_call = time.monotonic()
        snap = sbx.create_snapshot()
        t_captured = None
        while True:
            snap.refresh()
            now = time.monotonic()
            if t_captured is None and snap.state != "creating":
                t_captured = now
            if snap.state == "ready":
                break
            if snap.state in ("failed", "deleted"):
                raise RuntimeError(f"snapshot {snap.snapshot_id} {snap.state}: {snap.error}")
            if now - t_call > ready_timeout:
                raise RuntimeError(f"snapshot {snap.snapshot_id} not ready after "
                                   f"{ready_timeout}s")
            time.sleep(POLL_S)
        t_ready = time.monotonic()
        assert t_captured is not None
        time.sleep(max(0.0, t_captured + tail_s - time.monotonic()))
    finally:
        handle.kill()
        follower.join(10)
    before = hb.between(t_call - baseline_s, t_call)
    during = hb.between(t_call, t_captured + 0.2)
    after = hb.between(t_captured + 0.2, t_captured + tail_s)
    if len(before) < 10 or len(during) < 2 or len(after) < 10:
        raise RuntimeError(f"too few heartbeats ({len(before)} before, {len(during)} during, "
                           f"{len(after)} after the snapshot)")
    window = before[-1:] + during
    off_before, off_after = _min_offset(before), _min_offset(after)
    pause = None
    if off_before is not None and off_after is not None:
        pause = max(0.0, (off_after - off_before) * 1000)
    info = snap.info
    stall, stall_at = _largest_gap_at(window, 2)
    return PauseSample(
        pause_ms=pause, stall_ms=stall, stall_at_ms=(stall_at - t_call) * 1000,
        baseline_stall_ms=_largest_gap(before, 2), arrival_gap_ms=_largest_gap(window, 0),
        baseline_gap_ms=_largest_gap(before, 0), host_pause_ms=info.pause_ms,
        capture_ms=info.capture_ms, ready_ms=(t_ready - t_call) * 1000,
        captured_ms=(t_captured - t_call) * 1000,
        stored_mib=info.stored_bytes / 2**20 if info.stored_bytes is not None else None,
        size_mib=info.size_bytes / 2**20 if info.size_bytes is not None else None,
        rate_hz=len(before) / baseline_s, snapshot=snap, trace=hb.lines, t_call=t_call,
        t_captured=t_captured)
