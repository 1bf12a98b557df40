"""/v1/sandboxes: create, list, get, kill, timeout, fork, rollback, snapshot."""

from __future__ import annotations

import json

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from sandlot.core.models import (
    CreateSandbox,
    NetworkSpec,
    SandboxRecord,
    SandboxState,
    SnapshotRecord,
)
from sandlot.core.sandboxes import Forked
from sandlot.core.usage import SandboxMetric
from sandlot.errors import InvalidArgumentError, SandlotError
from sandlot.server.auth import who
from sandlot.server.deps import core
from sandlot.server.errors import public_message
from sandlot.server.forward import forwarded_from
from sandlot.server.metrics import timed
from sandlot.server.relay import forwarded

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


class TimeoutBody(BaseModel):
    timeout: int = Field(ge=0)


class ForkBody(BaseModel):
    count: int = Field(1, ge=1, le=64)


class RollbackBody(BaseModel):
    snapshot_id: str


class SnapshotBody(BaseModel):
    name: str | None = None
    memory: bool = Field(True, description=(
        "keep memory, processes and devices (a restore resumes where it was); false: the "
        "filesystem only (smaller, no pause; a restore boots from that disk)"))


class PauseBody(BaseModel):
    memory: bool = Field(True, description=(
        "keep memory and processes (the resume continues where it was); false: the "
        "filesystem only (the resume boots from the disk); default: the sandbox's "
        "`pause_memory`"))


class SandboxList(BaseModel):
    sandboxes: list[SandboxRecord]


class ForkError(BaseModel):
    index: int
    error: dict


class ForkResult(BaseModel):
    sandboxes: list[SandboxRecord]
    errors: list[ForkError]
    pause_ms: float  # how long the parent was paused for the capture


@router.post("", status_code=201, response_model=SandboxRecord)
async def create_sandbox(body: CreateSandbox, request: Request) -> SandboxRecord:
    """A new sandbox from a template or a snapshot, on the host placement picks."""
    with timed(request, "restore" if body.snapshot_id else "create"):
        return await core(request).placement.create(
            body, who(request), placed=forwarded(request.scope),
            forked_from=forwarded_from(request.scope))


@router.get("", response_model=SandboxList)
async def list_sandboxes(request: Request, metadata: str | None = None, all: bool = False,
                         state: list[SandboxState] | None = Query(None)) -> SandboxList:
    """Running and paused sandboxes (`all`: every one ever made), optionally only those in
    `state` and whose metadata holds every pair of `metadata` (a JSON object)."""
    wanted = None
    if metadata:
        try:
            wanted = json.loads(metadata)
            if not isinstance(wanted, dict):
                raise ValueError
        except (ValueError, RecursionError):
            raise InvalidArgumentError("metadata must be a JSON object of strings") from None
        wanted = {str(k): str(v) for k, v in wanted.items()}
    states = tuple(state) if state else None
    return SandboxList(sandboxes=await core(request).sandboxes.list(
        wanted, all=all, states=states, who=who(request)))


@router.get("/{sandbox_id}", response_model=SandboxRecord)
async def get_sandbox(sandbox_id: str, request: Request) -> SandboxRecord:
    return await core(request).sandboxes.get(sandbox_id, who(request))


