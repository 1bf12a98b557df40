"""Host end of the guest agent link: an asyncio client over the virtio-serial unix socket.

One connection multiplexes many requests by id. Every op of the protocol (guest/protocol.py) has
a typed method here returning dataclasses; nothing above this module sends op names. Replies
are parsed as hostile: every field is type-checked, and a reply that does not fit is a
GuestError. Streamed events go to bounded per-request inboxes that never hold up the
connection: file reads and (with the agent's `output_credit`) command output are
flow-controlled per stream by credits, so a slow consumer back-pressures its own stream in the
guest; a stream whose inbox overflows all the same (an agent without credits, or one that
ignores them) fails alone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import fcntl
import os
import secrets
import struct
import termios
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from sandlot.errors import (
    GuestError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
)
from sandlot.guest.protocol import EXIT_EVENT, PROTO_VERSION, request_header
from sandlot.guest.volserve import VolumeServer
from sandlot.guest.wire import CHUNK_SIZE, FrameDecoder, encode

READ_WINDOW = 8  # chunks (1 MiB each) a file read may run ahead of its consumer
OUTPUT_WINDOW = 32  # output events (at most 64 KiB each) a command may run ahead
WRITE_WINDOW = 8  # chunks (1 MiB each) a file write may send ahead of the agent writing them
OUTPUT_CREDIT_BATCH = 8  # consumed output events acknowledged in one credit frame
# Why: what a stream's consumer has not taken yet stays in the server's memory. Past these
# bounds the stream ends with an error instead of holding up the connection's other streams.
INBOX_EVENTS = 1024
INBOX_BYTES = 16 << 20

_ERROR_TYPES: dict[str, type[SandlotError]] = {
    "not_found": NotFoundError,
    "invalid": InvalidArgumentError,
    "permission": InvalidArgumentError,
}


def agent_error(err: Any) -> SandlotError:
    kind = err.get("type") if isinstance(err, dict) else None
    message = err.get("message", "agent error") if isinstance(err, dict) else str(err)
    return _ERROR_TYPES.get(kind, GuestError)(str(message)[:4000])


# ---- what the agent answers -----------------------------------------------------------------


def _get(d: dict, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """`d[key]` if it has type `kind`; the guest is untrusted, so anything else is an error."""
    value = d.get(key, default)
    if value is ...:
        raise GuestError(f"agent reply lacks {key!r}")
    if value is not None and value is not default and not isinstance(value, kind):
        raise GuestError(f"agent reply field {key!r} has type {type(value).__name__}")
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise GuestError(f"agent reply field {key!r} is a bool")
    return value


@dataclass(frozen=True)
class Hello:
    proto: int
    caps: tuple[str, ...]
    generation: str = "0"


@dataclass(frozen=True)
class Configured:
    """The answer to `configure`: the guest's clock, and its CPUs and memory if they changed."""

    time_ns: int
    cpus: int | None = None
    mem_kb: int | None = None
    disk_bytes: int | None = None  # the root filesystem's size, when asked to grow it


@dataclass(frozen=True)
class FileEntry:
    """A file system entry in the guest. `type` is file, dir, symlink or other."""

    name: str
    path: str
    type: str
    size: int
    mode: int
    owner: str
    mtime: float
    target: str | None = None
    metadata: dict[str, str] | None = None  # user metadata (`user.e2b.*` xattrs)

    @classmethod
    def parse(cls, d: Any) -> FileEntry:
        if not isinstance(d, dict):
            raise GuestError("agent sent an entry that is not an object")
        metadata = _get(d, "metadata", dict, None)
        if metadata is not None and not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise GuestError("agent sent file metadata that is not strings")
        return cls(name=_get(d, "name", str), path=_get(d, "path", str),
                   type=_get(d, "type", str), size=_get(d, "size", int),
                   mode=_get(d, "mode", int), owner=_get(d, "owner", str),
                   mtime=float(_get(d, "mtime", (int, float))),
                   target=_get(d, "target", str, None), metadata=metadata or None)


