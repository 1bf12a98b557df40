"""E2B's control-plane REST API (the paths the `e2b` SDK calls), under ``/e2b``.

Auth is sandlot's API key, which the SDK sends as ``X-API-KEY``. Every error is E2B's
``{"code", "message"}``; calls sandlot does not serve answer 501 saying what it offers instead.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from collections.abc import Callable
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandlot.core.models import (
    CreateSandbox,
    NetworkSpec,
    SandboxRecord,
    SandboxState,
    SnapshotState,
    VolumeMount,
)
from sandlot.errors import (
    AuthenticationError,
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
)
from sandlot.server import ports
from sandlot.server.auth import bearer_key, who
from sandlot.server.deps import core
from sandlot.server.e2b import convert
from sandlot.server.e2b.errors import Unsupported, WrongMethod, api_error
from sandlot.server.e2b.state import E2BState, e2b_state
from sandlot.server.errors import public_message
from sandlot.server.relay import forwarded

PREFIX = "/e2b"
MAX_PAGE = 100


class E2BRoute(APIRoute):
    """Answers every error of the route, request validation included, in E2B's shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001 - the one error boundary of the E2B API
                return api_error(e, request)

        return route


async def require_e2b_key(request: Request) -> None:
    try:  # the SDK sends X-API-KEY
        request.state.principal = await core(request).authenticate(bearer_key(request))
    except AuthenticationError:
        raise AuthenticationError("missing or invalid API key: set E2B_API_KEY to a sandlot "
                                  "API key (`sandlot keys create`)") from None


router = APIRouter(prefix=PREFIX, route_class=E2BRoute,
                   dependencies=[Depends(require_e2b_key)], include_in_schema=False)


class Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NewSandbox(Body):
    template_id: str = Field(alias="templateID", min_length=1)
    timeout: int | None = Field(None, ge=0)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    allow_internet_access: bool | None = None
    network: dict | None = None
    auto_pause: bool | None = Field(None, alias="autoPause")
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: dict | None = Field(None, alias="autoResume")
    mcp: dict | None = None
    iam: dict | None = None
    volume_mounts: list | None = Field(None, alias="volumeMounts")


class TimeoutBody(Body):
    timeout: int = Field(ge=0)


class RefreshBody(Body):
    duration: int | None = Field(None, ge=0)


class ConnectBody(Body):
    timeout: int | None = Field(None, ge=0)
    memory: bool | None = None


class PauseBody(Body):
    memory: bool | None = None


class ForkBody(Body):
    timeout: int | None = Field(None, ge=0)
    count: int | None = Field(None, ge=1, le=64)


class SnapshotBody(Body):
    name: str | None = None
    memory: bool | None = None


class NetworkUpdate(Body):
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_internet_access: bool | None = None
    dns_servers: list[str] | None = Field(None, alias="dnsServers")
    egress_proxy: dict | None = Field(None, alias="egressProxy")
    rules: dict | None = None


def _network(raw: dict | None) -> NetworkSpec | None:
    if not raw:
        return None
    extra = {k for k, v in raw.items()
             if v not in (None, [], {}) and k not in ("allowOut", "denyOut", "dnsServers",
                                                      "allowPublicTraffic")}
    if extra:
        raise Unsupported(f"sandlot's egress rules are allow_out/deny_out/dns_servers lists "
                          f"only; {', '.join(sorted(extra))} is not supported")
    return _spec(raw.get("allowOut"), raw.get("denyOut"), raw.get("dnsServers"))


def _spec(allow_out, deny_out, dns_servers) -> NetworkSpec:
    """E2B's egress lists as sandlot's (dns_servers None: not given)."""
    for name, value in (("allowOut", allow_out), ("denyOut", deny_out),
                        ("dnsServers", dns_servers)):
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, str) for v in value)):
            raise InvalidArgumentError(f"network.{name} is a list of strings")
    return NetworkSpec(allow_out=allow_out or [], deny_out=deny_out or [],
                       dns_servers=dns_servers)


def _check_create(body: NewSandbox) -> None:
    if body.mcp:
        raise Unsupported("sandlot has no MCP gateway template")
    if body.iam and body.iam.get("tokens"):
        raise Unsupported("sandlot has no workload identity (iam) tokens")


