"""E2B's volume content API (`Volume.list`, `read_file`, `write_file`, `make_dir`,
`get_info`, `exists`, `update_metadata`, `remove` of a `Volume` instance), under
``/e2b/volumecontent/{volumeID}/...``: parse, one call of `core.volumes.content`, E2B's answer.

Auth: the SDK sends the volume's token (from `Volume.create`/`connect`) as
``Authorization: Bearer``; it acts for the volume's tenant, for that volume only. A sandlot
API key there (or in ``X-API-Key``) works too, for its tenant's volumes. The SDK builds these
URLs from ``E2B_VOLUME_API_URL`` (or `api_url=` per call), not from ``E2B_API_URL``: point it
at the same ``/e2b`` (docs/e2b.md, "Volumes").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from starlette.requests import ClientDisconnect

from sandlot.core.tenancy import Principal
from sandlot.errors import AuthenticationError, InvalidArgumentError
from sandlot.server.auth import bearer_key
from sandlot.server.deps import core
from sandlot.server.e2b.api import PREFIX, Body, E2BRoute
from sandlot.server.e2b.errors import Unsupported, WrongMethod
from sandlot.server.e2b.state import e2b_state

router = APIRouter(prefix=PREFIX + "/volumecontent/{volume_id}", route_class=E2BRoute,
                   include_in_schema=False)


async def _who(request: Request, volume_id: str) -> Principal:
    credential = bearer_key(request)
    if not credential:
        raise AuthenticationError("missing Authorization: Bearer <the volume's token> (the "
                                  "token Volume.create or Volume.connect gave)")
    if e2b_state(request).tokens.check_volume(volume_id, credential):
        return await core(request).volumes.holder_of(volume_id)
    try:
        return await core(request).authenticate(credential)
    except AuthenticationError:
        raise AuthenticationError(f"invalid token for volume {volume_id[:100]!r}: use the "
                                  "token Volume.create or Volume.connect gave for it (or a "
                                  "sandlot API key)") from None


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat()


def _entry(e: dict) -> dict:
    return e | {k: _time(e[k]) for k in ("atime", "mtime", "ctime")}


@router.get("/path")
async def get_info(volume_id: str, path: str, request: Request) -> dict:
    who = await _who(request, volume_id)
    return _entry(await core(request).volumes.content.stat(volume_id, path, who))


@router.get("/dir")
async def list_dir(volume_id: str, path: str, request: Request, depth: int = 1) -> list:
    who = await _who(request, volume_id)
    entries = await core(request).volumes.content.list(volume_id, path, depth, who)
    return [_entry(e) for e in entries]


@router.post("/dir")
async def make_dir(volume_id: str, path: str, request: Request, uid: int | None = None,
                   gid: int | None = None, mode: int | None = None,
                   force: bool = False) -> JSONResponse:
    # uid/gid: accepted, not applied (in a sandbox the mount's files are its user's)
    who = await _who(request, volume_id)
    e = await core(request).volumes.content.make_dir(volume_id, path, mode, force, who)
    return JSONResponse(_entry(e), 201)


class Metadata(Body):
    uid: int | None = None
    gid: int | None = None
    mode: int | None = Field(None, ge=0, le=0o7777)


@router.patch("/path")
async def update_metadata(volume_id: str, path: str, body: Metadata,
                          request: Request) -> dict:
    who = await _who(request, volume_id)
    return _entry(await core(request).volumes.content.chmod(volume_id, path, body.mode, who))


@router.delete("/path")
async def remove(volume_id: str, path: str, request: Request) -> Response:
    who = await _who(request, volume_id)
    await core(request).volumes.content.remove(volume_id, path, who)
    return Response(status_code=204)


@router.get("/file")
async def read_file(volume_id: str, path: str, request: Request) -> Response:
    who = await _who(request, volume_id)
    _size, chunks = await core(request).volumes.content.read(volume_id, path, who)
    # to its end (chunked): the file may change while it is sent
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.put("/file")
async def write_file(volume_id: str, path: str, request: Request, uid: int | None = None,
                     gid: int | None = None, mode: int | None = None,
                     force: bool = False) -> JSONResponse:
    # the body streams in (server/body.py: STREAMED); a file there is replaced, force or not
    who = await _who(request, volume_id)
    e = await core(request).volumes.content.write(volume_id, path, _body(request), mode, who)
    return JSONResponse(_entry(e), 201)


async def _body(request: Request) -> AsyncIterator[bytes]:
    """The upload as it arrives; a client gone before its end fails it (nothing is put in
    place), where a plain end of stream would put a cut file there."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise InvalidArgumentError("the client went away before the end of the file") \
            from None


METHODS = {"path": "GET, PATCH or DELETE", "dir": "GET or POST", "file": "GET or PUT"}


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def other(volume_id: str, rest: str, request: Request) -> Response:
    if rest in METHODS:
        raise WrongMethod(f"{request.method} is not allowed on /volumecontent/{{volumeID}}/"
                          f"{rest}; use {METHODS[rest]}")
    raise Unsupported(f"sandlot does not serve {request.method} /volumecontent/{{volumeID}}/"
                      f"{rest[:100]}; it serves /path, /dir and /file")
