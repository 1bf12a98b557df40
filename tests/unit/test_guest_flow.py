"""One stream never holds up the link: the real agent (in process, its commands run on this
host) and the real host client over a socket pair. A command whose output nobody reads waits
for the host's credits (agent cap `output_credit`) while other requests on the same link are
answered at once; with an agent that pushes output (no credits), the unread stream fails
alone once its bounded inbox is full. Listings are bounded by the agent (`list_limit`)."""

from __future__ import annotations

import asyncio
import importlib
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from sandlot.errors import GuestError, InvalidArgumentError
from sandlot.guest import client as client_mod
from sandlot.guest.client import AgentClient, LinkState, Output, Started

GUEST = Path(__file__).resolve().parents[2] / "src" / "sandlot" / "guest"
BIG = 40_000_000  # bytes of output: far more than the host keeps for one stream


class SocketChannel:
    """The agent's channel over a socket; a thread feeds what arrives to the agent."""

    def __init__(self, sock: socket.socket, wire) -> None:
        self.sock = sock
        self.wire = wire
        self.lock = threading.Lock()

    def send(self, header: dict, payload: bytes = b"") -> None:
        data = self.wire.encode(header, payload)
        with self.lock:
            try:
                self.sock.sendall(data)
            except OSError:
                pass

    def serve(self, agent) -> None:
        decoder = self.wire.FrameDecoder()
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            for header, payload in decoder.feed(data):
                agent.handle(header, payload)


@pytest.fixture(scope="module")
def agent_module():
    sys.path.insert(0, str(GUEST))
    try:
        yield importlib.import_module("agent")
    finally:
        sys.path.remove(str(GUEST))


async def linked(agent_module) -> AgentClient:
    host, guest = socket.socketpair()
    chan = SocketChannel(guest, sys.modules["wire"])
    agent = agent_module.Agent(chan)
    threading.Thread(target=chan.serve, args=(agent,), daemon=True).start()
    reader, writer = await asyncio.open_unix_connection(sock=host, limit=8 << 20)
    client = AgentClient(reader, writer)
    client._task = asyncio.create_task(client._read_loop())
    await client._handshake(5.0, None)
    client.state = LinkState.READY
    return client


async def others_answer_promptly(client: AgentClient) -> None:
    for _ in range(3):
        t0 = time.monotonic()
        await asyncio.wait_for(client.ping(), 3)
        done = await asyncio.wait_for(client.run("echo other"), 10)
        assert done.exit_code == 0
        assert time.monotonic() - t0 < 3


async def test_unread_output_waits_for_credit_and_holds_up_nothing_else(agent_module) -> None:
    client = await linked(agent_module)
    assert client.has_cap("output_credit")
    try:
        events = client.exec(f"head -c {BIG} /dev/zero")
        assert isinstance(await anext(events), Started)
        await asyncio.sleep(1.0)  # the command writes; nobody reads its output
        await others_answer_promptly(client)
        held = sum(inbox.bytes for inbox in client._streams.values())
        assert held <= 4 << 20, f"the host holds {held} bytes of unread output"
        total = 0
        async for event in events:
            if isinstance(event, Output):
                total += len(event.data)
        assert total == BIG  # nothing lost: the command waited for its reader
    finally:
        await client.close()


async def test_an_agent_without_credits_fails_only_the_unread_stream(
        agent_module, monkeypatch) -> None:
    monkeypatch.setattr(agent_module, "CAPS", [c for c in agent_module.CAPS
                                               if c != "output_credit"])
    monkeypatch.setattr(client_mod, "INBOX_BYTES", 4 << 20)
    client = await linked(agent_module)
    assert not client.has_cap("output_credit")
    try:
        events = client.exec(f"head -c {BIG} /dev/zero")
        assert isinstance(await anext(events), Started)
        await asyncio.sleep(1.0)
        await others_answer_promptly(client)
        with pytest.raises(GuestError, match="went unread"):
            async for _ in events:
                pass
        await others_answer_promptly(client)
    finally:
        await client.close()


async def test_listing_is_bounded_by_the_agent(agent_module, tmp_path) -> None:
    for i in range(30):
        (tmp_path / f"f{i:02}").write_text("x")
    client = await linked(agent_module)
    try:
        assert len(await client.list_dir(str(tmp_path), 1, max_entries=30)) == 30
        with pytest.raises(InvalidArgumentError, match="listing too large"):
            await client.list_dir(str(tmp_path), 1, max_entries=29)
    finally:
        await client.close()
