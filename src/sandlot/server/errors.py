"""One place that turns errors into HTTP answers: ``{"error": {"type", "message"}}``."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from sandlot.errors import SandlotError

log = logging.getLogger(__name__)


def error_body(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "message": message}}


async def sandlot_error(request: Request, exc: SandlotError) -> JSONResponse:
    if exc.status >= 500:
        log.warning("%s %s -> %s: %s", request.method, request.url.path, type(exc).__name__,
                    exc.message)
    return JSONResponse(error_body(type(exc).__name__, exc.message or str(exc)), exc.status)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return JSONResponse(error_body("InvalidArgumentError", "; ".join(parts) or "invalid request"),
                        400)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = {401: "AuthenticationError", 404: "NotFoundError", 405: "InvalidArgumentError"}.get(
        exc.status_code, "SandlotError")
    return JSONResponse(error_body(kind, str(exc.detail)), exc.status_code)


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(error_body("SandlotError", f"internal error: {type(exc).__name__}: {exc}"),
                        500)
