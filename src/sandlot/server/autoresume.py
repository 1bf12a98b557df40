"""Auto-resume: a paused sandbox created with ``auto_resume`` comes back by itself when a
request needs it running (a command, a file, an envd call, a fork, a snapshot ...); reading
its record, killing, pausing, resuming or connecting to it do not count.

ASGI middleware, so sandlot's API and the E2B endpoints behave alike."""

from __future__ import annotations

import logging
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.errors import SandlotError
from sandlot.server.forward import sandbox_of

log = logging.getLogger(__name__)
# the sandbox itself (GET, DELETE) and its lifecycle calls: they never resume it by themselves
NOT_A_USE = re.compile(r"^/(?:v1|e2b|e2b/v2)/sandboxes/[^/]+"
                       r"(?:/(?:pause|resume|connect|timeout|refreshes|metrics))?/?$")


class AutoResume:
    def __init__(self, app: ASGIApp, get_core) -> None:
        self.app = app
        self.get_core = get_core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self.get_core() if scope["type"] == "http" else None
        sandbox_id = sandbox_of(scope) if core is not None else None
        if (sandbox_id is not None and sandbox_id not in core.sandboxes.live
                and not NOT_A_USE.match(scope.get("path", ""))):
            doc = await core.db.get_sandbox(sandbox_id)
            if doc and doc.get("state") == "paused" and doc.get("auto_resume"):
                try:
                    await core.sandboxes.resume(sandbox_id)
                    log.info("sandbox %s resumed by a request (auto_resume)", sandbox_id)
                except SandlotError as e:  # the request then answers as for a paused one
                    log.warning("sandbox %s: auto-resume failed: %s", sandbox_id, e.message)
        await self.app(scope, receive, send)