@router.delete("/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, request: Request) -> Response:
    await core(request).sandboxes.kill(sandbox_id, who=who(request))
    return Response(status_code=204)


@router.post("/{sandbox_id}/timeout", response_model=SandboxRecord)
async def set_timeout(sandbox_id: str, body: TimeoutBody, request: Request) -> SandboxRecord:
    return await core(request).sandboxes.set_timeout(sandbox_id, body.timeout,
                                                     who=who(request))


@router.post("/{sandbox_id}/fork", response_model=ForkResult)
async def fork_sandbox(sandbox_id: str, body: ForkBody, request: Request) -> ForkResult:
    """`count` copy-on-write children of the sandbox's current state; in a deployment, those
    that do not fit on its host start on others."""
    with timed(request, "fork"):
        forked = await core(request).placement.fork(sandbox_id, body.count, who(request))
    return fork_result(forked)


def fork_result(forked: Forked) -> ForkResult:
    """A fork's answer: the children that run, and the error of each that did not start."""
    results = forked.children
    ok = [r for r in results if isinstance(r, SandboxRecord)]
    errors = [ForkError(index=i, error={"type": type(r).__name__,
                                        "message": public_message(r)})
              for i, r in enumerate(results) if isinstance(r, SandlotError)]
    return ForkResult(sandboxes=ok, errors=errors, pause_ms=round(forked.pause_ms, 2))


@router.post("/{sandbox_id}/rollback", response_model=SandboxRecord)
async def rollback_sandbox(sandbox_id: str, body: RollbackBody, request: Request) -> SandboxRecord:
    return await core(request).sandboxes.rollback(sandbox_id, body.snapshot_id,
                                                  who=who(request))


class ResumeBody(BaseModel):
    timeout: int | None = Field(None, ge=0)
    reboot: bool = Field(False, description=(
        "boot from the disk as it was at the pause instead of resuming its memory "
        "(a sandbox paused without memory always boots)"))


@router.post("/{sandbox_id}/pause", response_model=SandboxRecord)
async def pause_sandbox(sandbox_id: str, request: Request,
                        body: PauseBody | None = None) -> SandboxRecord:
    """Keep the sandbox's whole state (memory, processes, disk), or its filesystem only
    (`memory: false`), and stop its VM; answers once the state is stored. `resume` brings it
    back under the same id."""
    memory = body.memory if body is not None and "memory" in body.model_fields_set else None
    with timed(request, "pause"):
        return await core(request).sandboxes.pause(sandbox_id, memory=memory,
                                                   who=who(request))


@router.post("/{sandbox_id}/resume", response_model=SandboxRecord)
async def resume_sandbox(sandbox_id: str, request: Request,
                         body: ResumeBody | None = None) -> SandboxRecord:
    """Bring a paused sandbox back exactly where it was (a new timeout if given), or booted
    from its disk (paused without memory, or `reboot`)."""
    with timed(request, "resume"):  # on whichever host placement picks
        return await core(request).placement.resume(
            sandbox_id, body.timeout if body else None, bool(body and body.reboot),
            who=who(request), placed=forwarded(request.scope))


@router.post("/{sandbox_id}/snapshots", status_code=201, response_model=SnapshotRecord)
async def create_snapshot(sandbox_id: str, request: Request,
                          body: SnapshotBody | None = None) -> SnapshotRecord:
    body = body or SnapshotBody()
    return await core(request).sandboxes.snapshot(sandbox_id, body.name, memory=body.memory,
                                                  who=who(request))


class MetricList(BaseModel):
    metrics: list[SandboxMetric]


@router.get("/{sandbox_id}/metrics", response_model=MetricList)
async def sandbox_metrics(sandbox_id: str, request: Request, start: float | None = None,
                          end: float | None = None) -> MetricList:
    """The sandbox's CPU, memory and disk use, sampled from the host every
    SANDLOT_METRICS_INTERVAL seconds (an hour is kept), between `start` and `end` (seconds
    since the epoch)."""
    c = core(request)
    c.sandboxes.running(sandbox_id, who(request))
    return MetricList(metrics=c.usage.history(sandbox_id, start, end))


class PortBody(BaseModel):
    port: int = Field(ge=1, le=65535)


class ExposedPort(BaseModel):
    host: str
    port: int
    address: str


class NetworkBody(BaseModel):
    internet: bool | None = None
    allow_out: list[str] | None = None
    deny_out: list[str] | None = None
    # IPv4 addresses reachable whatever allow_out and deny_out say ([]: none)
    dns_servers: list[str] | None = None


@router.post("/{sandbox_id}/ports", response_model=ExposedPort)
async def expose_port(sandbox_id: str, body: PortBody, request: Request) -> ExposedPort:
    host, port = await core(request).sandboxes.expose_port(sandbox_id, body.port,
                                                          who=who(request))
    return ExposedPort(host=host, port=port, address=f"{host}:{port}")


@router.put("/{sandbox_id}/network", response_model=SandboxRecord)
async def set_network(sandbox_id: str, body: NetworkBody, request: Request) -> SandboxRecord:
    sandboxes = core(request).sandboxes
    network = None
    given = body.model_dump(exclude_none=True, exclude={"internet"})
    if given:
        current = (await sandboxes.get(sandbox_id, who(request))).network or NetworkSpec()
        network = current.model_copy(update=given)
    return await sandboxes.set_network(sandbox_id, body.internet, network, who=who(request))