@dataclass(frozen=True)
class ProcessInfo:
    """A process that `exec` started in the guest."""

    pid: int
    cmd: str
    user: str
    running: bool
    exit_code: int | None
    started_at: float
    pty: bool = False  # it runs on a terminal

    @classmethod
    def parse(cls, d: Any) -> ProcessInfo:
        if not isinstance(d, dict):
            raise GuestError("agent sent a process that is not an object")
        return cls(pid=_get(d, "pid", int), cmd=_get(d, "cmd", str), user=_get(d, "user", str),
                   running=_get(d, "running", bool), exit_code=_get(d, "exit_code", int, None),
                   started_at=float(_get(d, "started_at", (int, float))),
                   pty=_get(d, "pty", bool, False))


@dataclass(frozen=True)
class TerminalSize:
    cols: int
    rows: int

    def fields(self) -> dict:
        return {"cols": self.cols, "rows": self.rows}


@dataclass(frozen=True)
class Started:
    pid: int


@dataclass(frozen=True)
class Output:
    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class Exited:
    """A process ended: `exit_code` is negative for a signal; `timed_out` if its timeout hit."""

    exit_code: int | None
    timed_out: bool


ExecEvent = Started | Output | Exited


def _exec_event(header: dict, data: bytes) -> ExecEvent | None:
    event = header.get("event")
    if event == "start":
        return Started(_get(header, "pid", int))
    if event in ("stdout", "stderr"):
        return Output(event, data)
    if event == EXIT_EVENT:
        return Exited(_get(header, "exit_code", int, None), bool(header.get("timed_out")))
    return None


# ---- the session ----------------------------------------------------------------------------


class _Inbox:
    """The events of one stream its consumer has not taken, bounded in count and bytes.
    `put` never waits (the connection's reader must not); past the bounds the stream is
    failed with `overflow` and the rest of its events are dropped."""

    def __init__(self, max_events: int, max_bytes: int = INBOX_BYTES) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.bytes = 0
        self.overflowed = False

    def put(self, header: dict, payload: bytes) -> None:
        if self.overflowed:
            return
        if self.queue.qsize() >= self.max_events or self.bytes + len(payload) > self.max_bytes:
            self.overflowed = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.bytes = 0
            self.queue.put_nowait(({"id": None, "overflow": True}, b""))
            return
        self.bytes += len(payload)
        self.queue.put_nowait((header, payload))

    def end(self, header: dict) -> None:
        """A terminal marker (the connection was lost): always delivered."""
        self.queue.put_nowait((header, b""))

    async def get(self) -> tuple[dict, bytes]:
        header, payload = await self.queue.get()
        self.bytes -= len(payload)
        return header, payload


class LinkState(StrEnum):
    CONNECTING = "connecting"
    READY = "ready"
    CLOSED = "closed"


@dataclass
class Configure:
    """What a `configure` sets. The clock and fresh entropy are read when it is sent.

    `clock` False leaves the clock alone: a restore sends its configure before the VM runs,
    so the time in it would be stale by the time the guest reads it; `sync_clock` sets it
    right after anyway."""

    env: dict[str, str] | None = None
    generation: str | None = None
    cpus: int | None = None
    reseed: bool = True
    freeze: bool = False
    clock: bool = True
    disk_bytes: int | None = None  # grow the root filesystem once its disk is this big


    def fields(self) -> dict:
        out: dict[str, Any] = {"time_ns": time.time_ns() if self.clock else None,
                               "env": self.env,
                               "generation": self.generation, "cpus": self.cpus or None,
                               "freeze": self.freeze or None,
                               "disk_bytes": self.disk_bytes or None}
        if self.reseed:
            out["entropy"] = base64.b64encode(os.urandom(64)).decode()
        return out


