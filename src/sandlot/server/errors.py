"""One place that turns errors into HTTP answers: ``{"error": {"type", "message"}}``.

Messages name no host path: the server's own directories (data, images, run, cache, store)
are replaced wherever they appear, and errors of the host's side (storage, VMM, builds,
capacity) lose every absolute path (`public_message`). An unexpected error answers its type
only; its traceback goes to the server's log."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from sandlot.errors import (
    BuildError,
    CapacityError,
    HostUnavailableError,
    SandlotError,
    StorageError,
    VmmError,
    hide_path,
    without_paths,
)

log = logging.getLogger(__name__)

# errors raised by the host's side: any absolute path in them is the host's
HOST_SIDE = (StorageError, BuildError, VmmError, CapacityError, HostUnavailableError)
_roots: set[str] = set()
_root_re: re.Pattern | None = None


def add_host_roots(*paths: Path | str | None) -> None:
    """Directories of this host that messages must not show (the app's settings)."""
    global _root_re
    for p in paths:
        text = str(p or "").rstrip("/")
        if text.startswith("/") and text.count("/") > 1:
            _roots.add(text)
    alternatives = "|".join(re.escape(r) for r in sorted(_roots, key=len, reverse=True))
    _root_re = re.compile(rf"(?:{alternatives})(?![\w-])(?:/[^\s'\",;()\[\]{{}}]*)?"
                          ) if _roots else None


def redact(message: str, host_side: bool = False) -> str:
    """`message` without this host's paths (`host_side`: without any absolute path)."""
    if _root_re is not None:
        message = _root_re.sub(hide_path, message)
    if host_side:
        message = without_paths(message)
    return message


def public_message(exc: BaseException) -> str:
    """What an answer may say of `exc`."""
    if isinstance(exc, SandlotError):
        return redact(exc.message or str(exc) or type(exc).__name__,
                      isinstance(exc, HOST_SIDE) or type(exc) is SandlotError)
    if isinstance(exc, HTTPException):
        return redact(str(exc.detail))
    return f"internal error ({type(exc).__name__}); the server's log has the details"


HTTP_TYPES = {400: "InvalidArgumentError", 401: "AuthenticationError", 404: "NotFoundError",
              405: "InvalidArgumentError", 413: "PayloadTooLargeError",
              422: "InvalidArgumentError"}


def error_body(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": message}}


async def sandlot_error(request: Request, exc: SandlotError) -> JSONResponse:
    if exc.status >= 500:
        log.warning("%s %s -> %s: %s", request.method, request.url.path, type(exc).__name__,
                    exc.message)
    return JSONResponse(error_body(type(exc).__name__, public_message(exc)), exc.status)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return JSONResponse(error_body("InvalidArgumentError", "; ".join(parts) or "invalid request"),
                        400)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = HTTP_TYPES.get(exc.status_code, "SandlotError")
    return JSONResponse(error_body(kind, public_message(exc)), exc.status_code,
                        headers=getattr(exc, "headers", None))


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body("SandlotError", public_message(exc)), 500)
