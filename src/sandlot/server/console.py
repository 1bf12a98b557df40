"""/console: the web console's static files (console/ at the repo root, built by `make setup`
into console/dist), served by this server: no other service, nothing fetched from elsewhere.
The console signs in with an API key and calls /v1 like any client (docs/console.md)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

DEFAULT_DIST = Path(__file__).resolve().parents[3] / "console" / "dist"
MISSING = ("the console is not built: run `make setup` (it builds console/ into console/dist), "
           "or set SANDLOT_CONSOLE_DIR to a built console\n")
HEADERS = {  # its own files only: no request leaves the deployment
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data: blob:; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


class ConsoleFiles(StaticFiles):
    """The built files, with headers that keep the console to this origin."""

    async def get_response(self, path: str, scope):  # type: ignore[no-untyped-def]
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


def mount_console(app: FastAPI, built: Path | None) -> None:
    """Serve the console at /console/ from `built` (default console/dist), or a message
    saying how to build it."""
    dist = built or DEFAULT_DIST

    @app.get("/console", include_in_schema=False)
    async def console_root() -> RedirectResponse:
        return RedirectResponse("/console/")

    if (dist / "index.html").is_file():
        app.mount("/console/", ConsoleFiles(directory=dist, html=True), name="console")
        return

    @app.get("/console/{path:path}", include_in_schema=False)
    async def console_missing(path: str) -> PlainTextResponse:
        return PlainTextResponse(MISSING, status_code=503)