def _mounts(raw: list | None) -> list[VolumeMount]:
    """E2B's volumeMounts ([{name, path}]) as core's, mounted for E2B's default user."""
    mounts = []
    for m in raw or []:
        if not (isinstance(m, dict) and isinstance(m.get("name"), str)
                and isinstance(m.get("path"), str)):
            raise InvalidArgumentError("volumeMounts is a list of {name, path} strings")
        try:
            mounts.append(VolumeMount(volume=m["name"], path=m["path"],
                                      user=convert.DEFAULT_USER))
        except ValidationError:
            raise InvalidArgumentError(f"bad volume mount {str(m)[:200]}: a volume name and "
                                       f"an absolute path (like /mnt/data)") from None
    if len(mounts) > 16:
        raise InvalidArgumentError("at most 16 volume mounts")
    return mounts


def _created(st: E2BState, rec: SandboxRecord) -> dict:
    return convert.created(rec, st.tokens.token(rec.sandbox_id)) | ports.e2b_fields(
        st.lifecycle.core, st.tokens, rec)


def _answer(st: E2BState, rec: SandboxRecord, status: int) -> JSONResponse:
    return JSONResponse(_created(st, rec), status)


# ---- sandboxes ---------------------------------------------------------------------------


@router.post("/sandboxes")
@router.post("/v2/sandboxes")
async def create_sandbox(body: NewSandbox, request: Request) -> JSONResponse:
    c, st = core(request), e2b_state(request)
    _check_create(body)
    src = await st.lifecycle.source(body.template_id, who(request))
    req = CreateSandbox(template=src.template, snapshot_id=src.snapshot_id,
                        env=body.env_vars or {}, metadata=body.metadata or {},
                        timeout=body.timeout, internet=body.allow_internet_access is not False,
                        network=_network(body.network),
                        on_timeout="pause" if body.auto_pause else "kill",
                        pause_memory=body.auto_pause_memory is not False,
                        auto_resume=bool(body.auto_resume and body.auto_resume.get("enabled")),
                        public_traffic=(body.network or {}).get("allowPublicTraffic")
                        is not False, volume_mounts=_mounts(body.volume_mounts))
    rec = await c.placement.create(req, who(request), placed=forwarded(request.scope))
    return _answer(st, rec, 201)


def _metadata_query(raw: str | None) -> dict[str, str]:
    # The SDK sends urlencode({quote(k): quote(v)}) as one query parameter.
    if not raw:
        return {}
    return {urllib.parse.unquote(k): urllib.parse.unquote(v)
            for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True)}


def _cursor(at: datetime, ident: str, asc: bool) -> str:
    """E2B's page token: base64url of ``<RFC 3339 time>__<id>`` (``__asc`` when ascending)."""
    raw = f"{at.isoformat()}__{ident}" + ("__asc" if asc else "")
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _parse_cursor(token: str, asc: bool) -> tuple[datetime, str]:
    try:
        parts = base64.urlsafe_b64decode(token.encode()).decode().split("__")
        at = datetime.fromisoformat(parts[0])
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidArgumentError(f"invalid nextToken {token[:100]!r}") from None
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "asc"):
        raise InvalidArgumentError(f"invalid nextToken {token[:100]!r}")
    if (len(parts) == 3) != asc:
        raise InvalidArgumentError("nextToken was issued for the other sort order")
    return (at if at.tzinfo else at.replace(tzinfo=UTC)), parts[1]


def _page(items: list, key: Callable, limit: int | None, token: str | None,
          order: str | None = None) -> tuple[list, dict]:
    """E2B's keyset pagination: newest first unless `order` is 'asc', ties by id; the next
    token names the last item of the page. `key(item)` is (time, id)."""
    if order not in (None, "asc", "desc"):
        raise InvalidArgumentError(f"invalid order {order!r}: 'asc' or 'desc'")
    if limit is not None and limit < 1:
        raise InvalidArgumentError("limit must be at least 1")
    asc = order == "asc"
    size = min(limit or MAX_PAGE, MAX_PAGE)
    items = sorted(items, key=lambda i: key(i)[1])  # stable: ties by id ascending
    items.sort(key=lambda i: key(i)[0], reverse=not asc)
    if token:
        at, ident = _parse_cursor(token, asc)
        items = [i for i in items
                 if (key(i)[0] > at if asc else key(i)[0] < at)
                 or (key(i)[0] == at and key(i)[1] > ident)]
    page = items[:size]
    headers = {"x-next-token": _cursor(*key(page[-1]), asc)} if len(items) > size else {}
    return page, headers


