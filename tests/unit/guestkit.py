"""The real guest agent (the Go binary the templates install) run on this host over a socket
pair, imported by the unit tests by name (`from guestkit import AgentProcess`). Its commands
run here as this user; only ops that are safe on a host are sent (no clock or RNG changes).
`agent_link` gives the real host client of such a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from sandlot.guest import wire
from sandlot.guest.client import AgentClient, LinkState
from sandlot.guest.volserve import VolumeServer
from sandlot.images.guest import build_guest
from sandlot.testing import IMAGES_DIR

# The template builds' own cache: the tests use the very binary a build installs.
CACHE = IMAGES_DIR / "guest"


def agent_binary() -> Path:
    return build_guest(CACHE)["/opt/sandlot/sandlot-agent"]


def describe() -> dict:
    """The agent's own account of its ops and capabilities (`sandlot-agent -describe`)."""
    out = subprocess.run([str(agent_binary()), "-describe"], capture_output=True, check=True,
                         timeout=30)
    return json.loads(out.stdout)


class AgentProcess:
    """One agent process serving one end of a socket pair; `host` is the other end."""

    def __init__(self, *args: str) -> None:
        self.host, guest = socket.socketpair()
        self.proc = subprocess.Popen([str(agent_binary()), "-fd", str(guest.fileno()), *args],
                                     pass_fds=(guest.fileno(),))
        guest.close()
        self.frames: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None

    def send(self, header: dict, payload: bytes = b"") -> None:
        self.host.sendall(wire.encode(header, payload))

    def start_reading(self) -> None:
        """Decode what the agent sends into `frames` (for tests that do not use the client)."""
        def read() -> None:
            decoder = wire.FrameDecoder()
            while data := self.host.recv(1 << 20):
                for frame in decoder.feed(data):
                    self.frames.put(frame)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def close(self) -> None:
        try:
            self.host.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.host.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.asynccontextmanager
async def agent_link(*args: str, volumes: VolumeServer | None = None
                     ) -> AsyncIterator[AgentClient]:
    """A ready host client (serving `volumes`) of a new agent process run with `args`; both
    closed after."""
    agent = AgentProcess(*args)
    try:
        reader, writer = await asyncio.open_unix_connection(sock=agent.host, limit=8 << 20)
        client = AgentClient(reader, writer, volumes)
        client._task = asyncio.create_task(client._read_loop())
        try:
            await client._handshake(5.0, None)
            client.state = LinkState.READY
            yield client
        finally:
            await client.close()
    finally:
        agent.close()
