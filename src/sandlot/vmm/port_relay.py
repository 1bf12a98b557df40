"""Exposed guest ports: a TCP relay listening on the host's 127.0.0.1 whose upstream socket is
opened inside the sandbox's network namespace (no route_localnet, no DNAT; the same for every
fork). A paused sandbox's relay can be parked: it keeps listening and a connection waits
until the sandbox is back."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from sandlot.errors import InvalidArgumentError, InvalidStateError, SandlotError
from sandlot.vmm.netns import run_in_netns

__all__ = ["PARKED_WAIT", "PortForwarder"]

log = logging.getLogger(__name__)
# How long a connection to a paused sandbox's kept port waits for it at most (a resume that
# neither succeeds nor fails in this time: a restore of a large image on a loaded host takes
# a minute or two under TCG).
PARKED_WAIT = 300.0


class PortForwarder:
    """Relays TCP connections from 127.0.0.1 on the host to a port of the guest.

    Each accepted connection gets an upstream socket created inside ``netns`` and connected
    to ``target``; bytes are copied both ways, half-closes included. While parked (the
    sandbox is paused), a connection first waits for `unpark` (relayed) or `refuse` (ended).
    Use from one event loop; `unpark`, `refuse` and `close` may be called from any thread.
    """

    def __init__(self, netns: str, target: str, bind: str = "127.0.0.1",
                 connect_timeout: float = 5.0) -> None:
        self.netns = netns
        self.target = target
        self.bind = bind
        self.connect_timeout = connect_timeout
        self._servers: dict[int, tuple[asyncio.Server, tuple[str, int]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._parked = False
        self._on_wait: Callable[[], None] = lambda: None
        self._back: asyncio.Future[bool] | None = None  # what connections while parked await

    def ports(self) -> dict[int, tuple[str, int]]:
        """Guest port -> the host address that reaches it."""
        return {port: address for port, (_server, address) in self._servers.items()}

    async def expose(self, port: int) -> tuple[str, int]:
        """Start (or reuse) the listener for guest ``port``; returns its host address."""
        if not 0 < port < 65536:
            raise InvalidArgumentError(f"bad port {port}")
        if self._closed:
            raise InvalidStateError("port forwarder is closed")
        self._loop = asyncio.get_running_loop()
        if port in self._servers:
            return self._servers[port][1]

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._relay(port, reader, writer)

        server = await asyncio.start_server(handle, self.bind, 0)
        host, host_port = server.sockets[0].getsockname()[:2]
        self._servers[port] = (server, (host, host_port))
        return host, host_port

    def park(self, on_wait: Callable[[], None]) -> None:
        """From now on a connection waits for `unpark` or `refuse`; the first of each wait
        calls `on_wait` (in the event loop)."""
        self._parked, self._on_wait = True, on_wait

    def unpark(self, netns: str) -> None:
        """The sandbox is back, in namespace `netns`: waiting connections are relayed there."""
        self.netns, self._parked = netns, False
        self._call_in_loop(lambda: self._answer(True))

    def refuse(self) -> None:
        """End the connections waiting now (the sandbox is not back); it stays parked."""
        self._call_in_loop(lambda: self._answer(False))

    def _answer(self, back: bool) -> None:
        if self._back is not None and not self._back.done():
            self._back.set_result(back)
        self._back = None

    async def _wait_for_sandbox(self) -> None:
        if self._back is None:
            self._back = asyncio.get_running_loop().create_future()
            self._on_wait()
        try:
            back = await asyncio.wait_for(asyncio.shield(self._back), PARKED_WAIT)
        except TimeoutError:
            back = False
        if not back:
            raise InvalidStateError("the sandbox did not come back")

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn()
        else:
            loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        """Stop listening and drop every relayed connection. Callable from any thread."""
        self._closed = True
        self._call_in_loop(self._close_now)

    def _close_now(self) -> None:
        for server, _ in self._servers.values():
            server.close()
        self._servers.clear()
        for task in self._tasks:
            task.cancel()

    async def _relay(self, port: int, creader: asyncio.StreamReader,
                     cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        gwriter: asyncio.StreamWriter | None = None
        pipes: list[asyncio.Task[None]] = []
        clean = False
        try:
            if self._parked:  # the sandbox is paused: wait until it is back
                await self._wait_for_sandbox()
            sock = run_in_netns(self.netns, _tcp_socket)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(
                    sock, (self.target, port)), self.connect_timeout)
            except BaseException:
                sock.close()
                raise
            greader, gwriter = await asyncio.open_connection(sock=sock)
            pipes = [asyncio.create_task(_pipe(creader, gwriter)),
                     asyncio.create_task(_pipe(greader, cwriter))]
            clean = all(await asyncio.gather(*pipes))
        except (TimeoutError, OSError, SandlotError) as e:
            log.debug("relay to %s:%d in %s: %s", self.target, port, self.netns, e)
        finally:
            for pipe in pipes:
                pipe.cancel()
            for w in (cwriter, gwriter):
                if w is None:
                    continue
                if clean:
                    w.close()  # flushes what is still buffered
                else:
                    w.transport.abort()
            self._tasks.discard(task)


def _tcp_socket() -> socket.socket:
    """(In the sandbox's namespace.) Its protocol named, so asyncio turns Nagle off on it, as
    on the relay's other leg: bytes are passed on as they come."""
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Copy until EOF and pass the EOF on; False if either side failed."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except (OSError, RuntimeError):
        return False
