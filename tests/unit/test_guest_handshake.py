"""The restore handshake against a scripted guest: unanswered hellos are re-sent alone (a busy
guest does its configure once), a configure is sent again when a re-sent hello is the one
answered (the first frames were dropped), and nothing is re-sent before the VM runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sandlot.guest.client import AgentClient, Configure
from sandlot.guest.protocol import PROTO_VERSION
from sandlot.guest.wire import FrameDecoder, encode


async def scripted_guest(path: Path, answer_hello: int, drop: int = 0, late: int = 0):
    """A guest on `path` that drops its first `drop` frames and answers hello number
    `answer_hello` (counting from 1, dropped ones included; only once it got `late` hellos,
    if given) and every configure it keeps. Returns the list of ops it received and the
    server."""
    seen: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        hellos: list[dict] = []
        while data := await reader.read(1 << 16):
            for header, _ in decoder.feed(data):
                seen.append(header["op"])
                if header["op"] == "hello":
                    hellos.append(header)
                if len(seen) <= drop:
                    continue
                if header["op"] == "hello" and len(hellos) == max(answer_hello, late):
                    hello = hellos[answer_hello - 1]
                    writer.write(encode({"id": hello["id"], "ok": True, "generation": "g",
                                         "hello": {"proto": PROTO_VERSION, "caps": [],
                                                   "nonce": hello["nonce"]}}))
                elif header["op"] == "configure":
                    writer.write(encode({"id": header["id"], "ok": True, "time_ns": 1}))
                await writer.drain()

    server = await asyncio.start_unix_server(serve, str(path))
    return seen, server


async def test_a_slow_guest_gets_its_configure_once(tmp_path: Path) -> None:
    seen, server = await scripted_guest(tmp_path / "s", answer_hello=1, late=3)
    async with server:
        client = await AgentClient.connect(str(tmp_path / "s"), timeout=10,
                                           configure=Configure(env={"A": "1"}))
        await client.close()
    assert seen.count("hello") == 3
    assert seen.count("configure") == 1
    assert client.configured is not None


async def test_a_dropped_configure_is_sent_again(tmp_path: Path) -> None:
    seen, server = await scripted_guest(tmp_path / "s", answer_hello=2, drop=2)
    async with server:
        client = await AgentClient.connect(str(tmp_path / "s"), timeout=10,
                                           configure=Configure(env={"A": "1"}))
        await client.close()
    assert seen[:3] == ["hello", "configure", "hello"]
    assert seen.count("configure") == 2
    assert client.configured is not None


async def test_nothing_is_resent_before_the_vm_runs(tmp_path: Path) -> None:
    seen, server = await scripted_guest(tmp_path / "s", answer_hello=2)
    running = asyncio.Event()
    async with server:
        connecting = asyncio.create_task(AgentClient.connect(
            str(tmp_path / "s"), timeout=10, configure=Configure(), running=running))
        await asyncio.sleep(0.8)  # longer than the first re-send interval
        assert seen == ["hello", "configure"]
        running.set()
        client = await asyncio.wait_for(connecting, 5)
        await client.close()
    assert seen.count("hello") == 2
