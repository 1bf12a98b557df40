"""E2B's template build API (the SDKs' `Template.build`, `build_in_background`,
`get_build_status`, `exists`), on sandlot's builder (core/builds.py). The template id E2B
hands back is the template's name: `Sandbox.create(name)` starts from it.

    POST /v3/templates                                   a build of a name (202)
    GET  /templates/{id}/files/{hash}                    an upload link for a COPY's files
    PUT  /template-uploads/{token}                       the upload itself (no key: the link)
    POST /v2/templates/{id}/builds/{build}               start it with the steps (202)
    GET  /templates/{id}/builds/{build}/status           status, logs from logsOffset
    GET  /templates/{id}/builds/{build}/logs             logs from a time (cursor)
    GET  /templates, /v2/templates                       the templates the key may use
    GET  /templates/{id}                                 one, with its builds
    GET  /templates/aliases/{alias}                      exists (403: another team's)
    GET  /templates/{id}/tags                            a template's tags and their builds
    POST /templates/tags                                 tags pointed at a build (201)
    PATCH /templates/{id}, /v2/templates/{id}            made public or private (its owner)
    DELETE /templates/tags                               tags removed (204)
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field, StrictBool

from sandlot.core.builds import MAX_LOG_LINES, Build, BuildSpec, RegistryLogin, TemplateBuilds
from sandlot.core.models import TemplateInfo, now
from sandlot.core.templates import DEFAULT_TAG
from sandlot.errors import InvalidArgumentError, NotFoundError
from sandlot.images import ecr, steps
from sandlot.images.spec import IMAGE_TEMPLATE_PREFIX
from sandlot.server.auth import who
from sandlot.server.deps import core
from sandlot.server.e2b.api import (
    PREFIX,
    Body,
    E2BRoute,
    _page,
    check_window,
    require_e2b_key,
    window,
)
from sandlot.server.e2b.convert import ENVD_VERSION, rfc3339

router = APIRouter(prefix=PREFIX, route_class=E2BRoute,
                   dependencies=[Depends(require_e2b_key)], include_in_schema=False)
upload_router = APIRouter(prefix=PREFIX, route_class=E2BRoute, include_in_schema=False)
MAX_LOG_PAGE = 100
MAX_LOGIN = 4096  # a registry token (a JWT) is long, but not longer
MAX_KEY_FILE = 16384  # a GCP service account's JSON key (~2.3 KB; 4096-bit RSA ~3.3 KB)
GCP_USER = "_json_key"  # Artifact Registry's and GCR's login with a JSON key


class BuildRequest(Body):
    name: str | None = None
    alias: str | None = None
    tags: list[str] | None = None
    cpu_count: int | None = Field(None, alias="cpuCount")
    memory_mb: int | None = Field(None, alias="memoryMB")
    min_free_disk_mb: int | None = Field(None, alias="minFreeDiskMb")


class TagsAssign(Body):
    target: str = Field(max_length=200)
    tags: list[str] = Field(max_length=100)


class TemplateUpdate(Body):
    public: StrictBool | None = None  # None: unchanged


class TagsRemove(Body):
    name: str = Field(max_length=200)
    tags: list[str] = Field(max_length=100)


class BuildStart(Body):
    from_image: str | None = Field(None, alias="fromImage")
    from_template: str | None = Field(None, alias="fromTemplate")
    from_image_registry: dict | None = Field(None, alias="fromImageRegistry")
    force: bool | None = None
    steps: list = Field(default_factory=list)
    start_cmd: str | None = Field(None, alias="startCmd")
    ready_cmd: str | None = Field(None, alias="readyCmd")


E2B_BASE = ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base",
            "docker.io/e2bdev/base:latest")


def _spec(body: BuildStart) -> BuildSpec:
    template = body.from_template
    image = body.from_image
    if not template and image in E2B_BASE:
        template, image = "base", None  # E2B's base image: sandlot's default template
    if not template and not image:
        raise InvalidArgumentError("fromImage or fromTemplate is required")
    return BuildSpec(image=image, template=template, steps=steps.parse_steps(body.steps),
                     force=bool(body.force) or any(isinstance(s, dict) and s.get("force")
                                                   for s in body.steps),
                     start_cmd=body.start_cmd,
                     ready_cmd=body.ready_cmd,
                     login=_login(body.from_image_registry) if image else None)


def _login(registry: dict | None) -> RegistryLogin | ecr.Keys | None:
    """E2B's ``fromImageRegistry``, for this build's pull only: a registry's username and
    password; GCP's service account key (Artifact Registry's and GCR's login ``_json_key``
    with the key file as password); AWS's access key, which the build turns into an ECR
    login (images/ecr.py)."""
    if not registry:
        return None
    kind = registry.get("type") or "registry"
    if kind == "aws":
        return ecr.parse_keys(registry.get("awsAccessKeyId"),
                              registry.get("awsSecretAccessKey"), registry.get("awsRegion"))
    if kind == "gcp":
        return RegistryLogin(GCP_USER, _service_account(registry.get("serviceAccountJson")))
    if kind != "registry":
        raise InvalidArgumentError(f"unknown fromImageRegistry type {str(kind)[:32]!r}: "
                                   "registry, aws or gcp")
    user, password = registry.get("username"), registry.get("password")
    if not (isinstance(user, str) and isinstance(password, str) and user and password):
        raise InvalidArgumentError("fromImageRegistry needs a username and a password")
    if len(user) > MAX_LOGIN or len(password) > MAX_LOGIN or ":" in user:
        raise InvalidArgumentError(f"fromImageRegistry: a username without ':' and a "
                                   f"password, each at most {MAX_LOGIN} characters")
    return RegistryLogin(user, password)


def _service_account(text: object) -> str:
    """A GCP service account key file's JSON (``serviceAccountJson``), checked: the password
    of the ``_json_key`` login, as given (a trailing newline dropped, as `docker login`
    does)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError("fromImageRegistry (gcp) needs serviceAccountJson, a "
                                   "service account's JSON key")
    if len(text) > MAX_KEY_FILE:
        raise InvalidArgumentError(f"fromImageRegistry (gcp): serviceAccountJson is over "
                                   f"{MAX_KEY_FILE} characters; a JSON key is about 2.3 KB")
    try:
        key = json.loads(text)
    except ValueError:
        raise InvalidArgumentError("fromImageRegistry (gcp): serviceAccountJson is not "
                                   "JSON") from None
    if not (isinstance(key, dict) and key.get("type") == "service_account"
            and all(isinstance(key.get(f), str) and key[f]
                    for f in ("client_email", "private_key"))):
        raise InvalidArgumentError("fromImageRegistry (gcp): serviceAccountJson is not a "
                                   "service account's JSON key (type \"service_account\", "
                                   "with client_email and private_key)")
    return text.rstrip("\r\n")


