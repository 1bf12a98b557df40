"""Port URLs (server/ports.py): ``<port>-<sandbox id>.<domain>`` on the server's own port
reaches that port of the sandbox, HTTP streamed both ways and WebSockets, with E2B's traffic
access token when public traffic is off, waking an auto-resume sandbox. The app runs under
uvicorn on loopback with the fake runtime, whose `listeners` put a test server of this
process behind the sandbox's port."""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import pytest
from e2b import AsyncSandbox
from fastkit import serving
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from sandlot.runtime.fake import FakeRuntime
from sandlot.server.app import create_app
from sandlot.testing import fake_settings, install_fake_template, loopback_socket

DOMAIN = "sandlot.test"
PORT = 8000  # the sandbox's port the test server stands behind


class Upstream:
    """The server "in the sandbox": what it saw, and a gate its stream waits on."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.gate = asyncio.Event()

    def app(self) -> Starlette:
        async def hello(request: Request) -> JSONResponse:
            self.seen.append({"path": request.url.path, "query": request.url.query,
                              "headers": dict(request.headers)})
            return JSONResponse({"hello": "from the sandbox"},
                                headers={"set-cookie": "s=1; Path=/"})

        async def echo(request: Request) -> Response:
            self.seen.append({"path": request.url.path, "headers": dict(request.headers)})
            return Response(await request.body(), media_type="application/octet-stream")

        async def stream(request: Request) -> StreamingResponse:
            async def body():
                yield b"first\n"
                await self.gate.wait()  # the test has read the first line through the proxy
                yield b"second\n"
            return StreamingResponse(body(), media_type="text/plain")

        async def ws(websocket: WebSocket) -> None:
            await websocket.accept(subprotocol=(websocket.scope.get("subprotocols") or
                                                [None])[0])
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") == "bye":
                    await websocket.close(4001, "asked to")
                    return
                if message.get("bytes") is not None:
                    await websocket.send_bytes(message["bytes"][::-1])
                else:
                    await websocket.send_text(message["text"].upper())

        return Starlette(routes=[Route("/hello", hello), Route("/echo", echo, methods=["POST"]),
                                 Route("/stream", stream), WebSocketRoute("/ws", ws)])


class Env:
    def __init__(self, app, runtime: FakeRuntime, port: int, key: str, upstream: Upstream
                 ) -> None:
        self.app, self.runtime, self.port, self.key, self.upstream = (app, runtime, port, key,
                                                                      upstream)
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.AsyncClient(base_url=self.url, timeout=30)

    async def create(self, **body) -> dict:
        r = await self.http.post("/e2b/sandboxes", json={"templateID": "base", **body},
                                 headers={"x-api-key": self.key})
        assert r.status_code == 201, r.text
        return r.json()

    async def get(self, sid: str, path: str, port: int = PORT, **kw) -> httpx.Response:
        headers = {"host": f"{port}-{sid}.{DOMAIN}", **kw.pop("headers", {})}
        return await self.http.get(path, headers=headers, **kw)

    def ws(self, sid: str, path: str = "/ws", port: int = PORT, **kw):
        return connect(f"ws://{port}-{sid}.{DOMAIN}:{self.port}{path}", host="127.0.0.1",
                       port=self.port, **kw)


@pytest.fixture
async def env(tmp_path):
    upstream = Upstream()
    runtime = FakeRuntime()
    settings = fake_settings(tmp_path, e2b_domain=DOMAIN)
    install_fake_template(settings, runtime)
    app = create_app(settings, runtime=runtime)
    async with serving(upstream.app()) as up_port, serving(app) as port:
        runtime.listeners[PORT] = ("127.0.0.1", up_port)
        key = "sl_test_ports"
        await app.state.core.db.add_key(key, "a")
        e = Env(app, runtime, port, key, upstream)
        yield e
        await e.http.aclose()


async def test_http_reaches_the_sandbox_port(env):
    sb = await env.create()
    assert sb["domain"] == DOMAIN and sb["trafficAccessToken"] is None
    sid = sb["sandboxID"]
    r = await env.get(sid, "/hello?x=1&y=2")
    assert r.status_code == 200 and r.json() == {"hello": "from the sandbox"}
    seen = env.upstream.seen[-1]
    assert seen["path"] == "/hello" and seen["query"] == "x=1&y=2"
    assert seen["headers"]["host"] == f"{PORT}-{sid}.{DOMAIN}"
    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
    assert "cookie" not in seen["headers"]
    assert r.headers["set-cookie"] == "s=1; Path=/"

    # the body streams to the sandbox and back
    async def chunks():
        for i in range(50):
            yield f"chunk {i}\n".encode() * 100
    r = await env.http.post("/echo", content=chunks(),
                            headers={"host": f"{PORT}-{sid}.{DOMAIN}"})
    assert r.content == b"".join(f"chunk {i}\n".encode() * 100 for i in range(50))
    assert env.upstream.seen[-1]["headers"]["transfer-encoding"] == "chunked"

    # an answer streams: its first part arrives before the sandbox writes the second
    async with env.http.stream("GET", "/stream",
                               headers={"host": f"{PORT}-{sid}.{DOMAIN}"}) as r:
        lines = r.aiter_lines()
        assert await asyncio.wait_for(anext(lines), 30) == "first"
        env.upstream.gate.set()
        assert await asyncio.wait_for(anext(lines), 30) == "second"

    # other names of the domain, and other hosts, are the API
    assert (await env.http.get("/health")).json()["status"] == "ok"
    r = await env.http.get("/health", headers={"host": f"www.{DOMAIN}"})
    assert r.json()["status"] == "ok"


async def test_unknown_stopped_and_closed_ports(env):
    r = await env.get("sb-0123456789", "/hello")
    assert r.status_code == 404 and "not found" in r.json()["message"]
    sid = (await env.create())["sandboxID"]
    r = await env.get(sid, "/hello", port=9)  # nothing listens behind it
    assert r.status_code == 502 and "port 9 is not open" in r.json()["message"]
    r = await env.get(sid, "/hello", port=70000)
    assert r.status_code == 400
    assert (await env.http.delete(f"/e2b/sandboxes/{sid}",
                                  headers={"x-api-key": env.key})).status_code == 204
    r = await env.get(sid, "/hello")
    assert r.status_code == 404 and "not running" in r.json()["message"]


async def test_traffic_access_token(env):
    private = await env.create(network={"allowPublicTraffic": False})
    public = await env.create(network={"allowPublicTraffic": True})
    token, sid = private["trafficAccessToken"], private["sandboxID"]
    assert token and public["trafficAccessToken"] is None
    r = await env.http.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 60},
                            headers={"x-api-key": env.key})
    assert r.json()["trafficAccessToken"] == token

    r = await env.get(sid, "/hello")
    assert r.status_code == 403 and "e2b-traffic-access-token" in r.json()["message"]
    for wrong in ("nope", private["envdAccessToken"]):
        r = await env.get(sid, "/hello", headers={"e2b-traffic-access-token": wrong})
        assert r.status_code == 403
    # an API key is no traffic token, of this tenant or another
    r = await env.get(sid, "/hello", headers={"x-api-key": env.key})
    assert r.status_code == 403
    r = await env.get(sid, "/hello", headers={"e2b-traffic-access-token": token})
    assert r.status_code == 200
    assert "e2b-traffic-access-token" not in env.upstream.seen[-1]["headers"]
    # one sandbox's token opens no other
    other = await env.create(network={"allowPublicTraffic": False})
    r = await env.get(other["sandboxID"], "/hello", headers={"e2b-traffic-access-token": token})
    assert r.status_code == 403
    assert (await env.get(public["sandboxID"], "/hello")).status_code == 200

    # WebSockets too
    with pytest.raises(InvalidStatus) as ei:
        async with env.ws(sid):
            pass
    assert ei.value.response.status_code == 403
    async with env.ws(sid, additional_headers={"e2b-traffic-access-token": token}) as ws:
        await ws.send("hi")
        assert await ws.recv() == "HI"


async def test_websocket(env):
    sid = (await env.create())["sandboxID"]
    async with env.ws(sid, subprotocols=["chat"]) as ws:
        assert ws.subprotocol == "chat"
        await ws.send("hello")
        assert await ws.recv() == "HELLO"
        await ws.send(b"\x00\x01\x02")
        assert await ws.recv() == b"\x02\x01\x00"
        await ws.send("x" * (1 << 20))
        assert await ws.recv() == "X" * (1 << 20)
        await ws.send("bye")  # the sandbox's server closes, with its code
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 4001 and ws.close_reason == "asked to"
    with pytest.raises(InvalidStatus) as ei:
        async with env.ws("sb-0123456789"):
            pass
    assert ei.value.response.status_code == 404


async def test_traffic_wakes_an_auto_resume_sandbox(env):
    sid = (await env.create(autoResume={"enabled": True}))["sandboxID"]
    held = (await env.create())["sandboxID"]
    for s in (sid, held):
        r = await env.http.post(f"/e2b/sandboxes/{s}/pause", headers={"x-api-key": env.key})
        assert r.status_code == 204
    core = env.app.state.core
    assert sid not in core.sandboxes.live
    r = await env.get(sid, "/hello")
    assert r.status_code == 200 and sid in core.sandboxes.live
    r = await env.get(held, "/hello")  # paused, without auto-resume: stays paused
    assert r.status_code == 409 and "paused" in r.json()["message"]
    assert held not in core.sandboxes.live
    # a WebSocket wakes it too
    r = await env.http.post(f"/e2b/sandboxes/{sid}/pause", headers={"x-api-key": env.key})
    assert r.status_code == 204 and sid not in core.sandboxes.live
    async with env.ws(sid) as ws:
        await ws.send("up")
        assert await ws.recv() == "UP"


async def test_e2b_names_and_the_sdk(env):
    """api.<domain> is the control plane and 49983-<id>.<domain> the sandbox's envd; the
    unmodified SDK builds get_host names under the server's domain, and reads the token."""
    r = await env.http.post("/sandboxes", json={"templateID": "base"},
                            headers={"host": f"api.{DOMAIN}", "x-api-key": env.key})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    r = await env.http.get("/v1/sandboxes", headers={"host": f"api.{DOMAIN}",
                                                     "authorization": f"Bearer {env.key}"})
    assert r.status_code == 200  # sandlot's own paths stay as they are
    r = await env.get(sid, "/health", port=49983)
    assert r.status_code == 401  # envd's own routes and auth
    r = await env.get(sid, "/health", port=49983, headers={"x-access-token": token})
    assert r.status_code == 204, r.text
    r = await env.http.get("/e2b/sandboxes/" + sid, headers={"x-api-key": env.key})
    assert r.json()["domain"] == DOMAIN

    opts = {"api_url": f"{env.url}/e2b", "sandbox_url": f"{env.url}/e2b/envd",
            "api_key": env.key}
    sbx = await AsyncSandbox.create("base", network={"allow_public_traffic": False}, **opts)
    assert sbx.get_host(PORT) == f"{PORT}-{sbx.sandbox_id}.{DOMAIN}"
    assert sbx.traffic_access_token
    r = await env.get(sbx.sandbox_id, "/hello",
                      headers={"e2b-traffic-access-token": sbx.traffic_access_token})
    assert r.status_code == 200 and json.loads(r.text)["hello"] == "from the sandbox"
    forks = await env.http.post(f"/e2b/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1},
                                headers={"x-api-key": env.key})
    child = forks.json()[0]["sandbox"]
    assert child["trafficAccessToken"] and child["trafficAccessToken"] != \
        sbx.traffic_access_token


