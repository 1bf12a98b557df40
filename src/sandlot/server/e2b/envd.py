"""The in-sandbox endpoint: envd's API for every sandbox on one port, under ``/e2b/envd``.

The SDK (with ``E2B_SANDBOX_URL`` pointing here) names the sandbox in the ``E2b-Sandbox-Id``
header and authenticates with the sandbox's ``X-Access-Token`` (handed out by create and
connect); a sandlot API key in ``X-API-Key`` works too. Connect RPCs answer in Connect's error
shape, the plain endpoints in envd's ``{"code", "message"}``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sandlot.errors import AuthenticationError, InvalidArgumentError
from sandlot.server.deps import core
from sandlot.server.e2b import connect, files, filesystem, process
from sandlot.server.e2b.convert import DEFAULT_USER, check_user, user_of
from sandlot.server.e2b.errors import (
    Unsupported,
    api_error,
)
from sandlot.server.e2b.state import Envd, e2b_state

PREFIX = "/e2b/envd"
ENVD_PORT = "49983"
SERVICES = {
    "process.Process": (process.UNARY, process.SERVER_STREAM, process.CLIENT_STREAM),
    "filesystem.Filesystem": (filesystem.UNARY, filesystem.SERVER_STREAM, {}),
}

REQUESTS = {"process.Process": process.REQUESTS, "filesystem.Filesystem": filesystem.REQUESTS}

router = APIRouter(prefix=PREFIX, include_in_schema=False)
# The SDK's download_url()/upload_url() join "/files" to the sandbox URL as an absolute path,
# so signed file URLs arrive at the server root, naming no sandbox: the signature does.
signed_router = APIRouter(include_in_schema=False)


async def envd_call(request: Request) -> Envd:
    """Authenticate an in-sandbox request and find its sandbox, which must be running."""
    c, st = core(request), e2b_state(request)
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    if not sandbox_id:
        raise InvalidArgumentError("missing the E2b-Sandbox-Id header: point E2B_SANDBOX_URL "
                                   f"at {PREFIX} of a sandlot server")
    token = request.headers.get("x-access-token")
    if token:
        if not st.tokens.check(sandbox_id, token):
            raise AuthenticationError("invalid X-Access-Token for this sandbox")
        who = c.sandboxes.holder_of(sandbox_id)
    else:
        key = request.headers.get("x-api-key")
        if not key:
            raise AuthenticationError("missing X-Access-Token (or a sandlot key in X-API-Key)")
        who = await c.authenticate(key)
    port = request.headers.get("e2b-sandbox-port", ENVD_PORT)
    if port != ENVD_PORT:
        raise Unsupported(f"this endpoint serves envd (port {ENVD_PORT}) only; reach other "
                          "sandbox ports with sandlot's port forwarding")
    keepalive = request.headers.get("keepalive-ping-interval", "")
    ctx = Envd(core=c, state=st, who=who, sandbox_id=sandbox_id, user=user_of(request.headers),
               timeout=connect.timeout_s(request),
               keepalive=float(keepalive) if keepalive.isdigit() and int(keepalive) else None)
    ctx.check_running()
    return ctx


@router.post("/{service}/{method}")
async def rpc(service: str, method: str, request: Request) -> Response:
    where = f"{service}/{method}"
    unary, server_stream, client_stream = SERVICES.get(service, ({}, {}, {}))
    is_stream = request.headers.get("content-type", "").startswith(connect.STREAM_TYPE)
    schema = REQUESTS.get(service, {}).get(method, {})
    if method in unary:
        handler = unary[method]

        async def call(msg: dict) -> dict:
            return await handler(await envd_call(request), connect.check(msg, schema))

        return await connect.unary(request, call, where)
    try:
        if method in server_stream:
            ctx = await envd_call(request)
            msg = connect.check(await connect.read_single_envelope(request), schema)
            return connect.server_stream(server_stream[method](ctx, msg), where)
        if method in client_stream:
            ctx = await envd_call(request)
            messages = (connect.check(m, schema) async for m in connect.read_envelopes(request))
            reply = await client_stream[method](ctx, messages)
            return Response(connect.envelope(reply) + connect.end_stream(),
                            media_type=connect.STREAM_TYPE)
        raise Unsupported(f"sandlot's envd does not serve {service}/{method}")
    except Exception as e:  # noqa: BLE001 - answered as a Connect error
        if is_stream:
            return connect.stream_error(e, where)
        return connect.connect_unary_error(e, where)


def signed_call(request: Request, operation: str) -> Envd:
    """A file URL signed with a sandbox's access token (E2B's v1 signature): find the running
    sandbox whose token makes the signature."""
    c, st = core(request), e2b_state(request)
    q = request.query_params
    signature, expires = q.get("signature", ""), q.get("signature_expiration")
    # envd's own texts, in its order: the signature is checked before its expiry, so a
    # forger never learns whether the expiry was the problem.
    if not signature:
        raise AuthenticationError("missing signature")
    if expires is not None and not expires.isdigit():
        raise AuthenticationError("invalid signature_expiration")
    user = q.get("username") or ""
    for sandbox_id in c.sandboxes.running_here():
        if signs(st.tokens, sandbox_id, q, operation):
            if expires is not None and int(expires) < time.time():
                raise AuthenticationError("signature is already expired")
            return Envd(core=c, state=st, who=c.sandboxes.holder_of(sandbox_id),
                        sandbox_id=sandbox_id,
                        user=check_user(user) if user else DEFAULT_USER)
    raise AuthenticationError("invalid signature")


def signs(tokens, sandbox_id: str, query, operation: str) -> bool:
    """Whether the signature of a file URL's `query` is `sandbox_id`'s (E2B's v1)."""
    expires = query.get("signature_expiration")
    raw = (f"{query.get('path', '')}:{operation}:{query.get('username') or ''}:"
           f"{tokens.token(sandbox_id)}")
    if expires is not None:
        raw += f":{expires}"
    digest = base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=")
    return hmac.compare_digest(b"v1_" + digest, query.get("signature", "").encode())


async def signed_owner(c, st, query) -> str | None:
    """In a deployment: the host running the sandbox a signed file URL is for, if another."""
    operation = "write" if query.get("_method") == "POST" else "read"
    for sandbox_id, host in await c.sandboxes.running_elsewhere():
        if signs(st.tokens, sandbox_id, query, operation):
            return host
    return None


async def _plain(request: Request, handler: Callable[[Envd, Request], Awaitable[Response]],
                 signed: str | None = None) -> Response:
    try:
        if signed and "e2b-sandbox-id" not in request.headers:
            ctx = signed_call(request, signed)
        else:
            ctx = await envd_call(request)
        return await handler(ctx, request)
    except Exception as e:  # noqa: BLE001 - envd's plain error shape
        return api_error(e, request)


@router.get("/health")
async def health(request: Request) -> Response:
    return await _plain(request, files.health)


@router.get("/files")
async def download(request: Request) -> Response:
    return await _plain(request, files.download)


@router.post("/files")
async def upload(request: Request) -> Response:
    return await _plain(request, files.upload)


@signed_router.get("/files")
async def signed_download(request: Request) -> Response:
    return await _plain(request, files.download, signed="read")


@signed_router.post("/files")
async def signed_upload(request: Request) -> Response:
    return await _plain(request, files.upload, signed="write")


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def other(rest: str, request: Request) -> JSONResponse:
    return api_error(Unsupported(f"sandlot's envd does not serve {request.method} /{rest}; "
                                 "it serves the process and filesystem services, /files and "
                                 "/health"), request)
