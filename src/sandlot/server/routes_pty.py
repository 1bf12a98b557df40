"""GET /v1/sandboxes/{id}/pty: a terminal over a WebSocket (docs/api.md, "Terminals over a
WebSocket"), on the commands API's terminals (core/commands.py): the shell starts as a
background command with `pty`, its output is that command's stream, input its stdin.

A browser cannot set headers on a WebSocket, so the API key comes in the first message, a
JSON text frame (never in the URL); nothing else is read before it. After it, binary frames
are the terminal's bytes both ways, text frames JSON control messages. A refusal closes with a
code (1008 for the key, 4000 + the HTTP status of the error otherwise) after an ``error``
message saying why. A closed socket leaves the terminal's process running: the next socket
may attach to it by `pid`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.websockets import WebSocketDisconnect, WebSocketState

from sandlot.core.commands import Exited, Output
from sandlot.core.models import ExecRequest, TerminalSize
from sandlot.core.tenancy import Principal
from sandlot.errors import AuthenticationError, NotFoundError, SandlotError
from sandlot.server.errors import public_message
from sandlot.server.relay import forwarded

log = logging.getLogger(__name__)
router = APIRouter(tags=["commands"])
FIRST_MESSAGE_WAIT = 30.0  # s a socket may stay open without saying who it is
POLICY_VIOLATION = 1008  # the close code of a missing or refused key
REASON_BYTES = 123  # the most a close frame's reason may hold
SHELL = "if command -v bash >/dev/null; then exec bash -i -l; else exec sh -i -l; fi"


class PtyOpen(BaseModel):
    """The first message: who, and the terminal to open (or `pid`, one to attach to)."""

    model_config = ConfigDict(extra="forbid")
    api_key: str
    cols: int = Field(80, ge=1, le=4096)
    rows: int = Field(24, ge=1, le=4096)
    cmd: str | None = Field(None, min_length=1, description="default: a login shell")
    cwd: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None
    timeout: float | None = Field(None, ge=0, description="s; none by default")
    pid: int | None = Field(None, description="attach to this running process instead (its "
                                              "size set to cols x rows if they are given)")

    @model_validator(mode="after")
    def _one_or_the_other(self) -> PtyOpen:
        started = {"cmd", "cwd", "env", "user", "timeout"} & self.model_fields_set
        if self.pid is not None and started:
            raise ValueError(f"{', '.join(sorted(started))}: for a new terminal; "
                             "pid attaches to a running one")
        return self


class Resize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    cols: int = Field(ge=1, le=4096)
    rows: int = Field(ge=1, le=4096)


class Refused(Exception):
    """The socket ends: its close code, and the error said before it."""

    def __init__(self, code: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.code, self.kind, self.message = code, kind, message

    @classmethod
    def of(cls, e: SandlotError) -> Refused:
        code = POLICY_VIOLATION if isinstance(e, AuthenticationError) else 4000 + e.status
        return cls(code, type(e).__name__, public_message(e))


def _invalid(message: str) -> Refused:
    return Refused(4400, "InvalidArgumentError", message)


@router.websocket("/v1/sandboxes/{sandbox_id}/pty")
async def pty(websocket: WebSocket, sandbox_id: str) -> None:
    await websocket.accept()
    try:
        opened, who = await _open(websocket)
        await _serve(websocket, sandbox_id, opened, who)
    except Refused as e:
        await _close(websocket, e)
    except WebSocketDisconnect:
        pass


async def _open(websocket: WebSocket) -> tuple[PtyOpen, Principal]:
    """The first message, authenticated first: what is wrong with the rest is said only to
    a caller with a key."""
    try:
        message = await asyncio.wait_for(websocket.receive(), FIRST_MESSAGE_WAIT)
    except TimeoutError:
        raise Refused(POLICY_VIOLATION, "AuthenticationError",
                      f"no first message with an api_key within {FIRST_MESSAGE_WAIT:g}s"
                      ) from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    try:
        first = json.loads(message.get("text") or "")
    except ValueError:
        first = None
    key = first.get("api_key") if isinstance(first, dict) else None
    if not isinstance(key, str) or not key:
        raise Refused(POLICY_VIOLATION, "AuthenticationError",
                      'the first message must be a JSON text frame {"api_key": ...}')
    try:
        who = await websocket.app.state.core.authenticate(key)
    except SandlotError as e:
        raise Refused.of(e) from None
    try:
        return PtyOpen.model_validate(first), who
    except ValidationError as e:
        raise _invalid(_problems(e)) from None


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
                     for err in e.errors()[:5])


async def _serve(websocket: WebSocket, sandbox_id: str, opened: PtyOpen, who: Principal
                 ) -> None:
    core = websocket.app.state.core
    commands = core.commands
    try:
        resumed = None
        with contextlib.suppress(SandlotError):  # a paused sandbox then answers as one
            # a terminal is a use, placed as a resume through the API is
            resumed = await core.placement.resume_on_use(
                sandbox_id, who, placed=forwarded(websocket.scope))
        if resumed is not None and resumed.host and resumed.host != core.host_id:
            raise Refused(4503, "HostUnavailableError",
                          f"sandbox {sandbox_id} was resumed on host {resumed.host}; open "
                          "the terminal again to reach it there")
        pid = opened.pid
        if pid is None:
            size = TerminalSize(cols=opened.cols, rows=opened.rows)
            pid = await commands.start(sandbox_id, ExecRequest(
                cmd=opened.cmd or SHELL, env=opened.env, cwd=opened.cwd, user=opened.user,
                timeout=opened.timeout, background=True, pty=size), who=who)
        elif all(p.pid != pid for p in await commands.list(sandbox_id, all=True, who=who)):
            raise NotFoundError(f"no process {pid} in sandbox {sandbox_id}")
        elif {"cols", "rows"} & opened.model_fields_set:
            await commands.resize(sandbox_id, pid, TerminalSize(cols=opened.cols,
                                                                rows=opened.rows), who=who)
    except SandlotError as e:
        raise Refused.of(e) from None
    await websocket.send_text(json.dumps({"type": "start", "pid": pid}))
    events = commands.attach(sandbox_id, pid, who=who)
    output = asyncio.ensure_future(_output(websocket, events))
    reading = asyncio.ensure_future(_input(websocket, sandbox_id, pid, who, commands))
    try:
        done, _ = await asyncio.wait({output, reading}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in (output, reading):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await events.aclose()


async def _output(websocket: WebSocket, events) -> None:
    """The terminal's output as binary frames; at its end the exit (or the error that ended
    it), then the close."""
    try:
        while (event := await anext(events, None)) is not None:
            if isinstance(event, Exited):
                await websocket.send_text(json.dumps({"type": "exit",
                                                      "exit_code": event.exit_code}))
                await websocket.close(1000, "exited")
                return
            if isinstance(event, Output) and event.data:
                await websocket.send_bytes(event.data)
    except SandlotError as e:
        raise Refused.of(e) from None
    await websocket.close(1000, "the stream ended")


async def _input(websocket: WebSocket, sandbox_id: str, pid: int, who: Principal,
                 commands) -> None:
    """Binary frames to the terminal's stdin, resizes to its size, until the client goes.
    A call the guest refuses (the process just exited) is said, not fatal; a message that
    is not the protocol's ends the socket."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        try:
            if message.get("bytes") is not None:
                await commands.send_stdin(sandbox_id, pid, message["bytes"], who=who)
            else:
                size = _resize(message.get("text") or "")
                await commands.resize(sandbox_id, pid, size, who=who)
        except SandlotError as e:
            await websocket.send_text(json.dumps(
                {"type": "error", "error": {"type": type(e).__name__,
                                            "message": public_message(e)}}))


def _resize(text: str) -> TerminalSize:
    try:
        msg = Resize.model_validate_json(text)
    except ValidationError as e:
        raise _invalid('a text frame is a control message, {"type": "resize", "cols": n, '
                       f'"rows": n}}: {_problems(e)}') from None
    if msg.type != "resize":
        raise _invalid(f"unknown control message type {msg.type!r} (known: resize)")
    return TerminalSize(cols=msg.cols, rows=msg.rows)


async def _close(websocket: WebSocket, e: Refused) -> None:
    """Say why, then close with the code (the reason cut to what a close frame holds)."""
    if websocket.application_state != WebSocketState.CONNECTED:
        return
    with contextlib.suppress(Exception):  # the client may be gone already
        await websocket.send_text(json.dumps({"type": "error",
                                              "error": {"type": e.kind,
                                                        "message": e.message}}))
        reason = e.message.encode()[:REASON_BYTES].decode(errors="ignore")
        await websocket.close(e.code, reason)

