"""The fast tier: the real app, core and SDKs in one process on the fake machine layer
(runtime/fake.py), reached through httpx transports. No VM, no socket; seconds in all."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastkit import URL, Fast, _AsyncRecording, _Recording

from sandlot.sdk._async import _http as _ahttp
from sandlot.sdk._async import _sandbox as _asandbox
from sandlot.sdk._sync import _http, _sandbox
from sandlot.testing import ThreadedTransport, in_process


@pytest.fixture
def fast(tmp_path) -> Iterator[Fast]:
    """For the sync SDK and the CLI."""
    threaded = ThreadedTransport(tmp_path)
    requests: list[httpx.Request] = []
    yield Fast(threaded.server, _Recording(threaded, requests), requests)
    threaded.shutdown()


@pytest.fixture
async def afast(tmp_path) -> AsyncIterator[Fast]:
    """For the async SDK, on the test's own event loop."""
    async with in_process(tmp_path) as srv:
        requests: list[httpx.Request] = []
        yield Fast(srv, _AsyncRecording(srv.async_transport(), requests), requests)


@pytest.fixture
def default_api(monkeypatch: pytest.MonkeyPatch, fast: Fast) -> Fast:
    """The sync SDK's classmethods (Sandbox.create, Snapshot.get, ...) reach `fast`."""
    monkeypatch.setenv("SANDLOT_URL", URL)
    monkeypatch.setenv("SANDLOT_API_KEY", fast.key)
    monkeypatch.setattr(_sandbox, "API", functools.partial(_http.API, transport=fast.transport))
    return fast


@pytest.fixture
def async_default_api(monkeypatch: pytest.MonkeyPatch, afast: Fast) -> Fast:
    monkeypatch.setenv("SANDLOT_URL", URL)
    monkeypatch.setenv("SANDLOT_API_KEY", afast.key)
    monkeypatch.setattr(_asandbox, "AsyncAPI",
                        functools.partial(_ahttp.AsyncAPI, transport=afast.transport))
    return afast
