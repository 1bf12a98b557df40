"""Shared request helpers for the route modules."""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator

from fastapi import Request

from sandlot.core.service import Core
from sandlot.errors import SandlotError


def core(request: Request) -> Core:
    return request.app.state.core


async def ndjson(first: dict | None, events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Encode command events as NDJSON lines; output bytes become text, split-safe."""
    decoders = {"stdout": codecs.getincrementaldecoder("utf-8")("replace"),
                "stderr": codecs.getincrementaldecoder("utf-8")("replace")}

    def line(ev: dict) -> bytes:
        if ev["type"] in decoders:
            ev = {"type": ev["type"], "data": decoders[ev["type"]].decode(ev["data"])}
        return (json.dumps(ev) + "\n").encode()

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
