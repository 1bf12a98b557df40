"""/v1/sandboxes/{id}/commands: run (streamed NDJSON), background (on a terminal with `pty`),
list, attach, stdin, resize, kill."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sandlot.core.models import (
    CommandEvent,
    ExecRequest,
    Killed,
    ProcessList,
    Started,
    TerminalSize,
)
from sandlot.errors import InvalidArgumentError
from sandlot.server.auth import who
from sandlot.server.deps import core, ndjson

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/commands", tags=["commands"])
NDJSON = "application/x-ndjson"
STREAM = {200: {"description": "One CommandEvent per line: start, stdout/stderr, then exit "
                               "(or error).",
                "content": {NDJSON: {"schema": {"$ref": "#/components/schemas/CommandEvent"}},
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/Started"}}}}}


class StdinBody(BaseModel):
    data: str = ""
    eof: bool = False


class KillBody(BaseModel):
    signal: int = 9


@router.post("", response_model=None, responses=STREAM)
async def run_command(sandbox_id: str, body: ExecRequest, request: Request):
    """Run a command: its events as NDJSON, or with `background` its pid (JSON `Started`)."""
    commands = core(request).commands
    if body.background:
        return Started(pid=await commands.start(sandbox_id, body, who=who(request)))
    events = commands.run(sandbox_id, body, who=who(request))
    first = await anext(events)  # errors before the process starts are plain HTTP errors
    return StreamingResponse(ndjson(first, events, core(request).settings.stream_keepalive),
                             media_type=NDJSON)


@router.get("", response_model=ProcessList)
async def list_commands(sandbox_id: str, request: Request) -> ProcessList:
    return ProcessList(processes=await core(request).commands.list(sandbox_id,
                                                                     who=who(request)))


@router.get("/{pid}/stream", response_model=None, responses={
    200: {"description": "One CommandEvent per line.",
          "content": {NDJSON: {"schema": {"$ref": "#/components/schemas/CommandEvent"}}}}})
async def attach(sandbox_id: str, pid: int, request: Request):
    events = core(request).commands.attach(sandbox_id, pid, who=who(request))
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    return StreamingResponse(ndjson(first, events, core(request).settings.stream_keepalive),
                             media_type=NDJSON)


@router.post("/{pid}/stdin", status_code=204)
async def send_stdin(sandbox_id: str, pid: int, body: StdinBody, request: Request) -> Response:
    await core(request).commands.send_stdin(sandbox_id, pid, body.data.encode(), body.eof,
                                            who=who(request))
    return Response(status_code=204)


@router.post("/{pid}/resize", status_code=204)
async def resize(sandbox_id: str, pid: int, body: TerminalSize, request: Request) -> Response:
    """Set the size of the terminal of a command started with `pty`."""
    await core(request).commands.resize(sandbox_id, pid, body, who=who(request))
    return Response(status_code=204)


@router.post("/{pid}/kill", response_model=Killed)
async def kill(sandbox_id: str, pid: int, request: Request, body: KillBody | None = None
               ) -> Killed:
    sig = body.signal if body else 9
    if not 1 <= sig <= 64:
        raise InvalidArgumentError("signal must be between 1 and 64")
    return Killed(killed=await core(request).commands.kill(sandbox_id, pid, sig,
                                                          who=who(request)))


# Not response models, but the streams above are made of them: app.py adds their schemas.
STREAM_SCHEMAS = (CommandEvent, Started)