@router.get("/sandboxes")
@router.get("/v2/sandboxes")
async def list_sandboxes(request: Request, metadata: str | None = None,
                         state: str | None = None, template: str | None = None,
                         order: str | None = None, limit: int | None = None) -> JSONResponse:
    st = e2b_state(request)
    q = request.query_params
    next_token = q.get("nextToken")
    started_after = q.get("startedAfter")
    wanted = _metadata_query(metadata)
    states = {s for part in (state or "").split(",") if (s := part.strip())}
    items = await st.lifecycle.listed(who(request))
    if wanted:
        items = [(r, s) for r, s in items if all(r.metadata.get(k) == v
                                                 for k, v in wanted.items())]
    if states:
        items = [(r, s) for r, s in items if s in states]
    if template:
        items = [(r, s) for r, s in items if template in (r.template, r.snapshot_id)]
    if started_after:
        try:
            after = datetime.fromisoformat(started_after)
        except ValueError:
            raise InvalidArgumentError(f"invalid startedAfter {started_after!r}") from None
        items = [(r, s) for r, s in items if r.created_at >= after]
    page, headers = _page(items, lambda rs: (rs[0].created_at, rs[0].sandbox_id), limit,
                          next_token, order)
    return JSONResponse([convert.listed(r, s, st.lifecycle.disk_mb(r)) for r, s in page],
                        headers=headers)


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, request: Request) -> JSONResponse:
    st = e2b_state(request)
    rec, state = await st.lifecycle.state_of(sandbox_id, who(request))
    return JSONResponse(convert.detail(rec, state, st.lifecycle.disk_mb(rec),
                                       st.tokens.token(sandbox_id))
                        | {"domain": core(request).settings.e2b_domain})


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(sandbox_id: str, request: Request, start: int | None = None,
                          end: int | None = None) -> JSONResponse:
    """E2B's metrics: the host's samples of the sandbox's CPU, memory and disk use."""
    c = core(request)
    c.sandboxes.running(sandbox_id, who(request))
    return JSONResponse([convert.metric(m) for m in c.usage.history(sandbox_id, start, end)])


LEVELS = ("debug", "info", "warn", "error")


async def _sandbox_log(request: Request, sandbox_id: str) -> list[dict]:
    """E2B's ``SandboxLogEntry`` list of what sandlot keeps of a sandbox (its record, and the
    snapshot its pause is kept in): how it started, its pause, why it failed; oldest first."""
    c, caller = core(request), who(request)
    rec = await c.sandboxes.get(sandbox_id, caller)
    fields = {"sandboxID": rec.sandbox_id, "templateID": convert.template_id(rec),
              "logger": "sandlot"}
    origin = (f"forked from sandbox {rec.forked_from}" if rec.forked_from else
              f"restored from snapshot {rec.snapshot_id}" if rec.snapshot_id else
              f"started from template {rec.template}")
    out = [(rec.created_at, "info", f"Sandbox {rec.sandbox_id} {origin} "
            f"({rec.cpus} vCPU, {rec.memory_mb} MiB)")]
    if rec.state == SandboxState.PAUSED and rec.paused_snapshot:
        try:
            snap = await c.snapshots.get(rec.paused_snapshot, caller)
            out.append((snap.created_at, "info", f"Sandbox {rec.sandbox_id} paused"))
        except NotFoundError:
            pass
    if rec.error:
        out.append((max(t for t, _, _ in out), "error", f"Sandbox {rec.sandbox_id} failed: "
                    f"{rec.error}"))
    return [{"timestamp": convert.rfc3339(t), "level": level, "message": message,
             "fields": fields} for t, level, message in out]


def _millis(entry: dict) -> int:
    return int(datetime.fromisoformat(entry["timestamp"]).timestamp() * 1000)


@router.get("/sandboxes/{sandbox_id}/logs")
async def sandbox_logs(sandbox_id: str, request: Request, start: int | None = None,
                       limit: int | None = None) -> JSONResponse:
    """E2B's v1 logs: the entries from `start` (ms since the epoch), at most `limit`."""
    if limit is not None and limit < 0:
        raise InvalidArgumentError("limit must be at least 0")
    entries = [e for e in await _sandbox_log(request, sandbox_id)
               if start is None or _millis(e) >= start][:1000 if limit is None else limit]
    return JSONResponse({"logs": [{"timestamp": e["timestamp"], "line": e["message"]}
                                  for e in entries], "logEntries": entries})


