"""API key check: ``Authorization: Bearer <key>`` against hashed keys in the metadata store."""

from __future__ import annotations

from fastapi import Request

from sandlot.core.keys import owner_of
from sandlot.errors import AuthenticationError


def bearer_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return request.headers.get("x-api-key")


async def require_key(request: Request) -> None:
    key = bearer_key(request)
    if not key:
        raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
    if not await request.app.state.core.key_valid(key):
        raise AuthenticationError("invalid API key")
    request.state.owner = owner_of(key)


def owner(request: Request) -> str | None:
    """The API key a request came with, as records keep it (`keys.owner_of`)."""
    return getattr(request.state, "owner", None)
