"""API keys: ``Authorization: Bearer <key>`` (or ``X-API-Key``) names who a request acts for,
a `Principal` (core/tenancy.py), which every core call that names an object is given."""

from __future__ import annotations

from fastapi import Request
from starlette.requests import HTTPConnection

from sandlot.core.tenancy import Principal
from sandlot.errors import PermissionDeniedError
from sandlot.server.forward import peer_principal


def bearer_key(request: HTTPConnection) -> str | None:
    """The API key a request (or a WebSocket's handshake) carries."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return request.headers.get("x-api-key")


async def require_key(request: Request) -> None:
    """Authenticate the request (AuthenticationError: 401) and keep who it acts for: its
    key's tenant, or, on a call of another host of the deployment, the tenant it names."""
    request.state.principal = (peer_principal(request.scope) or
                               await request.app.state.core.authenticate(bearer_key(request)))


def who(request: Request) -> Principal:
    """Who an authenticated request acts for."""
    return request.state.principal


async def require_admin(request: Request) -> None:
    """An operator's call (the deployment's hosts): admin keys only (403 for others)."""
    if not who(request).admin:
        raise PermissionDeniedError("this call is for the deployment's operators (an admin "
                                    "key); this key's tenant cannot make it")
