"""Samples and their percentiles."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float | None:
    """The `q`-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Series:
    """Repeated measurements of one figure."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float | None) -> None:
        if value is not None:
            self.values.append(float(value))

    @property
    def p50(self) -> float | None:
        return percentile(self.values, 50)

    @property
    def p90(self) -> float | None:
        return percentile(self.values, 90)

    @property
    def n(self) -> int:
        return len(self.values)


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as t: ...`` then ``t[0]`` is the elapsed time in ms."""
    out: list[float] = []
    t0 = time.monotonic()
    try:
        yield out
    finally:
        out.append((time.monotonic() - t0) * 1000)


def ms_since(t0: float) -> float:
    return (time.monotonic() - t0) * 1000
