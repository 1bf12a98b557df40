"""envd's ``process.Process`` service on sandlot's agent: Start (with or without a PTY),
Connect, List, SendInput, StreamInput, CloseStdin, SendSignal, Update (a PTY's size).

A command runs as ``exec <cmd> <args...>`` under the agent's ``bash -c``; the SDK's
``/bin/bash -l -c <cmd>`` thus becomes a login shell, as on E2B. Output is followed through an
`EventPump`, so a client that stops reading never stalls the sandbox's agent link.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
from collections import deque
from collections.abc import AsyncIterator

from sandlot.core.commands import ExecEvent, Exited, Output
from sandlot.core.models import ExecRequest, ProcessInfo, TerminalSize
from sandlot.errors import InvalidArgumentError, NotFoundError, SandlotError
from sandlot.server.e2b.connect import b64decode, b64encode, field
from sandlot.server.e2b.convert import resolve
from sandlot.server.e2b.errors import OutputOverflow
from sandlot.server.e2b.state import Envd, ProcessConfig

# Why: output a client has not read yet is held here; past this the stream ends with
# resource_exhausted (the process keeps running and `commands.connect(pid)` picks it up).
MAX_UNREAD = 16 << 20
SIGNALS = {"SIGNAL_SIGKILL": signal.SIGKILL, "SIGNAL_SIGTERM": signal.SIGTERM,
           int(signal.SIGKILL): signal.SIGKILL, int(signal.SIGTERM): signal.SIGTERM}


class EventPump:
    """Reads an event stream in its own task into a bounded buffer."""

    def __init__(self, events: AsyncIterator[ExecEvent], limit: int = MAX_UNREAD) -> None:
        self._events = events
        self._limit = limit
        self._items: deque[ExecEvent] = deque()
        self._size = 0
        self._more = asyncio.Event()
        self._done = False
        self._error: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for ev in self._events:
                n = len(ev.data) if isinstance(ev, Output) else 0
                if self._size + n > self._limit:
                    raise OutputOverflow(
                        f"more than {self._limit >> 20} MiB of output went unread; the process "
                        "keeps running: reconnect with commands.connect(pid)")
                self._items.append(ev)
                self._size += n
                self._more.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader
            self._error = e
        finally:
            self._done = True
            self._more.set()
            with contextlib.suppress(Exception):
                await self._events.aclose()

    async def get(self, idle: float | None) -> ExecEvent | None:
        """The next event; None after `idle` seconds without one; StopAsyncIteration at the
        end (or the stream's error)."""
        while not self._items:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._more.clear()
            try:
                await asyncio.wait_for(self._more.wait(), idle)
            except TimeoutError:
                return None
        ev = self._items.popleft()
        self._size -= len(ev.data) if isinstance(ev, Output) else 0
        return ev

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


def _event(kind: str, value: dict) -> dict:
    return {"event": {kind: value}}


def _end(code: int) -> dict:
    end = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
    if code:
        end["error"] = f"exit status {code}"
    return _event("end", end)


async def _follow(ctx: Envd, pid: int, pty: bool = False) -> AsyncIterator[dict]:
    """A process's events as envd's; a terminal's output is `pty` data."""
    pump = EventPump(ctx.core.commands.attach(ctx.sandbox_id, pid, who=ctx.who))
    try:
        while True:
            try:
                ev = await pump.get(ctx.keepalive)
            except StopAsyncIteration:
                # The stream ended without the process's end: its sandbox went (killed or
                # paused), which the SDKs know by envd's proxy's "... was not found".
                ctx.check_running()
                return
            except SandlotError:
                ctx.check_running()  # a sandbox killed or paused mid-command
                raise
            if ev is None:
                yield _event("keepalive", {})
            elif isinstance(ev, Output):
                yield _event("data", {"pty" if pty else ev.stream: b64encode(ev.data)})
            elif isinstance(ev, Exited):
                yield _end(ev.exit_code or 0)
                return
    finally:
        await pump.close()


def _pid(ctx: Envd, msg: dict) -> int:
    sel = field(msg, "process") or {}
    if sel.get("pid") is not None:
        return int(sel["pid"])
    if sel.get("tag") is not None:
        pid = ctx.state.pid_for_tag(ctx.sandbox_id, str(sel["tag"]))
        if pid is None:
            raise NotFoundError(f"process with tag {sel['tag']!r} not found")
        return pid
    raise InvalidArgumentError("the process selector needs a pid or a tag")


def _stdin_bytes(inp: dict | None) -> bytes:
    """A process's input: `stdin` for a command, `pty` for a terminal (both its stdin)."""
    inp = inp or {}
    return b64decode(inp.get("pty") if "pty" in inp else inp.get("stdin"))


def _size(msg: dict) -> TerminalSize | None:
    pty = field(msg, "pty")
    if not pty:
        return None
    size = pty.get("size") or {}
    try:
        return TerminalSize(cols=int(size.get("cols") or 0), rows=int(size.get("rows") or 0))
    except ValueError as e:
        raise InvalidArgumentError(f"invalid PTY size {size}: cols and rows are 1-4096") from e


async def start(ctx: Envd, msg: dict) -> AsyncIterator[dict]:
    size = _size(msg)
    proc = field(msg, "process") or {}
    cmd = proc.get("cmd") or ""
    args = [str(a) for a in proc.get("args") or []]
    if not cmd:
        raise InvalidArgumentError("process.cmd is empty")
    envs = {str(k): str(v) for k, v in (proc.get("envs") or {}).items()}
    cwd = resolve(proc["cwd"], ctx.user) if proc.get("cwd") else None
    tag = field(msg, "tag")
    req = ExecRequest(cmd="exec " + shlex.join([cmd, *args]), env=envs, cwd=cwd, user=ctx.user,
                      timeout=ctx.timeout or 0, pty=size, background=True,
                      # An empty stdin closes it at once; None keeps it open for SendInput
                      # (a terminal's input is always open).
                      stdin=None if field(msg, "stdin") or size else "")
    pid = await ctx.core.commands.start(ctx.sandbox_id, req, who=ctx.who)
    ctx.state.remember(ctx.sandbox_id, pid, ProcessConfig(cmd, args, envs, cwd, tag))
    yield _event("start", {"pid": pid})
    async for m in _follow(ctx, pid, pty=size is not None):
        yield m


async def connect(ctx: Envd, msg: dict) -> AsyncIterator[dict]:
    pid = _pid(ctx, msg)
    known = {p.pid: p for p in await ctx.core.commands.list(ctx.sandbox_id, all=True, who=ctx.who)}
    if pid not in known:
        raise NotFoundError(f"process with pid {pid} not found")
    yield _event("start", {"pid": pid})
    async for m in _follow(ctx, pid, pty=known[pid].pty):
        yield m


def _config(ctx: Envd, p: ProcessInfo) -> tuple[dict, str | None]:
    cfg = ctx.state.processes.get((ctx.sandbox_id, p.pid))
    if cfg is None:
        line = p.cmd
        try:
            parts = shlex.split(line[5:]) if line.startswith("exec ") else []
        except ValueError:
            parts = []
        cfg = ProcessConfig(parts[0], parts[1:], {}, None) if parts else \
            ProcessConfig("/bin/bash", ["-c", line], {}, None)
    out = {"cmd": cfg.cmd, "args": cfg.args, "envs": cfg.envs}
    if cfg.cwd:
        out["cwd"] = cfg.cwd
    return out, cfg.tag


async def list_(ctx: Envd, msg: dict) -> dict:
    procs = await ctx.core.commands.list(ctx.sandbox_id, who=ctx.who)
    ctx.state.forget_except(ctx.sandbox_id, {p.pid for p in procs})
    out = []
    for p in procs:
        config, tag = _config(ctx, p)
        info = {"config": config, "pid": p.pid}
        if tag is not None:
            info["tag"] = tag
        out.append(info)
    return {"processes": out}


async def send_input(ctx: Envd, msg: dict) -> dict:
    await ctx.core.commands.send_stdin(ctx.sandbox_id, _pid(ctx, msg),
                                       _stdin_bytes(field(msg, "input")), who=ctx.who)
    return {}


async def close_stdin(ctx: Envd, msg: dict) -> dict:
    await ctx.core.commands.send_stdin(ctx.sandbox_id, _pid(ctx, msg), b"", eof=True, who=ctx.who)
    return {}


async def send_signal(ctx: Envd, msg: dict) -> dict:
    sig = SIGNALS.get(field(msg, "signal"))
    if sig is None:
        raise InvalidArgumentError("signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
    pid = _pid(ctx, msg)
    # Ask ps first: the agent's own "killed" flag can read False when the process dies
    # between the signal and the reply.
    if pid not in {p.pid for p in await ctx.core.commands.list(ctx.sandbox_id, who=ctx.who)}:
        raise NotFoundError(f"process with pid {pid} not found (it is not running)")
    await ctx.core.commands.kill(ctx.sandbox_id, pid, int(sig), who=ctx.who)
    return {}


async def stream_input(ctx: Envd, messages: AsyncIterator[dict]) -> dict:
    pid = None
    async for m in messages:
        if "start" in m:
            pid = _pid(ctx, m["start"] or {})
        elif "data" in m:
            if pid is None:
                raise InvalidArgumentError("StreamInput must open with a start event")
            data = _stdin_bytes(field(m["data"] or {}, "input"))
            if data:
                await ctx.core.commands.send_stdin(ctx.sandbox_id, pid, data, who=ctx.who)
    return {}


async def update(ctx: Envd, msg: dict) -> dict:
    size = _size(msg)
    if size is None:
        raise InvalidArgumentError("Update needs pty.size")
    await ctx.core.commands.resize(ctx.sandbox_id, _pid(ctx, msg), size, who=ctx.who)
    return {}


_SELECTOR = {"pid": "uint32", "tag": "string"}
_INPUT = {"stdin": "bytes", "pty": "bytes"}
_PTY = {"size": {"cols": "uint32", "rows": "uint32"}}
# Each method's request message (envd's process.proto), checked before its handler runs.
REQUESTS = {
    "Start": {"process": {"cmd": "string", "args": ["repeated", "string"],
                          "envs": ["map", "string"], "cwd": "string"},
              "pty": _PTY, "tag": "string", "stdin": "bool"},
    "Connect": {"process": _SELECTOR},
    "List": {},
    "SendInput": {"process": _SELECTOR, "input": _INPUT},
    "StreamInput": {"start": {"process": _SELECTOR}, "data": {"input": _INPUT},
                    "keepalive": {}},
    "SendSignal": {"process": _SELECTOR, "signal": "enum"},
    "CloseStdin": {"process": _SELECTOR},
    "Update": {"process": _SELECTOR, "pty": _PTY},
}
UNARY = {"List": list_, "SendInput": send_input, "CloseStdin": close_stdin,
         "SendSignal": send_signal, "Update": update}
SERVER_STREAM = {"Start": start, "Connect": connect}
CLIENT_STREAM = {"StreamInput": stream_input}
