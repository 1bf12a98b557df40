"""The fast tier's in-process server handle, imported by the unit tests by name
(`from fastkit import Fast`), and `serving`: an app under uvicorn on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

import httpx
import uvicorn

from sandlot.testing import loopback_socket

URL = "http://sandlot.test"


class _Recording(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, requests: list) -> None:
        self.inner, self.requests = inner, requests

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        return self.inner.handle_request(request)


class _AsyncRecording(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, requests: list) -> None:
        self.inner, self.requests = inner, requests

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.requests.append(request)
        return await self.inner.handle_async_request(request)


@dataclass
class Fast:
    """An in-process server: its runtime, core, API key, a transport to it for the SDKs, and
    every request the SDK sent through that transport."""

    server: object
    transport: httpx.BaseTransport | httpx.AsyncBaseTransport
    requests: list[httpx.Request] = field(default_factory=list)
    url: str = URL

    @property
    def key(self) -> str:
        return self.server.key

    @property
    def runtime(self):
        return self.server.runtime

    @property
    def core(self):
        return self.server.core


@contextlib.asynccontextmanager
async def serving(app, sock: socket.socket | None = None):
    """`app` under uvicorn on loopback, lifespan included, serving on `sock` (a
    `loopback_socket`: pass one to know the port before the app is made) or a socket of its
    own; yields the port."""
    sock = sock or loopback_socket()
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", ws="auto"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def two_tenants(tmp_path, prefix: str):
    """A server on the fake runtime (the base template installed) with two tenants, "a"
    and "b", each with an API key `<prefix>_a` / `<prefix>_b`: (core, {tenant: key}, url)."""
    from sandlot.runtime.fake import FakeRuntime
    from sandlot.server.app import create_app
    from sandlot.testing import fake_settings, install_fake_template

    runtime = FakeRuntime()
    settings = fake_settings(tmp_path)
    install_fake_template(settings, runtime)
    app = create_app(settings, runtime=runtime)
    async with serving(app) as port:
        core = app.state.core
        keys = {"a": f"{prefix}_a", "b": f"{prefix}_b"}
        for tenant, key in keys.items():
            await core.db.add_key(key, tenant)
        yield core, keys, f"http://127.0.0.1:{port}"
