"""Port URLs: ``<port>-<sandbox id>.<domain>`` reaches that port inside the sandbox.

E2B's SDKs name a sandbox's port by `get_host(port)`: ``<port>-<sandboxID>.<domain>``.
`PortRoutes` (ASGI middleware, before the API routes) answers every request whose Host is
such a name under the configured domain (SANDLOT_E2B_DOMAIN, `Settings.e2b_domain`), on the
server's own port: HTTP, streamed both ways (httpx), and WebSocket upgrades (uvicorn's
websockets on this side, the `websockets` client towards the sandbox). The sandbox's port is
reached through the host listener core keeps for it (`SandboxManager.expose_port`).

A sandbox created with ``allow_public_traffic=False`` answers only requests that carry its
traffic access token in ``e2b-traffic-access-token`` (403 otherwise, as E2B); the token is not
passed on to the sandbox. Traffic wakes a paused sandbox made with auto-resume. The caller
acts for the sandbox's tenant: the name itself (public traffic) or the token is a credential
of that one sandbox. ``49983-<id>.<domain>`` is envd's port, served by the E2B envd routes,
and ``api.<domain>`` is the E2B control plane, so an SDK given only ``E2B_DOMAIN`` works.
On a deployment of several hosts, `ForwardToOwner` sends a port request on to the host that
runs the sandbox (`forward.sandbox_of` knows these names; WebSockets go by `relay_websocket`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from urllib.parse import urlsplit

import httpx
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.core.models import SandboxState
from sandlot.core.tenancy import SYSTEM, tenant_of
from sandlot.errors import NotFoundError, SandlotError
from sandlot.server import relay

log = logging.getLogger(__name__)
TOKEN_HEADER = b"e2b-traffic-access-token"  # E2B's name for it
ENVD_PORT = 49983  # the port E2B's SDKs reach envd on
NAME = re.compile(r"^(\d{1,5})-(sb-[a-z0-9_-]+)$")
# headers of one connection (and of the WebSocket handshake), not of the message
HOP_BY_HOP = relay.HOP_BY_HOP | {TOKEN_HEADER}  # the token is the server's, not the app's
WS_HANDSHAKE = {b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
                b"sec-websocket-protocol", b"sec-websocket-accept"}
WS_MAX_MESSAGE = 16 << 20  # as uvicorn's own limit on the client's side
# sandlot's own paths, left alone on api.<domain> (a server may be reached by that name)
OWN_PATHS = ("/e2b/", "/v1/", "/health", "/metrics", "/openapi.json", "/docs", "/redoc",
             "/files")
TIMEOUTS = {"connect": 10.0, "read": None, "write": None, "pool": 30.0}


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k == name:
            return v
    return None


def _domain(scope: Scope) -> str | None:
    app = scope.get("app")
    core = getattr(getattr(app, "state", None), "core", None)
    return core.settings.e2b_domain if core is not None else None


def host_name(scope: Scope) -> str:
    """The request's Host, lowercased, without its port."""
    host = (_header(scope, b"host") or b"").decode("latin-1").lower()
    return host.rpartition(":")[0] if ":" in host else host


def _name(scope: Scope) -> tuple[str, str] | None:
    """(label, domain) of a request to ``<label>.<domain>``, else None."""
    if scope.get("type") not in ("http", "websocket"):
        return None
    domain = _domain(scope)
    name = host_name(scope).rstrip(".")
    if not domain or not name.endswith("." + domain):
        return None
    return name[:-len(domain) - 1], domain


def target_of(scope: Scope) -> tuple[int, str] | None:
    """(port, sandbox id) of a request to ``<port>-<sandbox id>.<domain>``, else None
    (envd's port too: `E2BNames` made that an envd call)."""
    label = (_name(scope) or ("", ""))[0]
    m = NAME.match(label)
    if m is None or int(m.group(1)) == ENVD_PORT:
        return None
    return int(m.group(1)), m.group(2)


