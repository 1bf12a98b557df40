"""Request bodies are bounded: a JSON body over `Limits.body_bytes` is refused with 413 before
it is read whole (by its Content-Length, or as it streams in). File uploads are streamed to
the guest, never held, and streaming E2B RPCs are read one message at a time: those are not
bounded here. A file upload's user metadata comes in headers (`metadata_headers`).

A refusal lingers (RFC 9112 section 9.6): the client may still be sending the body, and a
socket closed with unread data in its receive buffer sends a TCP reset, which can destroy the
answer before the client reads it (uvicorn closes at once after a `connection: close`
answer). So the answer is sent whole but not ended, the rest of the body is read and dropped,
up to `LINGER_BYTES` or `LINGER_SECONDS`, and only then is the answer ended and the
connection closed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

from starlette.requests import Request

from sandlot.errors import PayloadTooLargeError

# (method, path) of the routes whose bodies stream through instead of being parsed whole
STREAMED = (
    ("PUT", re.compile(r"^/v1/sandboxes/[^/]+/files$")),
    ("POST", re.compile(r"^(/e2b/envd)?/files$")),
    ("PUT", re.compile(r"^/e2b/volumecontent/[^/]+/file$")),
)


LINGER_BYTES = 64 << 20  # what a refused request may still send, read and dropped
LINGER_SECONDS = 10.0  # and for how long at most


class BodyLimit:
    """ASGI middleware: 413 PayloadTooLargeError for a body over `limit` bytes."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _streamed(self, scope) -> bool:
        method, path = scope.get("method", ""), scope.get("path", "")
        if any(method == m and pattern.match(path) for m, pattern in STREAMED):
            return True
        headers = dict(scope.get("headers") or ())
        return headers.get(b"content-type", b"").startswith(b"application/connect+")

    def _error(self, size: str) -> PayloadTooLargeError:
        return PayloadTooLargeError(f"the request body is {size} bytes; the limit is "
                                    f"{self.limit} (SANDLOT_MAX_BODY_BYTES)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self._streamed(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        try:
            declared = int(headers.get(b"content-length", b"-1"))
        except ValueError:
            declared = -1
        if declared > self.limit:
            # A client that waits for "100 Continue" (never sent once an answer starts)
            # sends no body: nothing to wait for.
            linger = headers.get(b"expect", b"").lower() != b"100-continue"
            await self._refuse(scope, receive, send, self._error(str(declared)), linger)
            return
        # Read it here, up to the limit (the route would read it whole anyway), then hand it
        # on: an error raised while the route reads is not ours to shape.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(scope, receive, send,
                                   self._error(f"more than {self.limit}"), True)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, error: PayloadTooLargeError,
                      linger: bool) -> None:
        if scope.get("path", "").startswith("/e2b"):
            body = {"code": error.status, "message": error.message}
        else:
            body = {"error": {"type": type(error).__name__, "message": error.message}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        # The whole answer, not yet ended: the server keeps the connection (and reads) until
        # the end, so the client has the answer before any reset.
        await send({"type": "http.response.body", "body": data, "more_body": True})
        if linger:
            await _drop_body(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drop_body(receive) -> None:
    """Read and drop the rest of a request's body, up to `LINGER_BYTES` or `LINGER_SECONDS`
    (a client that sends more or longer meets a closed connection; it has the answer)."""
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            while dropped <= LINGER_BYTES:
                message = await receive()
                if message["type"] != "http.request":  # the client went away
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


METADATA_HEADER = "x-metadata-"  # Starlette's header names are lowercase


def metadata_headers(request: Request) -> dict[str, str]:
    """A file's user metadata from `X-Metadata-<key>` headers (keys lowercased), as envd."""
    return {name[len(METADATA_HEADER):]: value for name, value in request.headers.items()
            if name.startswith(METADATA_HEADER) and len(name) > len(METADATA_HEADER)}
