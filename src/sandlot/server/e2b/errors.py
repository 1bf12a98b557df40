"""The one place where errors become E2B's answers.

Three shapes, one table:

    REST (control plane)     {"code": 404, "message": "..."}            HTTP status = code
    envd plain (/files, ...)  {"code": 502, "message": "..."}            HTTP status = code
    envd Connect RPCs         {"code": "not_found", "message": "..."}   status from the code

Errors of the e2b layer itself sit next to sandlot's tree:

    SandlotError
    ├── Unsupported          501  an E2B call sandlot does not serve (the message says what does)
    ├── OutputOverflow       429  a client left too much command output unread
    ├── WrongMethod          405  a path sandlot serves, with another method (an
    │                              InvalidArgumentError)
    └── SandboxNotRunning    502  an envd call for a sandbox that is not running; E2B's proxy
                                   answers this with "... was not found", which the SDK turns
                                   into SandboxNotRunningException
"""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from sandlot.errors import (
    AuthenticationError,
    CapacityError,
    CommandTimeoutError,
    ConflictError,
    HostUnavailableError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    SandboxError,
    SandlotError,
)
from sandlot.server.errors import public_message

log = logging.getLogger(__name__)


class Unsupported(SandlotError):
    """An E2B call sandlot does not serve; the message names what sandlot offers instead."""

    status = 501


class WrongMethod(InvalidArgumentError):
    """A path sandlot serves, called with a method it does not serve it with."""

    status = 405


class OutputOverflow(SandlotError):
    """A client left more command output unread than the server holds for it."""

    status = 429


class SandboxNotRunning(SandlotError):
    """An in-sandbox call for a sandbox that is not running (killed, expired or paused)."""

    status = 502

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"The sandbox {sandbox_id} was not found (it is not running)")


# sandlot error class -> Connect code. Looked up by MRO, so subclasses follow their parents.
CONNECT_CODES: dict[type[SandlotError], str] = {
    InvalidArgumentError: "invalid_argument",
    AuthenticationError: "unauthenticated",
    NotFoundError: "not_found",
    ConflictError: "already_exists",
    InvalidStateError: "failed_precondition",
    CommandTimeoutError: "deadline_exceeded",
    SandboxError: "unavailable",
    CapacityError: "unavailable",
    HostUnavailableError: "unavailable",
    SandboxNotRunning: "unavailable",
    Unsupported: "unimplemented",
    OutputOverflow: "resource_exhausted",
}
# Connect code -> HTTP status, from the Connect protocol spec.
CONNECT_STATUS: dict[str, int] = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 412, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


def _message(exc: BaseException) -> str:
    if isinstance(exc, RequestValidationError | ValidationError):
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return "; ".join(parts) or "invalid request"
    return public_message(exc)


def http_status(exc: BaseException) -> int:
    if isinstance(exc, SandlotError):
        return exc.status
    if isinstance(exc, RequestValidationError | ValidationError):
        return 400
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return exc.status_code
    return 500


def connect_code(exc: BaseException) -> str:
    if isinstance(exc, RequestValidationError | ValidationError):
        return "invalid_argument"
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return {401: "unauthenticated", 404: "not_found"}.get(exc.status_code,
                                                              "invalid_argument")
    for cls in type(exc).__mro__:
        if cls in CONNECT_CODES:
            return CONNECT_CODES[cls]
    return "internal"


def _log(where: str, exc: BaseException, status: int) -> None:
    if status >= 500 and not isinstance(exc, Unsupported | SandboxNotRunning):
        if isinstance(exc, SandlotError):
            log.warning("%s -> %s: %s", where, type(exc).__name__, _message(exc))
        else:
            log.error("unhandled error on %s", where, exc_info=exc)


def api_error(exc: BaseException, request: Request | None = None) -> JSONResponse:
    """E2B's REST error: ``{"code": <status>, "message": ...}`` with that status."""
    status = http_status(exc)
    _log(request.url.path if request else "e2b", exc, status)
    return JSONResponse({"code": status, "message": _message(exc)}, status)


def connect_error(exc: BaseException, where: str = "envd rpc") -> dict:
    """The Connect error object: ``{"code": "<code>", "message": ...}``."""
    code = connect_code(exc)
    _log(where, exc, CONNECT_STATUS[code])
    return {"code": code, "message": _message(exc)}


def connect_unary_error(exc: BaseException, where: str = "envd rpc") -> JSONResponse:
    err = connect_error(exc, where)
    return JSONResponse(err, CONNECT_STATUS[err["code"]])
