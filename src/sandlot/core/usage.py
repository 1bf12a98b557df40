"""Each running sandbox's use of CPU, memory and disk over time, sampled from the host side
(runtime.usage: /proc and its disk files, no guest call) every `interval` seconds and kept for
`keep` samples, for `GET /v1/sandboxes/{id}/metrics` and E2B's `get_metrics()`."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from pydantic import BaseModel

from sandlot.core.background import stop_task
from sandlot.core.live import LiveSandbox
from sandlot.errors import InvalidArgumentError
from sandlot.runtime.base import Runtime, Usage

log = logging.getLogger(__name__)


class SandboxMetric(BaseModel):
    """One sample. `cpu_used_pct` is of the sandbox's own vCPUs (100: all of them busy);
    `mem_used` is the memory that is the sandbox's own on the host (pages it changed since
    its restore, and QEMU's), `disk_used` the bytes its own disk layers hold, `disk_total` the
    disk its guest sees (its quota), `disk_errors` its disk I/Os the host failed (its guest got
    I/O errors: the host's filesystem was full)."""

    timestamp: float  # seconds since the epoch
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int
    disk_errors: int = 0


class UsageSampler:
    def __init__(self, runtime: Runtime, live: Callable[[], dict[str, LiveSandbox]],
                 interval: float = 5.0, keep: int = 720) -> None:
        self.runtime = runtime
        self.live = live
        self.interval = interval
        self.keep = keep
        self._history: dict[str, collections.deque[SandboxMetric]] = {}
        self._last: dict[str, tuple[float, float]] = {}  # id -> (monotonic, cpu seconds)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await stop_task(self._task)

    async def _loop(self) -> None:
        while True:
            try:
                self.sample_all()
            except Exception:  # noqa: BLE001 - sampling must go on
                log.exception("sampling sandbox usage failed")
            await asyncio.sleep(self.interval)

    def sample_all(self) -> None:
        live = self.live()
        for sandbox_id in [s for s in self._history if s not in live]:
            self._history.pop(sandbox_id, None)
            self._last.pop(sandbox_id, None)
        for sandbox_id, sandbox in live.items():
            self.sample(sandbox_id, sandbox)

    def sample(self, sandbox_id: str, sandbox: LiveSandbox) -> SandboxMetric | None:
        usage = self.runtime.usage(sandbox.vm)
        if usage is None:
            return None
        metric = self._metric(sandbox_id, usage)
        self._history.setdefault(sandbox_id, collections.deque(maxlen=self.keep)).append(metric)
        return metric

    def _metric(self, sandbox_id: str, usage: Usage) -> SandboxMetric:
        t = time.monotonic()
        last = self._last.get(sandbox_id)
        self._last[sandbox_id] = (t, usage.cpu_seconds)
        pct = 0.0
        if last is not None and t > last[0]:
            pct = 100.0 * (usage.cpu_seconds - last[1]) / ((t - last[0]) * max(1, usage.cpus))
        return SandboxMetric(timestamp=time.time(), cpu_count=usage.cpus,
                             cpu_used_pct=round(min(100.0, max(0.0, pct)), 2),
                             mem_used=usage.memory_bytes, mem_total=usage.memory_total_bytes,
                             disk_used=usage.disk_bytes, disk_total=usage.disk_total_bytes,
                             disk_errors=usage.disk_errors)

    def history(self, sandbox_id: str, start: float | None = None,
                end: float | None = None) -> list[SandboxMetric]:
        """The samples of a sandbox running here between `start` and `end` (epoch seconds);
        one taken now if it has none yet."""
        if start is not None and end is not None and start > end:
            raise InvalidArgumentError("start must not be after end")
        live = self.live().get(sandbox_id)
        if live is not None and sandbox_id not in self._history:
            self.sample(sandbox_id, live)
        return [m for m in self._history.get(sandbox_id, ())
                if (start is None or m.timestamp >= start) and (end is None or m.timestamp <= end)]
