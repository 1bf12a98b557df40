"""An ASGI request streamed on to an HTTP server, and its answer streamed back: what
forwarding to another host (forward.py) and port URLs (ports.py) share."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
# What a host of the deployment says on its calls to another (forward.py): the peer token, the
# tenant a call acts for, the parent of a fork child. Never relayed from a client, whose own
# would otherwise reach the next host beside a real token.
FORWARDED = "x-sandlot-forwarded"  # its value: the deployment's peer token
PRINCIPAL = "x-sandlot-principal"  # the tenant a peer's call acts for ("; admin")
FORKED_FROM = "x-sandlot-forked-from"  # on a fork child's create sent to another host
PEER_HEADERS = {FORWARDED.encode(), PRINCIPAL.encode(), FORKED_FROM.encode()}
# request and response headers that belong to one connection, not to the message, and the
# peers' own: none is passed on
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
              b"upgrade", b"proxy-authorization", b"proxy-authenticate", b"host", *PEER_HEADERS}


async def request_body(receive: Receive) -> AsyncIterator[bytes]:
    """The request's body as it arrives (ends early if the client goes)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        if message.get("body"):
            yield message["body"]
        if not message.get("more_body", False):
            return


async def send_answer(send: Send, response: httpx.Response, where: str) -> None:
    """Stream `response` (opened with stream=True) to the client, and close it; an answer
    that breaks off midway is logged (`where`: whose it was), the client's stream just ends."""
    try:
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw
                                if k.lower() not in HOP_BY_HOP]})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except (httpx.HTTPError, OSError) as e:
        log.warning("the answer of %s broke off: %s", where, e)
    finally:
        await response.aclose()


def forwarded(scope: Scope) -> bool:
    """A request another host of the deployment sent here (a client cannot fake one: the
    header must carry the deployment's peer token)."""
    peers = getattr(scope["app"].state, "peers", None)
    if peers is None or not peers.token:
        return False
    return any(k == FORWARDED.encode() and v == peers.token.encode()
               for k, v in scope.get("headers") or ())
