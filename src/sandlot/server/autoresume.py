"""Auto-resume: a paused sandbox created with ``auto_resume`` comes back by itself when a
request of its tenant needs it running (a command, a file, an envd call, a fork, a snapshot
...); reading its record, killing, pausing, resuming or connecting to it do not count, and
neither does a request without a credential for it.

ASGI middleware, so sandlot's API and the E2B endpoints behave alike."""

from __future__ import annotations

import logging
import re

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from sandlot.core.tenancy import NOBODY, SYSTEM, Principal, tenant_of
from sandlot.errors import NotFoundError, SandlotError
from sandlot.server.auth import bearer_key
from sandlot.server.forward import sandbox_of
from sandlot.server.ports import relay_to_host
from sandlot.server.relay import forwarded

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
        if (sandbox_id is not None and not core.sandboxes.is_running(sandbox_id, SYSTEM)
                and not NOT_A_USE.match(scope.get("path", ""))):
            try:
                who = await _caller(scope, core, sandbox_id)
                # placed as a resume through the API is (core/placement.py)
                rec = await core.placement.resume_on_use(sandbox_id, who,
                                                         placed=forwarded(scope))
                if rec is not None:
                    log.info("sandbox %s resumed by a request (auto_resume) on %s",
                             sandbox_id, rec.host)
                    if await relay_to_host(scope, receive, send, core, rec.host):
                        return  # it runs on another host now: answered there
            except SandlotError as e:  # the request then answers as for a paused one
                log.warning("sandbox %s: auto-resume failed: %s", sandbox_id, e.message)
        await self.app(scope, receive, send)


async def _caller(scope: Scope, core, sandbox_id: str) -> Principal:
    """Who the request acts for, as far as waking `sandbox_id` goes: its API key's tenant, or
    the sandbox's own tenant for its envd access token; else nobody."""
    conn = HTTPConnection(scope)
    token = conn.headers.get("x-access-token")
    e2b = getattr(scope["app"].state, "e2b", None)
    if token and e2b is not None:
        if not e2b.tokens.check(sandbox_id, token):
            return NOBODY
        try:
            return tenant_of((await core.sandboxes.get(sandbox_id, SYSTEM)).owner)
        except NotFoundError:
            return NOBODY
    try:
        return await core.authenticate(bearer_key(conn))
    except SandlotError:
        return NOBODY