def _build_id(info: TemplateInfo) -> str:
    """The build a template's tag names, as E2B's UUID (a template built before builds were
    recorded in it: one made of its snapshot)."""
    return info.build_id or str(uuid.uuid5(uuid.NAMESPACE_URL, f"sandlot:{info.name}:"
                                           f"{info.snapshot_id or info.hash}"))


def _entry(line) -> dict:
    return {"timestamp": line.at.isoformat(), "level": line.level, "message": line.message}


@router.post("/v3/templates")
async def request_build(body: BuildRequest, request: Request) -> JSONResponse:
    name = body.name or body.alias
    if not name:
        raise InvalidArgumentError("name is required")
    build = await core(request).builds.request(name, body.tags, body.cpu_count, body.memory_mb,
                                         body.min_free_disk_mb, who(request))
    return JSONResponse({"templateID": build.name, "buildID": build.build_id,
                         "public": False, "names": [build.name], "aliases": [build.name],
                         "tags": build.tags}, 202)


@router.get("/templates/aliases/{alias}")
async def alias_exists(alias: str, request: Request) -> JSONResponse:
    info = await core(request).builds.lookup(alias, who(request))
    return JSONResponse({"templateID": info.name, "public": _public(info)})


def _public(info: TemplateInfo | None) -> bool:
    """E2B's ``public``: every key may use it (the operator's, or made public by its owner)."""
    return bool(info and (info.owner is None or info.public))


@router.patch("/templates/{template_id}")
async def update_template(template_id: str, body: TemplateUpdate,
                          request: Request) -> Response:
    """E2B's template update: its owner makes it public or private."""
    await core(request).builds.set_public(template_id, body.public, who(request))
    return Response(status_code=200)