async def test_a_port_of_a_sandbox_on_another_host(tmp_path, postgres):
    """Two hosts of a deployment: a port name asked of one reaches the sandbox the other
    runs (forwarded with its Host), HTTP and WebSocket alike."""
    upstream, database = Upstream(), postgres.new_database("ports" + secrets.token_hex(4))
    socks = [loopback_socket(), loopback_socket()]  # bound now: the hosts advertise them
    ports = [sock.getsockname()[1] for sock in socks]
    apps, runtimes = [], []
    for i, port in enumerate(ports):
        runtime = FakeRuntime()
        settings = fake_settings(tmp_path / f"h{i}", e2b_domain=DOMAIN, database_url=database,
                                 host_id=f"h-{i}", advertise_url=f"http://127.0.0.1:{port}",
                                 store=str(tmp_path / "store"))
        install_fake_template(settings, runtime)
        apps.append(create_app(settings, runtime=runtime))
        runtimes.append(runtime)
    async with serving(upstream.app()) as up_port, serving(apps[0], socks[0]), \
            serving(apps[1], socks[1]):
        runtimes[1].listeners[PORT] = ("127.0.0.1", up_port)
        key = "sl_test_ports"
        await apps[0].state.core.db.add_key(key, "a")
        there = Env(apps[1], runtimes[1], ports[1], key, upstream)
        here = Env(apps[0], runtimes[0], ports[0], key, upstream)
        sb = await there.create(network={"allowPublicTraffic": False})
        sid, token = sb["sandboxID"], sb["trafficAccessToken"]
        assert sid in apps[1].state.core.sandboxes.live
        r = await here.get(sid, "/hello", headers={"e2b-traffic-access-token": token})
        assert r.status_code == 200 and r.json() == {"hello": "from the sandbox"}
        assert upstream.seen[-1]["headers"]["host"] == f"{PORT}-{sid}.{DOMAIN}"
        assert (await here.get(sid, "/hello")).status_code == 403
        async with here.ws(sid, additional_headers={"e2b-traffic-access-token": token}) as ws:
            await ws.send("far")
            assert await ws.recv() == "FAR"
        for e in (here, there):
            await e.http.aclose()
