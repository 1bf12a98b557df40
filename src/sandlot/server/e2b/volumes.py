"""E2B volumes (`Volume.create`, `connect`, `list`, `get_info`, `destroy`): core's volume
records of the key's tenant. A sandbox mounts them with `volume_mounts` (api.py); the token
of a volume is the credential of its content API (volume_content.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from sandlot.core.models import VolumeInfo
from sandlot.server.auth import who
from sandlot.server.deps import core
from sandlot.server.e2b.api import PREFIX, Body, E2BRoute, require_e2b_key
from sandlot.server.e2b.state import e2b_state

router = APIRouter(prefix=PREFIX, route_class=E2BRoute,
                   dependencies=[Depends(require_e2b_key)], include_in_schema=False)


class NewVolume(Body):
    name: str = Field(min_length=1, max_length=200)


def _volume(info: VolumeInfo) -> dict:
    return {"volumeID": info.volume_id, "name": info.name}


def _with_token(request: Request, info: VolumeInfo) -> dict:
    # the credential of the content API (volume_content.py)
    return _volume(info) | {"token": e2b_state(request).tokens.volume(info.volume_id)}


@router.post("/volumes")
async def create_volume(body: NewVolume, request: Request) -> JSONResponse:
    info = await core(request).volumes.create(body.name, who(request))
    return JSONResponse(_with_token(request, info), 201)


@router.get("/volumes")
async def list_volumes(request: Request) -> list[dict]:
    return [_volume(v) for v in await core(request).volumes.list(who(request))]


@router.get("/volumes/{volume_id}")
async def get_volume(volume_id: str, request: Request) -> dict:
    return _with_token(request, await core(request).volumes.get(volume_id, who(request)))


@router.delete("/volumes/{volume_id}")
async def delete_volume(volume_id: str, request: Request) -> Response:
    await core(request).volumes.delete(volume_id, who(request))
    return Response(status_code=204)
