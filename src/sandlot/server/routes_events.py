"""/v1/events: the caller's sandboxes and snapshots as they change, as server-sent events
(`event: sandbox` or `snapshot`, `data:` the record as GET answers it; `event: reload`: list
again). A `ready` event opens the stream: changes from then on are in it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from sandlot.core.events import Events
from sandlot.core.tenancy import Principal
from sandlot.server.auth import who
from sandlot.server.deps import core

router = APIRouter(prefix="/v1/events", tags=["events"])
EVENT_STREAM = "text/event-stream"


@router.get("", response_class=StreamingResponse, responses={
    200: {"content": {EVENT_STREAM: {}},
          "description": "Server-sent events: ready, then sandbox, snapshot or reload."}})
async def events(request: Request) -> StreamingResponse:
    """Changes to the records the key may see, pushed as they are saved on this host."""
    c = core(request)
    return StreamingResponse(sse(c.events, who(request), c.settings.stream_keepalive),
                             media_type=EVENT_STREAM,
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def sse(feed: Events, principal: Principal, keepalive: float) -> AsyncIterator[bytes]:
    changes = feed.subscribe(principal, keepalive)
    try:
        yield b"event: ready\ndata: {}\n\n"
        async for change in changes:
            if change is None:
                yield b": keepalive\n\n"
                continue
            data = json.dumps(change.record if change.record is not None else {})
            yield f"event: {change.kind}\nid: {change.id}\ndata: {data}\n\n".encode()
    finally:
        await changes.aclose()