class E2BNames:
    """ASGI middleware, outermost: ``api.<domain>`` is E2B's control plane (``/e2b``) and
    ``49983-<id>.<domain>`` the sandbox's envd (``/e2b/envd``, naming the sandbox), E2B's
    default URLs when an SDK is given only ``E2B_DOMAIN``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = _name(scope) if scope["type"] == "http" else None
        if name is not None:
            m = NAME.match(name[0])
            if name[0] == "api" and not scope["path"].startswith(OWN_PATHS):
                scope = _rewritten(scope, "/e2b")
            elif m is not None and int(m.group(1)) == ENVD_PORT:
                scope = _rewritten(scope, "/e2b/envd", m.group(2))
        await self.app(scope, receive, send)


def e2b_fields(core, tokens, rec) -> dict:
    """What E2B's create, connect and fork answers say of port URLs: the domain the SDK
    builds `get_host` names under, and the traffic access token when traffic is not public."""
    return {"domain": core.settings.e2b_domain,
            "trafficAccessToken": None if rec.public_traffic else tokens.traffic(rec.sandbox_id)}


def new_transport() -> httpx.AsyncHTTPTransport:
    """HTTP to sandboxes' ports: a transport, not a client (no cookie jar shared between
    callers, no redirects followed, no headers of its own)."""
    return httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))


class PortError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class ResumedElsewhere(Exception):
    """A use resumed the sandbox on another host (`host`), where placement put it."""

    def __init__(self, host: str) -> None:
        super().__init__(host)
        self.host = host


class PortRoutes:
    """ASGI middleware: requests to port names go to the sandbox; the rest to `app`."""

    def __init__(self, app: ASGIApp, get_core) -> None:
        self.app = app
        self.get_core = get_core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = target_of(scope)
        if target is None:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = target
        if scope["type"] == "websocket" and (await receive())["type"] != "websocket.connect":
            return
        try:
            host, host_port = await self._reach(scope, sandbox_id, port)
        except PortError as e:
            await deny(scope, send, e.status, e.message, sandbox_id)
            return
        except ResumedElsewhere as e:  # placement resumed it on another host: on to there
            if not await relay_to_host(scope, receive, send, self.get_core(), e.host):
                await deny(scope, send, 503, f"sandbox {sandbox_id} was resumed on host "
                                             f"{e.host}, which does not answer", sandbox_id)
            return
        if scope["type"] == "websocket":
            await relay_websocket(scope, receive, send, host, host_port)
        else:
            await self._relay_http(scope, receive, send, f"http://{host}:{host_port}", port,
                                   sandbox_id)

    async def _reach(self, scope: Scope, sandbox_id: str, port: int) -> tuple[str, int]:
        """The host address of the sandbox's `port`, once the caller is let in: the token
        checked, the sandbox woken if it auto-resumes."""
        core = self.get_core()
        if core is None:
            raise PortError(503, "the server is starting")
        if not 1 <= port <= 65535:
            raise PortError(400, f"port {port} is not between 1 and 65535")
        try:
            rec = await core.sandboxes.get(sandbox_id, SYSTEM)
        except NotFoundError:
            raise PortError(404, f"sandbox {sandbox_id} not found") from None
        if not rec.public_traffic:
            token = _header(scope, TOKEN_HEADER)
            if token is None:
                raise PortError(403, "Sandbox is secured with traffic access token. Token "
                                     "header 'e2b-traffic-access-token' is missing")
            expected = _tokens(scope).traffic(sandbox_id).encode()
            if not hmac.compare_digest(expected, token):
                raise PortError(403, "the traffic access token is not this sandbox's")
        who = tenant_of(rec.owner)  # the sandbox's own credential
        sandboxes = core.sandboxes
        if not sandboxes.is_running(sandbox_id, SYSTEM) and rec.state == SandboxState.PAUSED:
            if not rec.auto_resume:
                raise PortError(409, f"sandbox {sandbox_id} is paused; resume it (connect) or "
                                     "create it with auto_resume to wake it by traffic")
            try:  # placed as a resume through the API is (core/placement.py)
                resumed = await core.placement.resume_on_use(sandbox_id, who,
                                                             placed=relay.forwarded(scope))
            except SandlotError as e:
                raise PortError(502, f"sandbox {sandbox_id} could not be resumed: "
                                     f"{e.message or e}") from None
            if resumed is not None:
                log.info("sandbox %s resumed by traffic to port %d on %s", sandbox_id, port,
                         resumed.host)
                if resumed.host and resumed.host != core.host_id:
                    raise ResumedElsewhere(resumed.host)
        if not sandboxes.is_running(sandbox_id, SYSTEM):
            raise PortError(404, f"sandbox {sandbox_id} is not running (state: "
                                 f"{rec.state.value})")
        try:
            return await sandboxes.expose_port(sandbox_id, port, who=who)
        except SandlotError as e:  # the caller has no key: nothing of the tenant's limits
            log.info("port %d of %s not exposed: %s", port, sandbox_id, e.message)
            raise PortError(e.status, f"port {port} of sandbox {sandbox_id} cannot be "
                                      "reached now") from None

    async def _relay_http(self, scope: Scope, receive: Receive, send: Send, base: str,
                          port: int, sandbox_id: str) -> None:
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        query = (scope.get("query_string") or b"").decode("latin-1")
        url = base + path + ("?" + query if query else "")
        headers = _passed_headers(scope)
        body = (_header(scope, b"content-length") not in (None, b"0")
                or _header(scope, b"transfer-encoding") is not None)

        transport = scope["app"].state.port_transport
        try:
            for attempt in (1, 2):
                request = httpx.Request(scope["method"], url, headers=headers,
                                        content=relay.request_body(receive) if body else None,
                                        extensions={"timeout": TIMEOUTS})
                try:
                    response = await transport.handle_async_request(request)
                    break
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    # a kept-alive connection the sandbox's server closed as it was reused:
                    # a request without a body is sent again on a new one
                    if body or attempt == 2:
                        raise
        except httpx.HTTPError as e:
            log.info("port %d of %s did not answer: %s", port, sandbox_id, e)
            await deny(scope, send, 502, f"The sandbox is running but port {port} is not open "
                                         "(nothing answered on it)", sandbox_id)
            return
        await relay.send_answer(send, response, f"port {port} of {sandbox_id}")


def _tokens(scope: Scope):
    from sandlot.server.e2b.state import e2b_state

    return e2b_state(HTTPConnection(scope)).tokens  # type: ignore[arg-type]


def _rewritten(scope: Scope, prefix: str, sandbox_id: str | None = None) -> Scope:
    """`scope` with `prefix` before its path (and naming `sandbox_id` as envd calls do)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    headers = [(k, v) for k, v in scope.get("headers") or () if k != b"e2b-sandbox-id"]
    if sandbox_id is not None:
        headers.append((b"e2b-sandbox-id", sandbox_id.encode()))
    return {**scope, "path": prefix + scope["path"], "raw_path": prefix.encode() + raw,
            "headers": headers}