@router.patch("/v2/templates/{template_id}")
async def update_template_v2(template_id: str, body: TemplateUpdate,
                             request: Request) -> JSONResponse:
    info = await core(request).builds.set_public(template_id, body.public, who(request))
    return JSONResponse({"names": [info.name]})


@router.get("/templates/{template_id}/files/{files_hash}")
async def upload_link(template_id: str, files_hash: str, request: Request) -> JSONResponse:
    present, token = core(request).builds.upload_link(template_id, files_hash, who(request))
    url = str(request.base_url).rstrip("/") + f"{PREFIX}/template-uploads/{token}"
    return JSONResponse({"present": present, "url": url}, 201)


@upload_router.put("/template-uploads/{token}")
async def upload(token: str, request: Request) -> Response:
    await core(request).builds.upload(token, request.stream())
    return Response(status_code=200)


@router.post("/v2/templates/{template_id}/builds/{build_id}")
async def start_build(template_id: str, build_id: str, body: BuildStart,
                      request: Request) -> Response:
    await core(request).builds.start(template_id, build_id, _spec(body), who(request))
    return Response(status_code=202)


async def _window(builds: TemplateBuilds, build: Build, offset: int | None,
                  limit: int | None) -> list:
    if (offset or 0) < 0 or (limit is not None and limit < 0):
        raise InvalidArgumentError("logsOffset and limit are at least 0")
    return await builds.logs(build, offset or 0, min(limit or MAX_LOG_PAGE, MAX_LOG_PAGE))


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(template_id: str, build_id: str, request: Request,
                       logsOffset: int | None = None,  # noqa: N803 - E2B's name
                       limit: int | None = None) -> JSONResponse:
    builds = core(request).builds
    build = await builds.get(template_id, build_id, who(request))
    window = await _window(builds, build, logsOffset, limit)
    out = {"templateID": build.name, "buildID": build.build_id, "status": build.status,
           "logEntries": [_entry(e) for e in window],
           "logs": [f"[{e.at.isoformat()}] {e.message}" for e in window]}
    if build.status == "error":
        out["reason"] = {"message": build.reason or "build failed",
                         "logEntries": [_entry(e) for e in await builds.tail(build, 20)]}
        if build.reason_step:
            out["reason"]["step"] = build.reason_step
    return JSONResponse(out)



@router.get("/templates/{template_id}/builds/{build_id}/logs")
async def build_logs(template_id: str, build_id: str, request: Request,
                     cursor: int | None = None, limit: int | None = None,
                     direction: str | None = None, level: str | None = None) -> JSONResponse:
    """E2B's build logs: from `cursor` (ms since the epoch), forward or backward."""
    check_window(direction, level, limit)
    builds = core(request).builds
    build = await builds.get(template_id, build_id, who(request))
    entries = [_entry(e) for e in await builds.logs(build, 0, MAX_LOG_LINES)]
    return JSONResponse({"logs": window(entries, cursor, direction, level, limit,
                                        MAX_LOG_PAGE)})


@router.get("/templates/{template_id}/tags")
async def list_tags(template_id: str, request: Request) -> JSONResponse:
    tagged = await core(request).builds.tags(template_id, who(request))
    return JSONResponse([{"tag": tag, "buildID": _build_id(info),
                          "createdAt": (info.built_at or now()).isoformat()}
                         for tag, info in tagged.items()])


@router.post("/templates/tags")
async def assign_tags(body: TagsAssign, request: Request) -> JSONResponse:
    info = await core(request).builds.assign_tags(body.target, body.tags, who(request))
    return JSONResponse({"tags": list(dict.fromkeys(body.tags)), "buildID": _build_id(info)},
                        201)


@router.delete("/templates/tags")
async def remove_tags(body: TagsRemove, request: Request) -> Response:
    await core(request).builds.remove_tags(body.name, body.tags, who(request))
    return Response(status_code=204)


# ---- listings ---------------------------------------------------------------------------