@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def sandbox_logs_v2(sandbox_id: str, request: Request, cursor: int | None = None,
                          limit: int | None = None, direction: str | None = None,
                          level: str | None = None, search: str | None = None
                          ) -> JSONResponse:
    """E2B's v2 logs: from `cursor` (ms since the epoch) `direction` forward (the default)
    or backward, at `level` or above, with `search` in the message."""
    check_window(direction, level, limit)
    entries = await _sandbox_log(request, sandbox_id)
    return JSONResponse({"logs": window(entries, cursor, direction, level, limit, 1000,
                                        search)})


def check_window(direction: str | None, level: str | None, limit: int | None) -> None:
    """E2B's log query parameters (v2 sandbox logs, build logs), or a 400."""
    if direction not in (None, "forward", "backward"):
        raise InvalidArgumentError(f"invalid direction {direction!r}: forward or backward")
    if level not in (None, *LEVELS):
        raise InvalidArgumentError(f"invalid level {level!r}: one of {', '.join(LEVELS)}")
    if limit is not None and limit < 0:
        raise InvalidArgumentError("limit must be at least 0")


def window(entries: list[dict], cursor: int | None, direction: str | None,
           level: str | None, limit: int | None, most: int,
           search: str | None = None) -> list[dict]:
    """Log entries (oldest first) from `cursor` (ms since the epoch) `direction` forward
    (the default) or backward, at `level` or above, with `search` in the message; at most
    `limit` (bounded by `most`)."""
    if direction == "backward":
        entries = [e for e in reversed(entries) if cursor is None or _millis(e) <= cursor]
    else:
        entries = [e for e in entries if cursor is None or _millis(e) >= cursor]
    if level:
        entries = [e for e in entries
                   if LEVELS.index(e["level"]) >= LEVELS.index(level)]
    if search:
        entries = [e for e in entries if search in e["message"]]
    return entries[:most if limit is None else min(limit, most)]


@router.delete("/sandboxes/{sandbox_id}")
async def kill_sandbox(sandbox_id: str, request: Request) -> Response:
    await e2b_state(request).lifecycle.kill(sandbox_id, who(request))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, body: TimeoutBody, request: Request) -> Response:
    await core(request).sandboxes.set_timeout(sandbox_id, body.timeout, who=who(request))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes")
async def refresh(sandbox_id: str, request: Request, body: RefreshBody | None = None
                  ) -> Response:
    await core(request).sandboxes.refresh(sandbox_id, (body.duration if body else None) or 60,
                                          who(request))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_sandbox(sandbox_id: str, request: Request, body: ConnectBody | None = None
                          ) -> JSONResponse:
    body = body or ConnectBody()
    st = e2b_state(request)
    # memory false (on_resume="reboot"): a paused sandbox boots from its disk
    rec, resumed = await st.lifecycle.connect(sandbox_id, body.timeout,
                                              reboot=body.memory is False, who=who(request))
    return _answer(st, rec, 201 if resumed else 200)


@router.post("/sandboxes/{sandbox_id}/resume")
async def resume_sandbox(sandbox_id: str, request: Request, body: ConnectBody | None = None
                         ) -> JSONResponse:
    st, caller = e2b_state(request), who(request)
    if core(request).sandboxes.is_running(sandbox_id, caller):
        raise ConflictError(f"sandbox {sandbox_id} is already running")
    rec, _ = await st.lifecycle.connect(sandbox_id, body.timeout if body else None,
                                        reboot=bool(body and body.memory is False), who=caller)
    return _answer(st, rec, 201)


@router.post("/sandboxes/{sandbox_id}/pause")
async def pause_sandbox(sandbox_id: str, request: Request, body: PauseBody | None = None
                        ) -> Response:
    # memory false (mode="filesystem"): the disk only; the resume boots from it
    await e2b_state(request).lifecycle.pause(sandbox_id,
                                             memory=not (body and body.memory is False),
                                             who=who(request))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork_sandbox(sandbox_id: str, request: Request, body: ForkBody | None = None
                       ) -> JSONResponse:
    c, st, caller = core(request), e2b_state(request), who(request)
    body = body or ForkBody()
    results = (await c.placement.fork(sandbox_id, body.count or 1, caller,
                                      timeout=body.timeout)).children
    out = []
    for r in results:
        if isinstance(r, SandboxRecord):
            out.append({"sandbox": _created(st, r)})
        else:
            out.append({"error": {"code": r.status, "message": public_message(r)}})
    return JSONResponse(out, 201)