def _unread(fd: int) -> int:
    """Bytes written to a unix socket that its peer has not read yet (SIOCOUTQ); 0 if unknown."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class AgentClient:
    """A session with the guest agent. Create with `await AgentClient.connect(path)`.

    `volumes` serves the guest's volume mounts (its `vreq` frames); None (a VM without
    volumes, e.g. an image build's) answers them EIO."""

    MAX_VOLUME_CALLS = 64  # a guest's requests in flight; more are answered EBUSY

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 volumes: VolumeServer | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self.volumes = volumes
        self._next_id = secrets.randbelow(1 << 30) + 1
        self._waiters: dict[int, asyncio.Future] = {}
        self._streams: dict[int, _Inbox] = {}
        self._write_lock = asyncio.Lock()
        self._flowing = asyncio.Event()  # cleared while a capture's pause holds writes back
        self._flowing.set()
        self._task: asyncio.Task | None = None
        self._calls: set[asyncio.Task] = set()
        self._write_credits: dict[int, asyncio.Semaphore] = {}  # writes' chunks in flight
        self._closed: BaseException | None = None
        self.state = LinkState.CONNECTING
        self.hello: Hello | None = None
        self.configured: Configured | None = None

    # ---- connection -----------------------------------------------------------------------

    @classmethod
    async def connect(cls, path: str, timeout: float = 30.0,
                      configure: Configure | None = None,
                      running: asyncio.Event | None = None,
                      volumes: VolumeServer | None = None) -> AgentClient:
        """Connect to the agent socket and complete the hello handshake within `timeout`.

        `configure` is sent right behind the hello, saving a round trip on the restore path;
        its answer is in `self.configured`. `running`: set once the VM runs (a restore
        connects before `cont`); unanswered hellos are re-sent only from then on.
        `volumes`: the server of the guest's volume mounts (None: it has none).

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
            client = cls(reader, writer, volumes)
            client._task = asyncio.create_task(client._read_loop())
            try:
                remaining = max(0.1, min(attempt_timeout, deadline - loop.time()))
                await client._handshake(remaining, configure, running)
                client.state = LinkState.READY
                return client
            except (TimeoutError, GuestError) as e:
                last = e
                await client.close()
                attempt_timeout = min(attempt_timeout * 2, 16.0)
            except BaseException:  # e.g. a configure too large to send: no session is left
                await client.close()
                raise
        raise GuestError(f"guest agent did not answer on {path} within {timeout:.0f}s: {last}")

    async def _handshake(self, timeout: float, configure: Configure | None,
                         running: asyncio.Event | None = None) -> None:
        nonce = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()  # the first answer to any of the hellos
        hellos: list[int] = []
        cid, cfut = self._new_id(), loop.create_future()
        if configure is not None:
            self._waiters[cid] = cfut
        end = loop.time() + timeout
        interval = 0.25  # grows: a busy guest answers late, an absent one not at all

        async def send_hello() -> None:
            rid = self._new_id()
            hellos.append(rid)
            self._waiters[rid] = fut
            await self._send(request_header(rid, "hello",
                                            {"nonce": nonce, "proto": PROTO_VERSION}))

        async def send_configure() -> None:
            assert configure is not None
            await self._send(request_header(cid, "configure", configure.fields()))

        try:
            # Re-sent periodically: the guest drops input while it thinks no host is there.
            # Only the hello is: a guest that got the first one got the configure behind it
            # (a busy guest doing the configure again for each hello re-sent only made it
            # busier: several times per child in a fork(8) here).
            await send_hello()
            if configure is not None:
                await send_configure()
            if running is not None and not running.is_set():
                started = asyncio.ensure_future(running.wait())
                try:
                    await asyncio.wait({started, fut}, timeout=max(0.01, end - loop.time()),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    started.cancel()
            while not fut.done():
                try:
                    await asyncio.wait_for(asyncio.shield(fut),
                                           min(interval, max(0.01, end - loop.time())))
                except TimeoutError:
                    if loop.time() >= end:
                        raise
                    interval = min(2.0, interval * 2)
                    await send_hello()
        except BaseException:
            # Nobody will wait for these answers any more (the caller may try a new session).
            for key in (*hellos, cid):
                self._waiters.pop(key, None)
            fut.cancel()
            cfut.cancel()
            raise
        for key in hellos:
            self._waiters.pop(key, None)
        header = fut.result()
        if "error" in header:
            raise agent_error(header["error"])
        hello = header.get("hello")
        if not isinstance(hello, dict) or hello.get("nonce") != nonce \
                or hello.get("proto") != PROTO_VERSION:
            raise GuestError(f"unexpected agent hello: {str(hello)[:200]}")
        caps = hello.get("caps") or []
        self.hello = Hello(proto=PROTO_VERSION,
                           caps=tuple(c for c in caps if isinstance(c, str))[:64],
                           generation=str(header.get("generation", "0"))[:64])
        if configure is not None:
            if header.get("id") != hellos[0]:
                # A re-sent hello was answered first: the first frames may have been dropped
                # (a configure done twice is harmless; one never done is not).
                await send_configure()
            try:
                reply = await asyncio.wait_for(cfut, max(1.0, end - loop.time()))
            except TimeoutError:
                raise GuestError("guest agent did not answer configure") from None
            finally:
                self._waiters.pop(cid, None)
            self.configured = self._configured(reply)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        for call in list(self._calls):
            call.cancel()
        self._writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        self._fail(GuestError("agent connection closed"))

    @property
    def alive(self) -> bool:
        return self._closed is None

    def has_cap(self, cap: str) -> bool:
        return self.hello is not None and cap in self.hello.caps

    @contextlib.asynccontextmanager
    async def writes_held(self, settle: float = 0.05) -> AsyncIterator[None]:
        """No frame goes to the guest meanwhile: new writes wait, and the one under way and
        what the socket already held have been read by QEMU first (waited for up to `settle`
        s). For a capture's pause: QEMU 7.2's virtio-serial writes host data into guest RAM
        even while the VM is stopped, so a frame arriving between the RAM copy and the device
        state would be in one and not the other. Best effort: a write stuck on a full socket
        (a guest that does not read) is not waited for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle
        self._flowing.clear()
        try:
            sock = self._writer.get_extra_info("socket")
            while loop.time() < deadline and (
                    self._write_lock.locked() or (sock is not None and _unread(sock.fileno()))):
                await asyncio.sleep(0.001)
            yield
        finally:
            self._flowing.set()

    # ---- plumbing -------------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id = (self._next_id + 1) % (1 << 31) or 1
        return self._next_id

    async def _send(self, header: dict, payload: bytes = b"") -> None:
        if self._closed is not None:
            raise GuestError(f"agent connection lost: {self._closed}")
        try:
            data = encode(header, payload)
        except ValueError as e:  # FrameError: the request itself is too large
            raise InvalidArgumentError(f"request too large for the guest agent: {e}") from e
        await self._flowing.wait()
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
        if "vreq" in header:
            self._volume_call(header, payload)
            return
        rid = header.get("id")
        if header.get("event") == "ack":
            credits = self._write_credits.get(rid)
            if credits is not None:
                credits.release()
            return
        inbox = self._streams.get(rid)
        if inbox is not None:
            inbox.put(header, payload)  # never waits: one slow stream holds up no other
            return
        fut = self._waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(header)

    def _volume_call(self, header: dict, payload: bytes) -> None:
        """A guest's volume request: answered by its own task (a slow disk holds up no
        other frame)."""
        vreq = header["vreq"]
        if not isinstance(vreq, int) or isinstance(vreq, bool):
            return
        server = self.volumes

        async def answer() -> None:
            if server is None or len(self._calls) > self.MAX_VOLUME_CALLS:
                fields, data = {"errno": errno.EIO if server is None else errno.EBUSY}, b""
            else:
                fields, data = await server.handle(header, payload)
            with contextlib.suppress(GuestError):
                await self._send({**fields, "vreq": vreq}, data)

        task = asyncio.create_task(answer())
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def _fail(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        self.state = LinkState.CLOSED
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(GuestError(f"agent connection lost: {exc}"))
        self._waiters.clear()
        for inbox in self._streams.values():
            inbox.end({"id": None, "lost": str(exc)})

    def _require_ready(self) -> None:
        if self.state != LinkState.READY:
            raise InvalidStateError(f"agent link is {self.state.value}",
                                    current=self.state.value, allowed=(LinkState.READY.value,))

    async def _request(self, op: str, payload: bytes = b"", reply_timeout: float | None = 30.0,
                       **fields) -> dict:
        """One request, one reply; an error reply raises the mapped sandlot error."""
        self._require_ready()
        rid = self._new_id()
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            await self._send(request_header(rid, op, fields), payload)
            header = await asyncio.wait_for(fut, reply_timeout)
        except TimeoutError:
            raise GuestError(f"guest agent did not answer {op} within {reply_timeout}s"
                             ) from None
        finally:
            self._waiters.pop(rid, None)
        if "error" in header:
            raise agent_error(header["error"])
        return header

    async def _stream(self, op: str, payload: bytes = b"", *, window: int = 0,
                      credit_events: tuple[str, ...] = (), batch: int = 1,
                      **fields) -> AsyncIterator[tuple[dict, bytes]]:
        """Send a request and yield its events until a terminal one (exit, ok or error).

        With a `window` (file reads where the agent has `read_credit`, command output where
        it has `output_credit`), the agent sends at most `window` of `credit_events` ahead,
        and each one the consumer takes earns one more (acknowledged `batch` at a time), so a
        slow consumer holds back only its own stream. Without one, events are pushed: a
        consumer that falls INBOX_EVENTS or INBOX_BYTES behind fails its stream (GuestError),
        and no other.
        """
        self._require_ready()
        rid = self._new_id()
        inbox = _Inbox(2 * window + 8 if window else INBOX_EVENTS,
                       INBOX_BYTES + window * CHUNK_SIZE if window else INBOX_BYTES)
        self._streams[rid] = inbox
        if window:
            fields["window"] = window
        done = False
        owed = 0
        try:
            await self._send(request_header(rid, op, fields), payload)
            while True:
                header, data = await inbox.get()
                if "lost" in header:
                    raise GuestError(f"agent connection lost: {header['lost']}")
                if "overflow" in header:
                    raise GuestError(
                        f"{op}: more output than the server holds for a client went unread "
                        f"({INBOX_EVENTS} events or {INBOX_BYTES >> 20} MiB); the stream "
                        "was dropped")
                if "error" in header:
                    done = True
                    raise agent_error(header["error"])
                done = header.get("event") == EXIT_EVENT or (
                    bool(header.get("ok")) and "event" not in header)
                yield header, data
                if done:
                    return
                if window and header.get("event") in credit_events:
                    owed += 1
                    if owed >= batch:
                        await self._send({"id": rid, "op": "credit", "n": owed})
                        owed = 0
        finally:
            self._streams.pop(rid, None)
            if window and not done and self.alive:
                with contextlib.suppress(GuestError):  # the consumer stopped: so does the agent
                    await self._send({"id": rid, "op": "credit", "n": -1})

    @staticmethod
    def _configured(reply: dict) -> Configured:
        if "error" in reply:
            raise agent_error(reply["error"])
        return Configured(time_ns=_get(reply, "time_ns", int), cpus=_get(reply, "cpus", int, None),
                          mem_kb=_get(reply, "mem_kb", int, None),
                          disk_bytes=_get(reply, "disk_bytes", int, None))

    # ---- session ops ----------------------------------------------------------------------

    async def ping(self) -> int:
        """The guest's wall clock, ns."""
        return _get(await self._request("ping"), "time_ns", int)

    async def configure(self, configure: Configure) -> Configured:
        """Set the clock (always); reseed the RNG, set env, generation and CPUs as given."""
        return self._configured(await self._request("configure", **configure.fields()))

    async def sync_clock(self, tolerance_ms: float = 5.0, rounds: int = 3) -> float:
        """Bring the guest's wall clock to the host's, NTP-style: the offset is measured around
        a ping (the guest's reading sits between the host's send and receive) and stepped
        away. A `configure` sets the clock when the guest reads it, which after a restore may
        be long after the host sent it. A step's answer carries the guest's clock after it, so
        it is measured the same way (no ping after it). Returns the last measured offset in ms."""
        offset_ms = 0.0
        sent = time.time_ns()
        guest = await self.ping()
        received = time.time_ns()
        for _ in range(rounds):
            offset = (sent + received) // 2 - guest
            offset_ms = offset / 1e6
            if abs(offset_ms) <= max(tolerance_ms, (received - sent) / 2e6):
                return offset_ms
            sent = time.time_ns()
            stepped = _get(await self._request("step_clock", delta_ns=offset), "time_ns", int,
                           None)
            guest = stepped if stepped is not None else await self.ping()
            received = time.time_ns()
        return offset_ms

    # ---- processes ------------------------------------------------------------------------

    async def exec(self, cmd: str, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   user: str | None = None, timeout: float | None = None,
                   stdin: bytes | None = None, track: bool = True) -> AsyncIterator[ExecEvent]:
        """Run `cmd` (bash -c) and stream its events: Started, Output..., Exited."""
        async for header, data in self._stream(
                "exec", stdin or b"", **self._output_credit(), cmd=cmd, env=env or {},
                cwd=cwd, user=user, timeout=timeout or None, stdin=stdin is not None,
                stream=True, track=None if track else False):
            event = _exec_event(header, data)
            if event is not None:
                yield event

    def _output_credit(self) -> dict:
        if not self.has_cap("output_credit"):
            return {}
        return {"window": OUTPUT_WINDOW, "credit_events": ("stdout", "stderr"),
                "batch": OUTPUT_CREDIT_BATCH}

    async def run(self, cmd: str, **kwargs) -> Exited:
        """Run `cmd` to its end, dropping its output."""
        async for event in self.exec(cmd, **kwargs):
            if isinstance(event, Exited):
                return event
        raise GuestError(f"agent ended {cmd!r} without an exit event")

    async def start(self, cmd: str, *, env: dict[str, str] | None = None,
                    cwd: str | None = None, user: str | None = None,
                    timeout: float | None = None, stdin: bytes | None = None,
                    pty: TerminalSize | None = None) -> int:
        """Start `cmd` in the background; returns its pid. Without `stdin` its input stays
        open for `send_stdin`. With `pty`, it runs on a new terminal of that size."""
        if pty is not None and not self.has_cap("pty"):
            raise InvalidArgumentError("this sandbox's guest agent predates terminals: "
                                       "rebuild its template")
        reply = await self._request("exec", stdin or b"", cmd=cmd, env=env or {}, cwd=cwd,
                                    user=user, timeout=timeout or None,
                                    stdin=stdin is not None, stream=False,
                                    keep_stdin=stdin is None,
                                    pty=None if pty is None else pty.fields())
        return _get(reply, "pid", int)

    async def resize(self, pid: int, size: TerminalSize) -> None:
        """Set the size of process `pid`'s terminal."""
        await self._request("resize", pid=pid, **size.fields())

    async def attach(self, pid: int, replay: bool = True) -> AsyncIterator[ExecEvent]:
        """The output of process `pid` (what it buffered first, with `replay`), then its end."""
        async for header, data in self._stream("attach", **self._output_credit(), pid=pid,
                                               replay=replay):
            event = _exec_event(header, data)
            if event is not None:
                yield event

    async def send_stdin(self, pid: int, data: bytes, eof: bool = False) -> None:
        await self._request("stdin", data, pid=pid, eof=eof)

    async def kill(self, pid: int, signal: int = 9) -> bool:
        """Signal process `pid`'s group; False if it had already exited."""
        return bool(_get(await self._request("kill", pid=pid, signal=signal), "killed", bool))

    async def processes(self, all: bool = False) -> list[ProcessInfo]:
        procs = _get(await self._request("ps", all=all or None), "processes", list)
        return [ProcessInfo.parse(p) for p in procs]

    # ---- files ----------------------------------------------------------------------------

    async def read(self, path: str) -> tuple[int, AsyncIterator[bytes]]:
        """Open a guest file for streaming: (size, chunks). Errors raise before any byte."""
        credited = self.has_cap("read_credit")
        events = self._stream("read", path=path, window=READ_WINDOW if credited else 0,
                              credit_events=("data",))
        header, _ = await anext(events)
        size = _get(header, "size", int, 0)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for h, data in events:
                    if h.get("event") == "data":
                        yield data
            finally:
                await events.aclose()

        return size, chunks()

    async def write(self, path: str, chunks: AsyncIterator[bytes], user: str | None = None,
                    mode: int | None = None, metadata: dict[str, str] | None = None
                    ) -> FileEntry:
        """Write a file from an async iterator of byte chunks without holding it whole;
        `metadata` replaces the file's user metadata."""
        self._require_ready()
        if metadata and not self.has_cap("file_metadata"):
            raise InvalidArgumentError("this sandbox's guest agent predates file metadata: "
                                       "rebuild its template")
        rid = self._new_id()
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        # Why a window: the agent writes in a goroutine of its own, and a slow file system
        # (a volume: each write a round trip to this host) must not fill its memory.
        credits = asyncio.Semaphore(WRITE_WINDOW) if self.has_cap("write_credit") else None
        if credits is not None:
            self._write_credits[rid] = credits
        try:
            await self._send(request_header(rid, "write", {
                "path": path, "user": user, "mode": mode, "metadata": metadata or None,
                "window": WRITE_WINDOW if credits is not None else None}))
            async for chunk in chunks:
                for i in range(0, len(chunk), CHUNK_SIZE):
                    if credits is not None:
                        await self._write_credit(credits, fut)
                    if fut.done():
                        break
                    await self._send({"id": rid, "op": "chunk"}, chunk[i : i + CHUNK_SIZE])
            if not fut.done():
                await self._send({"id": rid, "op": "end"})
            header = await asyncio.wait_for(fut, 120)
        finally:
            self._waiters.pop(rid, None)
            self._write_credits.pop(rid, None)
        if "error" in header:
            raise agent_error(header["error"])
        return FileEntry.parse(header)

    @staticmethod
    async def _write_credit(credits: asyncio.Semaphore, answered: asyncio.Future) -> None:
        """Waits until the agent has written enough to take one more chunk (or answered)."""
        take = asyncio.ensure_future(credits.acquire())
        try:
            done, _ = await asyncio.wait({take, answered}, timeout=120,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not take.done():
                take.cancel()
        if not done:
            raise GuestError("guest agent took no chunk of a file write in 120s")

    async def list_dir(self, path: str, depth: int = 1, max_entries: int | None = None
                       ) -> list[FileEntry]:
        """Entries under `path`; an agent with `list_limit` refuses a listing of more than
        `max_entries` (InvalidArgumentError) instead of walking on."""
        entries = _get(await self._request("list", path=path, depth=depth,
                                           max_entries=max_entries), "entries", list)
        return [FileEntry.parse(e) for e in entries]

    async def stat(self, path: str) -> FileEntry:
        return FileEntry.parse(await self._request("stat", path=path))

    async def exists(self, path: str) -> bool:
        return _get(await self._request("exists", path=path), "exists", bool)

    async def remove(self, path: str) -> None:
        await self._request("remove", path=path)

    async def mkdir(self, path: str, user: str | None = None) -> tuple[bool, FileEntry]:
        """Make `path` with its parents; (whether it was created, its entry)."""
        reply = await self._request("mkdir", path=path, user=user)
        return _get(reply, "created", bool), FileEntry.parse(reply)

    async def rename(self, src: str, dst: str) -> FileEntry:
        return FileEntry.parse(await self._request("rename", src=src, dst=dst))

    async def mount(self, path: str, token: str, user: str | None = None) -> None:
        """Mounts the volume `token` names at `path` (needs the `volumes` capability)."""
        if not self.has_cap("volumes"):
            raise InvalidArgumentError("this sandbox's guest agent predates volumes: rebuild "
                                       "its template")
        await self._request("mount", path=path, token=token, user=user)
