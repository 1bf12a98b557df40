"""/v1/sandboxes/{id}/commands: run (streamed NDJSON), background, list, attach, stdin, kill."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sandlot.core.models import ExecRequest
from sandlot.errors import InvalidArgumentError
from sandlot.server.deps import core, ndjson

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/commands", tags=["commands"])
NDJSON = "application/x-ndjson"


class StdinBody(BaseModel):
    data: str = ""
    eof: bool = False


class KillBody(BaseModel):
    signal: int = 9


@router.post("", response_model=None)
async def run_command(sandbox_id: str, body: ExecRequest, request: Request):
    commands = core(request).commands
    if body.background:
        return {"pid": await commands.start_background(sandbox_id, body)}
    events = commands.exec(sandbox_id, body)
    first = await anext(events)  # errors before the process starts are plain HTTP errors
    return StreamingResponse(ndjson(first, events), media_type=NDJSON)


@router.get("")
async def list_commands(sandbox_id: str, request: Request) -> dict:
    reply = await core(request).commands.agent_call(sandbox_id, "ps")
    return {"processes": reply["processes"]}


@router.get("/{pid}/stream")
async def attach(sandbox_id: str, pid: int, request: Request):
    events = core(request).commands.attach(sandbox_id, pid)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    return StreamingResponse(ndjson(first, events), media_type=NDJSON)


@router.post("/{pid}/stdin", status_code=204)
async def send_stdin(sandbox_id: str, pid: int, body: StdinBody, request: Request) -> Response:
    await core(request).commands.agent_call(sandbox_id, "stdin", body.data.encode(), pid=pid,
                                             eof=body.eof)
    return Response(status_code=204)


@router.post("/{pid}/kill")
async def kill(sandbox_id: str, pid: int, request: Request, body: KillBody | None = None) -> dict:
    sig = body.signal if body else 9
    if not 1 <= sig <= 64:
        raise InvalidArgumentError("signal must be between 1 and 64")
    reply = await core(request).commands.agent_call(sandbox_id, "kill", pid=pid, signal=sig)
    return {"killed": reply["killed"]}
