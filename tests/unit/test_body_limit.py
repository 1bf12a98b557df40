"""A request body over the limit gets its 413 with its message however much the client still
sends, under a real uvicorn on loopback: the refusal reads and drops the rest of the body (a
bounded amount, for a bounded time) before the connection closes, so no TCP reset destroys
the answer before the client reads it (server/body.py)."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from fastkit import serving

from sandlot.config import Limits
from sandlot.runtime.fake import FakeRuntime
from sandlot.server import body
from sandlot.server.app import create_app, listen
from sandlot.testing import fake_settings

LIMIT = 64 << 10
HUGE = 4 << 20  # 64 times the limit: far more than the kernel's socket buffers hold
TRIES = 10


@pytest.fixture
async def port(tmp_path):
    app = create_app(fake_settings(tmp_path, limits=Limits(body_bytes=LIMIT)),
                     runtime=FakeRuntime())
    async with serving(app) as port:
        yield port


def message(r: httpx.Response) -> str:
    """The refusal's message, in the shape of the API it was sent to."""
    assert r.status_code == 413, r.text
    if r.url.path.startswith("/e2b"):
        assert r.json()["code"] == 413, r.text
        return r.json()["message"]
    assert r.json()["error"]["type"] == "PayloadTooLargeError", r.text
    return r.json()["error"]["message"]


def request(port: int, path: str, size: int,
            stop_after: int | None = None) -> tuple[bytes, bool]:
    """A POST of a body of `size` bytes (declared) on a socket of its own: sends `stop_after`
    of them (all by default), then reads the answer to its end (a reset after the answer ends
    it too: what an HTTP client reads is the answer). The answer, and whether the server took
    all that was sent and closed the connection with no reset."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nhost: sandlot.test\r\ncontent-type: "
                  f"application/json\r\ncontent-length: {size}\r\n\r\n".encode())
        chunk = b" " * (256 << 10)
        sent, clean = 0, True
        try:
            while sent < (size if stop_after is None else stop_after):
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            clean = False
        answer = b""
        try:
            while data := s.recv(1 << 16):
                answer += data
        except ConnectionResetError:
            clean = False
        return answer, clean


@pytest.mark.parametrize("path", ["/v1/sandboxes", "/e2b/sandboxes"])
async def test_a_body_far_over_the_limit_always_gets_its_413(port, path) -> None:
    huge = {"metadata": {f"k{i}": "v" * 1000 for i in range(HUGE // 1000)}}

    async def streamed():  # no Content-Length: refused as it streams in
        for _ in range(HUGE // (64 << 10)):
            yield b" " * (64 << 10)

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        for _ in range(TRIES):
            r = await http.post(path, json=huge)
            assert f"the request body is {len(r.request.content)} bytes" in message(r)
            assert "SANDLOT_MAX_BODY_BYTES" in message(r)
            r = await http.post(path, content=streamed(),
                                headers={"content-type": "application/json"})
            assert f"more than {LIMIT}" in message(r)
        r = await http.post(path, json={"metadata": {"k": "v"}})  # the server still serves
        assert r.status_code != 413


async def test_the_refused_body_is_read_to_its_end_and_the_connection_closed(port) -> None:
    """Within the bound, the whole body is taken and the connection ends with a close, not a
    reset: a client that sends it all and only then reads (as httpx) reads the answer."""
    for _ in range(TRIES):
        answer, clean = await asyncio.to_thread(request, port, "/v1/sandboxes", HUGE)
        assert clean
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        head, _, data = answer.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert "SANDLOT_MAX_BODY_BYTES" in json.loads(data)["error"]["message"]


async def test_the_server_reads_a_refused_body_only_so_far(port, monkeypatch) -> None:
    """Past `LINGER_BYTES`, or `LINGER_SECONDS` with nothing coming, the server stops reading
    and closes; the client has its answer."""
    endless = 1 << 40  # what the client declares
    monkeypatch.setattr(body, "LINGER_SECONDS", 0.2)
    answer, _ = await asyncio.to_thread(request, port, "/v1/sandboxes", endless, 256 << 10)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"PayloadTooLargeError" in answer, answer

    monkeypatch.setattr(body, "LINGER_SECONDS", 600)
    monkeypatch.setattr(body, "LINGER_BYTES", 256 << 10)
    answer, clean = await asyncio.to_thread(request, port, "/e2b/sandboxes", endless, 64 << 20)
    assert not clean  # it stopped reading
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"code": 413' in answer, answer


async def test_the_servers_socket_accepts_connections_with_nagle_off() -> None:
    """asyncio sets TCP_NODELAY on an accepted connection only if the listening socket's
    `proto` is IPPROTO_TCP: with Nagle on, the body of an answer waited for the client's
    acknowledgement of its head, and a refusal's connection closed meanwhile lost it."""
    nodelay = asyncio.get_running_loop().create_future()

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=listen("127.0.0.1", 0))
    async with server:
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
        assert await nodelay
        writer.close()


async def test_a_client_waiting_for_100_continue_gets_the_413_and_no_100(port,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(body, "LINGER_SECONDS", 3600)  # a wait for the body would time out

    def ask() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nhost: sandlot.test\r\nexpect: "
                      b"100-continue\r\ncontent-length: 1099511627776\r\n\r\n")
            answer = b""
            while data := s.recv(1 << 16):  # the server closes: it waits for no body
                answer += data
            return answer

    answer = await asyncio.to_thread(ask)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in answer, answer
