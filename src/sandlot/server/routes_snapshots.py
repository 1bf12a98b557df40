"""/v1/snapshots and /v1/templates."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from sandlot.core.models import (
    CreateSandbox,
    SandboxOverrides,
    SandboxRecord,
    SnapshotRecord,
    TemplateInfo,
)
from sandlot.server.auth import who
from sandlot.server.deps import core
from sandlot.server.metrics import timed
from sandlot.server.relay import forwarded
from sandlot.server.routes_sandboxes import ForkResult, fork_result

router = APIRouter(tags=["snapshots"])


class SnapshotList(BaseModel):
    snapshots: list[SnapshotRecord]


class TemplateList(BaseModel):
    templates: list[TemplateInfo]


class RenameBody(BaseModel):
    name: str | None


class RestoreBody(SandboxOverrides):
    name: str | None = None


@router.get("/v1/snapshots", response_model=SnapshotList)
async def list_snapshots(request: Request, sandbox_id: str | None = None) -> SnapshotList:
    return SnapshotList(snapshots=await core(request).snapshots.list(
        sandbox_id, who=who(request)))


@router.get("/v1/snapshots/{id_or_name}", response_model=SnapshotRecord)
async def get_snapshot(id_or_name: str, request: Request) -> SnapshotRecord:
    return await core(request).snapshots.get(id_or_name, who(request), include_deleted=True)


@router.patch("/v1/snapshots/{id_or_name}", response_model=SnapshotRecord)
async def rename_snapshot(id_or_name: str, body: RenameBody, request: Request) -> SnapshotRecord:
    return await core(request).snapshots.rename(id_or_name, body.name, who=who(request))


@router.post("/v1/snapshots/{id_or_name}/wait", response_model=SnapshotRecord)
async def wait_snapshot(id_or_name: str, request: Request,
                        timeout: float = Query(30.0, ge=0, le=300)) -> SnapshotRecord:
    """The snapshot once it is ready, failed or deleted, or as it is after `timeout` s."""
    return await core(request).snapshots.wait(id_or_name, timeout, who=who(request))


@router.delete("/v1/snapshots/{id_or_name}", status_code=204)
async def delete_snapshot(id_or_name: str, request: Request) -> Response:
    await core(request).snapshots.delete(id_or_name, who=who(request))
    return Response(status_code=204)


@router.post("/v1/snapshots/{id_or_name}/restore", status_code=201, response_model=SandboxRecord)
async def restore_snapshot(id_or_name: str, request: Request,
                           body: RestoreBody | None = None) -> SandboxRecord:
    body = body or RestoreBody()
    metadata = dict(body.metadata or {})
    if body.name:
        metadata.setdefault("name", body.name)
    req = CreateSandbox(snapshot_id=id_or_name,
                        **body.model_dump(exclude={"name", "metadata"}), metadata=metadata)
    with timed(request, "restore"):
        return await core(request).placement.create(req, who(request),
                                                    placed=forwarded(request.scope))


class SnapshotForkBody(SandboxOverrides):
    count: int = Field(1, ge=1, le=64)


@router.post("/v1/snapshots/{id_or_name}/fork", response_model=ForkResult)
async def fork_snapshot(id_or_name: str, request: Request,
                        body: SnapshotForkBody | None = None) -> ForkResult:
    """`count` independent sandboxes from a ready snapshot, no running parent needed, on the
    hosts with room (each with the overrides given); each succeeds or fails alone."""
    body = body or SnapshotForkBody()
    overrides = SandboxOverrides(**body.model_dump(exclude={"count"}, exclude_unset=True))
    with timed(request, "fork"):
        forked = await core(request).placement.fork_snapshot(id_or_name, body.count,
                                                             who(request), overrides)
    return fork_result(forked)


@router.get("/v1/templates", response_model=TemplateList)
async def list_templates(request: Request) -> TemplateList:
    return TemplateList(templates=await core(request).templates.listing(who(request)))


@router.get("/v1/templates/{name}", response_model=TemplateInfo)
async def get_template(name: str, request: Request) -> TemplateInfo:
    return await core(request).templates.info(name, who(request))
