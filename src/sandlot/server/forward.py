"""One API over every host: requests about a sandbox another host runs are forwarded to it.

`ForwardToOwner` (ASGI middleware) finds the sandbox a request is about (its path, or the
``E2b-Sandbox-Id`` header of envd calls; or the volume of an E2B volume content call), asks
the metadata store which host runs it, and when that is another live host streams the
request there and its answer back, bodies and NDJSON/Connect streams included, unbuffered.
A forwarded request carries
``X-Sandlot-Forwarded`` and is always served where it arrives, so nothing loops. `forward`
does the same for a request a route decided to place on another host (creates, restores).
Authentication is the owner's: keys live in the shared database.

`Peers` is also what core's placement (core/placement.py) asks the other hosts through: a
create or resume there, acting for the caller's tenant (the peer token vouches for it).
"""

from __future__ import annotations

import json
import logging
import re
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.core.hosts import HostInfo
from sandlot.core.models import CreateSandbox, SandboxRecord, SandboxState
from sandlot.core.tenancy import Principal
from sandlot.errors import CapacityError, HostUnavailableError, error_from_answer
from sandlot.server import ports
from sandlot.server.errors import error_body
from sandlot.server.relay import (
    FORKED_FROM,
    FORWARDED,
    HOP_BY_HOP,
    PRINCIPAL,
    forwarded,
    request_body,
    send_answer,
)

log = logging.getLogger(__name__)
PEER_SECRET = "peer-token"  # the name of the peer token (FORWARDED) in the database
SANDBOX_PATH = re.compile(r"^/(?:v1|e2b|e2b/v2)/sandboxes/(sb-[A-Za-z0-9_-]+)(?:/|$)")
ENVD_PATH = "/e2b/envd/"
VOLUME_PATH = re.compile(r"^/e2b/volumecontent/(vol-[0-9a-f]+)/")
SIGNED_FILE_PATHS = ("/files", "/e2b/envd/files")


def sandbox_of(scope: Scope) -> str | None:
    """The sandbox a request is about, if any (a port name's too: server/ports.py)."""
    target = ports.target_of(scope)
    if target is not None:
        return target[1]
    path = scope.get("path", "")
    m = SANDBOX_PATH.match(path)
    if m:
        return m.group(1)
    if path.startswith(ENVD_PATH):
        for name, value in scope.get("headers") or ():
            if name == b"e2b-sandbox-id":
                return value.decode("latin-1")
    return None


class Peers:
    """HTTP to the other hosts of the deployment: one client, streaming, no read timeout
    (a command's output may be silent for long; its keepalives come through)."""

    def __init__(self, host_id: str, token: str = "") -> None:
        self.host_id = host_id
        self.token = token  # what marks a request as one host's to another
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=10.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            # relayed answers (a sandbox's web app's) set cookies for their caller only
            cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])))

    async def close(self) -> None:
        await self.client.aclose()

    # ---- core's placement (core/placement.Peers) ------------------------------------------

    def _headers(self, who: Principal) -> dict[str, str]:
        return {FORWARDED: self.token, PRINCIPAL: who.tenant + ("; admin" if who.admin else "")}

    async def _call(self, host: HostInfo, path: str, body: str, who: Principal,
                    extra: dict[str, str] | None = None) -> SandboxRecord:
        headers = {"content-type": "application/json", **self._headers(who), **(extra or {})}
        try:
            r = await self.client.post(host.url.rstrip("/") + path, content=body,
                                       headers=headers)
        except httpx.HTTPError as e:  # placement tries the next host, as for no room
            raise CapacityError(f"host {host.id} did not answer: {e}") from None
        if r.status_code in (200, 201):
            return SandboxRecord.model_validate_json(r.content)
        error = error_from_answer(r.status_code, r.content)
        if isinstance(error, HostUnavailableError):  # tried the next host, as no room
            raise CapacityError(error.message)
        raise error

    async def create(self, host: HostInfo, req: CreateSandbox, who: Principal,
                     forked_from: str | None = None) -> SandboxRecord:
        return await self._call(host, "/v1/sandboxes", req.model_dump_json(exclude_none=True),
                                who, {FORKED_FROM: forked_from} if forked_from else None)

    async def resume(self, host: HostInfo, sandbox_id: str, timeout: int | None,
                     reboot: bool, who: Principal) -> SandboxRecord:
        body = json.dumps({"timeout": timeout, "reboot": reboot} if timeout is not None
                          else {"reboot": reboot})
        return await self._call(host, f"/v1/sandboxes/{sandbox_id}/resume", body, who)

    async def relay(self, scope: Scope, receive: Receive, send: Send, base_url: str,
                    body: bytes | None = None, fallback=None) -> None:
        """Send the request of `scope` to `base_url` and stream its answer to `send`;
        `body`: the request body when a route has read it already; `fallback`: what answers
        instead when the host cannot be reached at all."""
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        url = base_url.rstrip("/") + path.decode("latin-1") + (
            "?" + query.decode("latin-1") if query else "")
        headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() not in HOP_BY_HOP
                   or (k == b"host" and ports.target_of(scope) is not None)]  # routes it
        headers.append((FORWARDED.encode(), self.token.encode()))

        content = body if body is not None else request_body(receive)
        if body is not None:
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        request = self.client.build_request(scope["method"], url, headers=headers,
                                            content=content)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            log.warning("forwarding %s %s to %s failed: %s", scope["method"], scope["path"],
                        base_url, e)
            if fallback is not None and isinstance(e, httpx.ConnectError):
                await fallback()  # nothing was sent: answered here, from the records
                return
            await _answer(send, scope, 503, "HostUnavailableError",
                          f"the host that runs this sandbox ({base_url}) did not answer: {e}")
            return
        await send_answer(send, response, base_url)