def _template(name: str, info: TemplateInfo | None, builds: list[Build],
              disk_mb: int) -> dict:
    """E2B's ``Template``: a template `info` (None: one whose first build has not finished,
    described by its latest build) and its builds (oldest first)."""
    last = builds[-1] if builds else None
    made = (info.built_at if info else None) or (last.created_at if last else now())
    first = builds[0].created_at if builds else made
    return {"templateID": name, "buildID": _build_id(info) if info else last.build_id,
            "cpuCount": info.cpus if info else last.cpus,
            "memoryMB": info.memory_mb if info else last.memory_mb,
            "diskSizeMB": disk_mb, "public": _public(info),
            "aliases": [name], "names": [name], "createdAt": rfc3339(min(first, made)),
            "updatedAt": rfc3339(made), "createdBy": None, "lastSpawnedAt": None,
            "spawnCount": 0, "buildCount": max(len(builds), 1), "envdVersion": ENVD_VERSION,
            "buildStatus": "ready" if info else last.status}


def _build(build: Build, info: TemplateInfo | None, disk_mb: int) -> dict:
    """E2B's ``TemplateBuild``."""
    done = info.built_at if info is not None and info.built_at else None
    out = {"buildID": build.build_id, "status": build.status,
           "createdAt": rfc3339(build.created_at), "updatedAt": rfc3339(done or build.created_at),
           "cpuCount": build.cpus, "memoryMB": build.memory_mb, "diskSizeMB": disk_mb,
           "envdVersion": ENVD_VERSION}
    if done is not None:
        out["finishedAt"] = rfc3339(done)
    return out


async def _templates(request: Request) -> list[tuple[dict, datetime]]:
    c, caller = core(request), who(request)
    disk_mb = c.settings.disk_quota_mb
    builds: dict[str, list[Build]] = {}
    for b in await c.builds.history(caller):
        builds.setdefault(b.name, []).append(b)
    out = []
    for info in await c.templates.listing(caller):
        if info.name.startswith(IMAGE_TEMPLATE_PREFIX):
            continue  # sandlot's own: the templates of images creates and builds pulled
        out.append(_template(info.name, info, builds.pop(info.name, []), disk_mb))
    for name, of_name in builds.items():  # builds of names not (yet, or no longer) built
        if of_name[-1].status != "ready":
            out.append(_template(name, None, of_name, disk_mb))
    return [(t, datetime.fromisoformat(t["createdAt"])) for t in out]


@router.get("/templates")
async def list_templates(request: Request) -> JSONResponse:
    """The templates the key may use: the operator's (public) and its tenant's own."""
    return JSONResponse([t for t, _ in await _templates(request)])


@router.get("/v2/templates")
async def list_templates_v2(request: Request, limit: int | None = None) -> JSONResponse:
    page, headers = _page(await _templates(request), lambda ta: (ta[1], ta[0]["templateID"]),
                          limit, request.query_params.get("nextToken"))
    return JSONResponse([t for t, _ in page], headers=headers)


@router.get("/templates/{template_id}")
async def get_template(template_id: str, request: Request,
                       limit: int | None = None) -> JSONResponse:
    """E2B's ``TemplateWithBuilds``: the template and its builds, newest first."""
    c, caller = core(request), who(request)
    disk_mb = c.settings.disk_quota_mb
    name = template_id.partition(":")[0]
    try:
        tagged = await c.builds.tags(name, caller)
    except NotFoundError:
        tagged = {}
    builds = await c.builds.history(caller, name)
    if not tagged and not builds:
        raise NotFoundError(f"template {name[:64]!r} not found")
    by_id = {_build_id(i): i for i in tagged.values()}
    rows = [(_build(b, by_id.pop(b.build_id, None), disk_mb), b.created_at, b.build_id)
            for b in builds]
    for build_id, info in by_id.items():  # builds without a record (the operator's)
        made = info.built_at or now()
        rows.append(({"buildID": build_id, "status": "ready", "createdAt": rfc3339(made),
                      "updatedAt": rfc3339(made), "finishedAt": rfc3339(made),
                      "cpuCount": info.cpus, "memoryMB": info.memory_mb,
                      "diskSizeMB": disk_mb, "envdVersion": ENVD_VERSION}, made, build_id))
    page, headers = _page(rows, lambda r: (r[1], r[2]), limit,
                          request.query_params.get("nextToken"))
    head = _template(name, tagged.get(DEFAULT_TAG) or next(iter(tagged.values()), None),
                     builds, disk_mb)
    return JSONResponse(head | {"builds": [r[0] for r in page]}, headers=headers)