def _passed_headers(scope: Scope, ws: bool = False) -> list[tuple[bytes, bytes]]:
    """The request's headers for the sandbox: its own Host kept, the token and hop-by-hop
    headers dropped, X-Forwarded-* added."""
    drop = HOP_BY_HOP | (WS_HANDSHAKE if ws else set())
    headers = [(k, v) for k, v in scope.get("headers") or () if k.lower() not in drop
               and not k.lower().startswith(b"x-forwarded-")]
    host = _header(scope, b"host")
    if host is not None and not ws:
        headers.append((b"host", host))
        headers.append((b"x-forwarded-host", host))
    client = scope.get("client")
    if client:
        headers.append((b"x-forwarded-for", str(client[0]).encode()))
    scheme = scope.get("scheme", "http").replace("ws", "http")
    headers.append((b"x-forwarded-proto", scheme.encode()))
    return headers


async def deny(scope: Scope, send: Send, status: int, message: str, sandbox_id: str) -> None:
    """An error answer in E2B's proxy shape; for a WebSocket, before its handshake."""
    data = json.dumps({"sandboxId": sandbox_id, "message": message, "code": status}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
    elif "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": headers})
        await send({"type": "websocket.http.response.body", "body": data})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def relay_websocket(scope: Scope, receive: Receive, send: Send, host: str, port: int,
                          peer: tuple[bytes, bytes] | None = None, tls: bool = False) -> None:
    """Relay a WebSocket whose `websocket.connect` was received to `host`:`port`, messages
    both ways, then the close: to the sandbox's port, or to the `peer` host that runs it (its
    forwarding header given; the request's headers go as they came, the token included).
    The handshake names the public host, so a peer routes it as this host did."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    name = (_header(scope, b"host") or b"").decode("latin-1")
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    query = (scope.get("query_string") or b"").decode("latin-1")
    uri = f"{'wss' if tls else 'ws'}://{name}{path}" + ("?" + query if query else "")
    if peer is None:
        passed = _passed_headers(scope, ws=True)
    else:
        passed = [(k, v) for k, v in scope.get("headers") or ()
                  if k == TOKEN_HEADER or k not in HOP_BY_HOP | WS_HANDSHAKE] + [peer]
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in passed]
    sandbox_id = (target_of(scope) or (0, ""))[1]
    kw = {"server_hostname": host} if tls else {}
    try:
        upstream = await connect(uri, host=host, port=port, additional_headers=headers,
                                 subprotocols=scope.get("subprotocols") or None,
                                 max_size=WS_MAX_MESSAGE, ping_interval=None,
                                 open_timeout=30, user_agent_header=None, **kw)
    except InvalidStatus as e:
        await deny(scope, send, e.response.status_code,
                   e.response.body.decode(errors="replace") if e.response.body else
                   f"the sandbox refused the WebSocket ({e.response.status_code})", sandbox_id)
        return
    except Exception as e:  # noqa: BLE001 - refused, unreachable, a bad handshake: answered
        log.info("WebSocket to %s:%d failed: %s", host, port, e)
        await deny(scope, send, 502, f"the WebSocket to the sandbox failed: {e}", sandbox_id)
        return
    async with upstream:
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        async def inbound() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    await upstream.close(_sendable(message.get("code", 1000)),
                                         message.get("reason") or "")
                    return
                if message["type"] == "websocket.receive":
                    data = message.get("bytes")
                    await upstream.send(data if data is not None else message.get("text", ""))

        async def outbound() -> None:
            with contextlib.suppress(ConnectionClosed):
                async for data in upstream:
                    key = "bytes" if isinstance(data, bytes) else "text"
                    await send({"type": "websocket.send", key: data})
            code = upstream.close_code
            with contextlib.suppress(Exception):  # the client may be gone already
                await send({"type": "websocket.close",
                            "code": _sendable(code if code is not None else 1011),
                            "reason": upstream.close_reason or ""})

        tasks = [asyncio.ensure_future(inbound()), asyncio.ensure_future(outbound())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t


def _sendable(code: int) -> int:
    """A close code a close frame may carry (1005, 1006 and 1015 are never sent)."""
    return 1000 if code in (1005, 1006, 1015) or not 1000 <= code < 5000 else code


def peer_address(url: str) -> tuple[str, int, bool]:
    """(host, port, tls) of a peer host's base URL."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    return parts.hostname or "", parts.port or (443 if tls else 80), tls


async def relay_to_host(scope: Scope, receive: Receive, send: Send, core,
                        host_id: str | None) -> bool:
    """Send a request on to `host_id` when that is another live host of the deployment (a
    sandbox a use just resumed there, where placement put it): HTTP, or a WebSocket whose
    `websocket.connect` was received. False: it is answered here (this host, a host that is
    gone, or a request a peer sent here already)."""
    if not host_id or relay.forwarded(scope):
        return False
    url = await core.hosts.url_of(host_id)
    if url is None:
        return False
    peers = scope["app"].state.peers
    if scope["type"] == "websocket":
        host, port, tls = peer_address(url)
        await relay_websocket(scope, receive, send, host, port,
                              (relay.FORWARDED.encode(), peers.token.encode()), tls)
    else:
        await peers.relay(scope, receive, send, url)
    return True