async def _answer(send: Send, scope: Scope, status: int, kind: str, message: str) -> None:
    if scope.get("path", "").startswith("/e2b"):
        body = {"code": status, "message": message}
    else:
        body = error_body(kind, message)
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class ForwardToOwner:
    """ASGI middleware: a request about a sandbox that another live host runs goes there."""

    def __init__(self, app: ASGIApp, get_core) -> None:
        self.app = app
        self.get_core = get_core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # WebSockets about a sandbox: a port's, or a terminal's (routes_pty.py)
        websocket = scope["type"] == "websocket" and sandbox_of(scope) is not None
        core = self.get_core() if scope["type"] == "http" or websocket else None
        if core is None or not core.hosts.shared or forwarded(scope):
            await self.app(scope, receive, send)
            return
        volume = VOLUME_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if volume is not None:  # a volume's files: served by the host that holds them
            host = await core.volumes.locate(volume.group(1))
            url = await core.hosts.url_of(host) if host else None
            if url is not None:
                await scope["app"].state.peers.relay(scope, receive, send, url)
            else:
                await self.app(scope, receive, send)
            return
        sandbox_id = sandbox_of(scope)
        if sandbox_id is None and _signed_file_url(scope):
            host = await _signed_owner(scope, core)
            url = await core.hosts.url_of(host) if host else None
            if url is not None:
                await scope["app"].state.peers.relay(scope, receive, send, url)
                return
        where = await core.sandboxes.locate(sandbox_id) if sandbox_id else None
        # a paused sandbox runs nowhere: any host answers for it, and resumes it where
        # placement says
        host = where.host if where and where.state != SandboxState.PAUSED else None
        url = await core.hosts.url_of(host) if host else None
        if url is None:  # here, unknown, or its host is gone: answered here
            await self.app(scope, receive, send)
            return
        if websocket:  # relayed whole to the host that runs it (a terminal's key with it)
            if (await receive())["type"] == "websocket.connect":
                host, port, tls = ports.peer_address(url)
                token = scope["app"].state.peers.token
                await ports.relay_websocket(scope, receive, send, host, port,
                                            (FORWARDED.encode(), token.encode()), tls)
            return

        async def here() -> None:
            await self.app(scope, receive, send)

        # A read of a host that does not answer is served from the records (a sandbox of a
        # host about to be reported lost still shows, as it was last known).
        reads = scope["method"] in ("GET", "HEAD")
        await scope["app"].state.peers.relay(scope, receive, send, url,
                                             fallback=here if reads else None)


def _signed_file_url(scope: Scope) -> bool:
    """E2B's download_url()/upload_url(): /files naming no sandbox, only a signature."""
    return (scope.get("path") in SIGNED_FILE_PATHS and b"signature=" in
            (scope.get("query_string") or b""))


async def _signed_owner(scope: Scope, core) -> str | None:
    from urllib.parse import parse_qsl

    from sandlot.server.e2b.envd import signed_owner

    st = getattr(scope["app"].state, "e2b", None)
    if st is None:
        return None
    query = dict(parse_qsl((scope.get("query_string") or b"").decode("latin-1")))
    query["_method"] = scope["method"]
    return await signed_owner(core, st, query)


def peer_principal(scope: Scope) -> Principal | None:
    """Who a peer's call acts for (None: not a peer's call, or it names nobody)."""
    if not forwarded(scope):
        return None
    for k, v in scope.get("headers") or ():
        if k == PRINCIPAL.encode():
            tenant, _, flag = v.decode("latin-1").partition(";")
            return Principal(tenant.strip(), admin=flag.strip() == "admin")
    return None


def forwarded_from(scope: Scope) -> str | None:
    """The parent of a fork child another host asked this one to start."""
    if not forwarded(scope):
        return None
    for k, v in scope.get("headers") or ():
        if k == FORKED_FROM.encode():
            return v.decode("latin-1")
    return None


