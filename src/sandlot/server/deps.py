"""Shared request helpers for the route modules."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request

from sandlot.core.commands import ExecEvent, Output, Started
from sandlot.core.models import CommandEvent
from sandlot.core.service import Core
from sandlot.errors import SandlotError
from sandlot.server.errors import public_message


def core(request: Request) -> Core:
    return request.app.state.core


async def ndjson(first: ExecEvent | None, events: AsyncIterator[ExecEvent],
                 keepalive: float | None = None) -> AsyncIterator[bytes]:
    """Encode command events as NDJSON lines (core.models.CommandEvent); output bytes become
    text, split-safe. A typed error that ends the stream becomes its last line. While a
    command prints nothing, a `keepalive` line goes out every `keepalive` seconds, so
    clients and proxies that drop a silent response (Node's fetch does after 300 s) do not."""
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

    pending: asyncio.Future | None = None
    try:
        if first is not None:
            yield line(first)
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=keepalive)
            if not done:
                yield b'{"type":"keepalive"}\n'
                continue
            try:
                ev = pending.result()
            except StopAsyncIteration:
                pending = None
                break
            pending = None
            yield line(ev)
    except SandlotError as e:
        error = {"type": type(e).__name__, "message": public_message(e)}
        yield (json.dumps({"type": "error", "error": error}) + "\n").encode()
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await events.aclose()
