"""Shared request helpers for the route modules."""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator

from fastapi import Request

from sandlot.core.commands import ExecEvent, Output, Started
from sandlot.core.models import CommandEvent
from sandlot.core.service import Core
from sandlot.errors import SandlotError


def core(request: Request) -> Core:
    return request.app.state.core


async def ndjson(first: ExecEvent | None, events: AsyncIterator[ExecEvent]
                 ) -> AsyncIterator[bytes]:
    """Encode command events as NDJSON lines (core.models.CommandEvent); output bytes become
    text, split-safe. A typed error that ends the stream becomes its last line."""
    decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                "stderr": codecs.getincrementaldecoder("utf-8")("replace")}

    def line(ev: ExecEvent) -> bytes:
        if isinstance(ev, Started):
            out = CommandEvent(type="start", pid=ev.pid)
        elif isinstance(ev, Output):
            out = CommandEvent(type=ev.stream, data=decoders[ev.stream].decode(ev.data))
        else:
            out = CommandEvent(type="exit", exit_code=ev.exit_code)
        return (out.model_dump_json(exclude_none=True) + "\n").encode()

    try:
        if first is not None:
            yield line(first)
        async for ev in events:
            yield line(ev)
    except SandlotError as e:
        error = {"type": type(e).__name__, "message": e.message or str(e)}
        yield (json.dumps({"type": "error", "error": error}) + "\n").encode()
    finally:
        await events.aclose()
