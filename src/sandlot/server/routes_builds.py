"""/v1/templates/{name}/builds: a template built from a Dockerfile and its build context by
sandlot's builder (core/builds.py, images/dockersteps.py), as the caller's tenant."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from sandlot.core.builds import Build, TemplateBuilds
from sandlot.errors import InvalidArgumentError
from sandlot.server.auth import who
from sandlot.server.deps import core

router = APIRouter(tags=["templates"])
MAX_LOG_PAGE = 1000


class DockerfileBuild(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dockerfile: str = Field(description="the Dockerfile's text (one stage)")
    context: str | None = Field(None, description="the build context: a tar (gzipped or "
                                "not), base64")
    cpus: int | None = None
    memory_mb: int | None = None


class BuildLog(BaseModel):
    at: datetime
    level: str
    message: str


class BuildStatus(BaseModel):
    build_id: str
    name: str
    status: str = Field(description="waiting, building, ready or error")
    reason: str | None = None
    step: str | None = None
    error: str | None = Field(None, description="the error's type (BuildStepError: a step "
                              "failed, the reason ends with its output)")
    logs: list[BuildLog]
    logs_offset: int = Field(description="the index of the first of `logs`")


async def _status(builds: TemplateBuilds, build: Build, offset: int) -> BuildStatus:
    logs = await builds.logs(build, offset, MAX_LOG_PAGE)
    return BuildStatus(build_id=build.build_id, name=build.name, status=build.status,
                       reason=build.reason, step=build.reason_step,
                       error=build.error, logs_offset=offset,
                       logs=[BuildLog(at=x.at, level=x.level, message=x.message)
                             for x in logs])


@router.post("/v1/templates/{name}/builds", response_model=BuildStatus, status_code=202)
async def build_template(name: str, body: DockerfileBuild, request: Request) -> BuildStatus:
    """Start building template `name` from a Dockerfile; poll its status."""
    context = None
    if body.context:
        try:
            context = base64.b64decode(body.context, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgumentError("context must be base64 (of a tar)") from None
    builds = core(request).builds
    build = await builds.build_dockerfile(
        name, body.dockerfile, context, body.cpus, body.memory_mb, who(request))
    return await _status(builds, build, 0)


@router.get("/v1/templates/{name}/builds/{build_id}", response_model=BuildStatus)
async def template_build(name: str, build_id: str, request: Request,
                         logs_offset: int = Query(0, ge=0)) -> BuildStatus:
    """A build's status, its logs from `logs_offset`, and why it failed."""
    builds = core(request).builds
    return await _status(builds, await builds.get(name, build_id, who(request)), logs_offset)