@router.put("/sandboxes/{sandbox_id}/network")
async def update_network(sandbox_id: str, body: NetworkUpdate, request: Request) -> Response:
    if body.egress_proxy or body.rules:
        raise Unsupported("sandlot's egress rules are allow_out/deny_out/dns_servers lists "
                          "only; egress_proxy and rules are not supported")
    network = _spec(body.allow_out, body.deny_out, body.dns_servers)
    await core(request).sandboxes.set_network(sandbox_id, body.allow_internet_access, network,
                                              who=who(request))
    return Response(status_code=204)


# ---- snapshots ---------------------------------------------------------------------------


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def create_snapshot(sandbox_id: str, request: Request, body: SnapshotBody | None = None
                          ) -> JSONResponse:
    c, st = core(request), e2b_state(request)
    body = body or SnapshotBody()
    snap = await c.sandboxes.snapshot(sandbox_id, convert.snapshot_name(body.name)
                                      if body.name else None, memory=body.memory is not False,
                                      who=who(request))
    # The snapshot holds the state of this moment once captured; storing it goes on after.
    await st.lifecycle.wait_captured(snap.snapshot_id, who(request))
    return JSONResponse(convert.snapshot_info(snap.snapshot_id, snap.name), 201)


@router.get("/snapshots")
async def list_snapshots(request: Request, name: str | None = None,
                         limit: int | None = None) -> JSONResponse:
    c = core(request)
    q = request.query_params
    sandbox_id = q.get("sandboxID")
    snaps = [s for s in await c.snapshots.list(sandbox_id, who=who(request))
             if s.state != SnapshotState.FAILED]
    if name:
        snaps = [s for s in snaps if convert.name_matches(name, s.name, s.snapshot_id)]
    page, headers = _page(snaps, lambda s: (s.created_at, s.snapshot_id), limit,
                          q.get("nextToken"))
    return JSONResponse([convert.snapshot_info(s.snapshot_id, s.name) for s in page],
                        headers=headers)


@router.delete("/templates/{template_id:path}")
async def delete_template(template_id: str, request: Request) -> Response:
    c, caller = core(request), who(request)
    try:
        snap = await c.snapshots.get(template_id, caller)
    except NotFoundError as missing:
        if ":" in template_id:  # a template's id names no tag
            raise
        try:  # a template the caller built (another's that it may use: 403)
            await c.builds.delete(template_id, caller)
        except (NotFoundError, InvalidArgumentError):
            raise missing from None
        return Response(status_code=204)
    await c.snapshots.wait(snap.snapshot_id, 600, who=caller)
    await c.snapshots.delete(snap.snapshot_id, who=caller)
    return Response(status_code=204)


# ---- everything else ---------------------------------------------------------------------

UNSUPPORTED = (
    ("/templates", "sandlot serves template builds (Template.build, build_in_background, "
                   "get_build_status, exists), tags (assign_tags, remove_tags, get_tags), "
                   "listings (GET /templates, /templates/{id}), updates (public) and "
                   "delete"),
    ("/secrets", "sandlot has no secrets store; pass envs to Sandbox.create()"),
)
SUPPORTED = ("sandlot serves: create, connect, list, get_info, set_timeout, kill, pause, "
             "resume, fork, create_snapshot, list_snapshots, delete_snapshot, "
             "update_network (allow_out/deny_out/dns_servers), template builds and volumes "
             "(create, connect, list, get_info, destroy, volume_mounts, and their files: "
             "/volumecontent)")


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def unsupported(rest: str, request: Request) -> Response:
    path = "/" + rest
    for marker, message in UNSUPPORTED:
        if marker in path:
            raise Unsupported(message)
    allowed = sorted({m for route in router.routes if isinstance(route, APIRoute)
                      and "{rest" not in route.path and route.path_regex.match(PREFIX + path)
                      for m in route.methods})
    if allowed:
        raise WrongMethod(f"{request.method} is not allowed on {path}; use "
                          f"{' or '.join(allowed)}")
    raise Unsupported(f"sandlot does not serve {request.method} {path} of the E2B API; "
                      f"{SUPPORTED}")
