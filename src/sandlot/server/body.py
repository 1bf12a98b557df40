"""Request bodies are bounded: a JSON body over `Limits.body_bytes` is refused with 413 before
it is read whole (by its Content-Length, or as it streams in). File uploads are streamed to
the guest, never held, and streaming E2B RPCs are read one message at a time: those are not
bounded here. A file upload's user metadata comes in headers (`metadata_headers`)."""

from __future__ import annotations

import json
import re

from starlette.requests import Request

from sandlot.errors import PayloadTooLargeError

# (method, path) of the routes whose bodies stream through instead of being parsed whole
STREAMED = (
    ("PUT", re.compile(r"^/v1/sandboxes/[^/]+/files$")),
    ("POST", re.compile(r"^(/e2b/envd)?/files$")),
)


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
            await self._refuse(scope, send, self._error(str(declared)))
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
                await self._refuse(scope, send, self._error(f"more than {self.limit}"))
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

    async def _refuse(self, scope, send, error: PayloadTooLargeError) -> None:
        if scope.get("path", "").startswith("/e2b"):
            body = {"code": error.status, "message": error.message}
        else:
            body = {"error": {"type": type(error).__name__, "message": error.message}}
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})


METADATA_HEADER = "x-metadata-"  # Starlette's header names are lowercase


def metadata_headers(request: Request) -> dict[str, str]:
    """A file's user metadata from `X-Metadata-<key>` headers (keys lowercased), as envd."""
    return {name[len(METADATA_HEADER):]: value for name, value in request.headers.items()
            if name.startswith(METADATA_HEADER) and len(name) > len(METADATA_HEADER)}
