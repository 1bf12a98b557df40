"""Prometheus metrics at ``GET /metrics`` (prometheus-client, a registry per app): sandboxes
by state, operation latencies, the warm pool, this host's room (memory, disk it can still
promise, the disks it promised) and the store's bytes.

Latencies are observed where the operation is answered (routes) or finishes (a snapshot's
`ready`, through SnapshotManager's hook); gauges are read from core when scraped."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)

from sandlot.core.models import SandboxState
from sandlot.server.deps import core

BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
COUNTED_STATES = (SandboxState.STARTING, SandboxState.RUNNING, SandboxState.PAUSED,
                  SandboxState.LOST)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.operation_seconds = Histogram(
            "sandlot_operation_seconds", "Time to answer an operation (snapshot: to ready)",
            ["operation"], buckets=BUCKETS, registry=self.registry)
        self.sandboxes = Gauge("sandlot_sandboxes", "Sandboxes by state (running and starting "
                               "on this host; paused and lost in the deployment)", ["state"],
                               registry=self.registry)
        self.pool = Gauge("sandlot_pool_vms", "Warm pool VMs ready, and claims and misses so "
                          "far, per template", ["template", "kind"], registry=self.registry)
        self.memory_free = Gauge("sandlot_host_memory_free_bytes", "Memory this host can still "
                                 "hand out (beyond its reserve)", registry=self.registry)
        self.disk_free = Gauge("sandlot_host_disk_free_bytes", "Disk this host can still "
                               "promise sandboxes (beyond its reserve and what the disks of "
                               "its sandboxes may still take)", registry=self.registry)
        self.disk_promised = Gauge("sandlot_host_disk_promised_bytes", "The disks (quotas) of "
                                   "this host's sandboxes", registry=self.registry)
        self.slots_free = Gauge("sandlot_host_free_slots", "Sandboxes this host can still take",
                                registry=self.registry)
        self.store_bytes = Gauge("sandlot_store_snapshot_bytes", "Bytes of ready snapshots: "
                                 "their logical size and what they added to the store",
                                 ["kind"], registry=self.registry)

    def observe(self, operation: str, seconds: float) -> None:
        self.operation_seconds.labels(operation).observe(seconds)


def metrics_of(request: Request) -> Metrics:
    return request.app.state.metrics


@contextlib.contextmanager
def timed(request: Request, operation: str) -> Iterator[None]:
    """Observe how long the block takes as `operation`, if it succeeds."""
    t = time.perf_counter()
    yield
    metrics_of(request).observe(operation, time.perf_counter() - t)


router = APIRouter(include_in_schema=False)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    m = metrics_of(request)
    stats = await core(request).stats(COUNTED_STATES)
    for state, count in stats.sandboxes.items():
        m.sandboxes.labels(state.value).set(count)
    for template, pool in stats.pool.items():
        for kind in ("ready", "claimed", "misses"):
            if isinstance(pool.get(kind), int):
                m.pool.labels(template, kind).set(pool[kind])
    m.memory_free.set(stats.memory_free_mb << 20)
    m.disk_free.set(stats.disk_free_mb << 20)
    m.disk_promised.set(stats.disk_promised_mb << 20)
    m.slots_free.set(stats.free_slots)
    m.store_bytes.labels("logical").set(stats.snapshot_bytes)
    m.store_bytes.labels("stored").set(stats.stored_bytes)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
