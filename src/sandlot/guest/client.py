"""Host end of the guest agent link: an asyncio client over the virtio-serial unix socket.

One connection multiplexes many requests by id. Replies resolve futures; streamed events go to
bounded per-request queues, so a slow consumer back-pressures the guest instead of growing memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sandlot.errors import (
    GuestError,
    InvalidArgumentError,
    NotFoundError,
    SandlotError,
)
from sandlot.guest.wire import CHUNK_SIZE, PROTO_VERSION, FrameDecoder, encode

READ_WINDOW = 8  # chunks (1 MiB each) a file read may run ahead of its consumer

_ERROR_TYPES: dict[str, type[SandlotError]] = {
    "not_found": NotFoundError,
    "invalid": InvalidArgumentError,
    "permission": InvalidArgumentError,
}
_DONE = object()


def agent_error(err: dict) -> SandlotError:
    kind = err.get("type") if isinstance(err, dict) else None
    message = err.get("message", "agent error") if isinstance(err, dict) else str(err)
    return _ERROR_TYPES.get(kind, GuestError)(str(message))


@dataclass
class Hello:
    proto: int
    caps: list[str]
    generation: str = "0"


class AgentClient:
    """A session with the guest agent. Create with `await AgentClient.connect(path)`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._next_id = secrets.randbelow(1 << 30) + 1
        self._waiters: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._write_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._closed: BaseException | None = None
        self.hello: Hello | None = None
        self.configured: dict | None = None

    # ---- connection -----------------------------------------------------------------------

    @classmethod
    async def connect(cls, path: str, timeout: float = 30.0,
                      configure: dict | None = None) -> AgentClient:
        """Connect to the agent socket and complete the hello handshake within `timeout`.

        `configure` (see `configure_fields`) is sent right behind the hello, saving a round
        trip on the restore path; its answer is in `self.configured`.

        A session that gets no answer is dropped and the socket connected again: the guest
        learns that a host is there from a virtio-serial control message, which QEMU drops
        when the guest has no buffer posted for it; without it the guest's replies cannot be
        written. A new connection makes QEMU send it again.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempt_timeout = min(timeout, 4.0)
        last: BaseException | None = None
        while loop.time() < deadline:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=8 << 20)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                last = e
                await asyncio.sleep(0.005)
                continue
            client = cls(reader, writer)
            client._task = asyncio.create_task(client._read_loop())
            try:
                remaining = max(0.1, min(attempt_timeout, deadline - loop.time()))
                await client._handshake(remaining, configure)
                return client
            except (TimeoutError, GuestError) as e:
                last = e
                await client.close()
                attempt_timeout = min(attempt_timeout * 2, 16.0)
        raise GuestError(f"guest agent did not answer on {path} within {timeout:.0f}s: {last}")

    async def _handshake(self, timeout: float, configure: dict | None = None) -> None:
        nonce = secrets.token_hex(8)
        # Re-send hello periodically: the guest drops input while it thinks no host is there.
        rid = self._new_id()
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        cid = self._new_id()
        cfut = asyncio.get_running_loop().create_future()
        if configure is not None:
            self._waiters[cid] = cfut
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        interval = 0.25  # grows: a busy guest answers late, an absent one not at all
        try:
            while not fut.done():
                await self._send({"id": rid, "op": "hello", "nonce": nonce,
                                  "proto": PROTO_VERSION})
                if configure is not None:
                    await self._send({"id": cid, "op": "configure", **configure})
                try:
                    await asyncio.wait_for(asyncio.shield(fut),
                                           min(interval, max(0.01, end - loop.time())))
                except TimeoutError:
                    if loop.time() >= end:
                        raise
                    interval = min(2.0, interval * 2)
        except BaseException:
            # Nobody will wait for these answers any more (the caller may try a new session).
            for key, waiter in ((rid, fut), (cid, cfut)):
                self._waiters.pop(key, None)
                waiter.cancel()
            raise
        header = fut.result()
        if "error" in header:
            raise agent_error(header["error"])
        hello = header.get("hello") or {}
        if hello.get("nonce") != nonce or hello.get("proto") != PROTO_VERSION:
            raise GuestError(f"unexpected agent hello: {hello}")
        self.hello = Hello(proto=hello["proto"], caps=list(hello.get("caps", [])),
                           generation=str(header.get("generation", "0")))
        if configure is not None:
            try:
                reply = await asyncio.wait_for(cfut, max(1.0, end - loop.time()))
            except TimeoutError:
                raise GuestError("guest agent did not answer configure") from None
            finally:
                self._waiters.pop(cid, None)
            if "error" in reply:
                raise agent_error(reply["error"])
            self.configured = reply

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self._writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        self._fail(GuestError("agent connection closed"))

    @property
    def alive(self) -> bool:
        return self._closed is None

    # ---- plumbing -------------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id = (self._next_id + 1) % (1 << 31) or 1
        return self._next_id

    async def _send(self, header: dict, payload: bytes = b"") -> None:
        if self._closed is not None:
            raise GuestError(f"agent connection lost: {self._closed}")
        data = encode(header, payload)
        async with self._write_lock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (ConnectionError, OSError) as e:
                self._fail(e)
                raise GuestError(f"agent connection lost: {e}") from e

    async def _read_loop(self) -> None:
        decoder = FrameDecoder()
        try:
            while True:
                data = await self._reader.read(1 << 20)
                if not data:
                    raise ConnectionResetError("agent closed the connection")
                for header, payload in decoder.feed(data):
                    await self._dispatch(header, payload)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every failure ends the session
            self._fail(e)

    async def _dispatch(self, header: dict, payload: bytes) -> None:
        rid = header.get("id")
        queue = self._streams.get(rid)
        if queue is not None:
            await queue.put((header, payload))
            return
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(header)

    def _fail(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(GuestError(f"agent connection lost: {exc}"))
        self._waiters.clear()
        for queue in self._streams.values():
            try:
                queue.put_nowait(({"id": None, "lost": str(exc)}, b""))
            except asyncio.QueueFull:
                pass

    # ---- requests -------------------------------------------------------------------------

    async def request(self, op: str, payload: bytes = b"", reply_timeout: float | None = 30.0,
                      **fields) -> dict:
        """One request, one reply. Raises the mapped sandlot error on an error reply.

        `fields` go to the agent as they are (exec's `timeout` among them); `reply_timeout`
        bounds the wait for the reply.
        """
        rid = self._new_id()
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            await self._send({"id": rid, "op": op, **fields}, payload)
            header = await asyncio.wait_for(fut, reply_timeout)
        except TimeoutError:
            raise GuestError(f"guest agent did not answer {op} within {reply_timeout}s"
                             ) from None
        finally:
            self._waiters.pop(rid, None)
        if "error" in header:
            raise agent_error(header["error"])
        return header

    async def stream(self, op: str, payload: bytes = b"",
                     **fields) -> AsyncIterator[tuple[dict, bytes]]:
        """Send a request and yield its events until a terminal one (exit, ok or error).

        File reads are flow-controlled per stream where the agent can (`read_credit`): it
        sends at most READ_WINDOW chunks ahead, and each chunk the consumer takes earns one
        more, so a slow reader of one file holds back only that file. Other streams are
        pushed: a consumer that falls behind stops the connection's reader once its queue is
        full, which command output (at most 64 KiB an event) reaches only 32 MiB behind.
        """
        rid = self._new_id()
        credited = op == "read" and self.hello is not None and "read_credit" in self.hello.caps
        if credited:
            fields = {**fields, "window": READ_WINDOW}
        queue: asyncio.Queue = asyncio.Queue(maxsize=READ_WINDOW + 8 if op == "read" else 512)
        self._streams[rid] = queue
        done = False
        try:
            await self._send({"id": rid, "op": op, **fields}, payload)
            while True:
                header, data = await queue.get()
                if "lost" in header:
                    raise GuestError(f"agent connection lost: {header['lost']}")
                if "error" in header:
                    done = True
                    raise agent_error(header["error"])
                done = header.get("event") == "exit" or (header.get("ok") and "event" not in header)
                yield header, data
                if done:
                    return
                if credited and header.get("event") == "data":
                    await self._send({"id": rid, "op": "credit", "n": 1})
        finally:
            self._streams.pop(rid, None)
            if credited and not done and self.alive:
                with contextlib.suppress(GuestError):  # the consumer stopped: so does the agent
                    await self._send({"id": rid, "op": "credit", "n": -1})

    async def upload(self, path: str, chunks: AsyncIterator[bytes], user: str | None = None,
                     mode: int | None = None) -> dict:
        """Write a file from an async iterator of byte chunks without holding it whole."""
        rid = self._new_id()
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            await self._send({"id": rid, "op": "write", "path": path, "user": user, "mode": mode})
            async for chunk in chunks:
                for i in range(0, len(chunk), CHUNK_SIZE):
                    if fut.done():
                        break
                    await self._send({"id": rid, "op": "chunk"}, chunk[i : i + CHUNK_SIZE])
            if not fut.done():
                await self._send({"id": rid, "op": "end"})
            header = await asyncio.wait_for(fut, 120)
        finally:
            self._waiters.pop(rid, None)
        if "error" in header:
            raise agent_error(header["error"])
        return header

    async def sync_clock(self, tolerance_ms: float = 5.0, rounds: int = 3) -> float:
        """Bring the guest's wall clock to the host's, NTP-style: the offset is measured around
        a ping (the guest's reading sits between the host's send and receive) and stepped
        away. A `configure` sets the clock when the guest reads it, which after a restore may
        be long after the host sent it. Returns the last measured offset in ms."""
        offset_ms = 0.0
        for _ in range(rounds):
            sent = time.time_ns()
            reply = await self.request("ping")
            received = time.time_ns()
            offset = (sent + received) // 2 - int(reply["time_ns"])
            offset_ms = offset / 1e6
            if abs(offset_ms) <= max(tolerance_ms, (received - sent) / 2e6):
                return offset_ms
            await self.request("step_clock", delta_ns=offset)
        return offset_ms

    async def configure(self, *, env: dict[str, str] | None = None, generation: str | None = None,
                        reseed: bool = True, cpus: int | None = None) -> dict:
        """Sync the clock (always); optionally reseed the RNG, set env, generation, CPUs."""
        return await self.request("configure", **configure_fields(
            env=env, generation=generation, reseed=reseed, cpus=cpus))


def configure_fields(*, env: dict[str, str] | None = None, generation: str | None = None,
                     reseed: bool = True, cpus: int | None = None) -> dict:
    """The fields of a `configure` request; the clock is read when this is called."""
    fields: dict = {"time_ns": time.time_ns()}
    if reseed:
        fields["entropy"] = base64.b64encode(os.urandom(64)).decode()
    if env is not None:
        fields["env"] = env
    if generation is not None:
        fields["generation"] = generation
    if cpus:
        fields["cpus"] = cpus
    return fields
