"""/v1/sandboxes/{id}/files: streamed download and upload, list, stat, exists, rm, mkdir, mv."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sandlot.server.deps import core

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])


class MkdirBody(BaseModel):
    path: str
    user: str | None = None


class RenameBody(BaseModel):
    src: str
    dst: str


@router.get("")
async def download(sandbox_id: str, path: str, request: Request) -> StreamingResponse:
    size, chunks = await core(request).files.read_file(sandbox_id, path)
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"content-length": str(size)})


@router.put("")
async def upload(sandbox_id: str, path: str, request: Request, user: str | None = None) -> dict:
    return await core(request).files.write_file(sandbox_id, path, request.stream(), user)


@router.get("/list")
async def list_dir(sandbox_id: str, path: str, request: Request, depth: int = 1) -> dict:
    reply = await core(request).files.file_op(sandbox_id, "list", path=path, depth=depth)
    return {"entries": reply["entries"]}


@router.get("/stat")
async def stat(sandbox_id: str, path: str, request: Request) -> dict:
    return await core(request).files.file_op(sandbox_id, "stat", path=path)


@router.get("/exists")
async def exists(sandbox_id: str, path: str, request: Request) -> dict:
    return await core(request).files.file_op(sandbox_id, "exists", path=path)


@router.delete("", status_code=204)
async def remove(sandbox_id: str, path: str, request: Request) -> Response:
    await core(request).files.file_op(sandbox_id, "remove", path=path)
    return Response(status_code=204)


@router.post("/mkdir")
async def mkdir(sandbox_id: str, body: MkdirBody, request: Request) -> dict:
    return await core(request).files.file_op(sandbox_id, "mkdir", path=body.path,
                                                 user=body.user)


@router.post("/rename")
async def rename(sandbox_id: str, body: RenameBody, request: Request) -> dict:
    return await core(request).files.file_op(sandbox_id, "rename", src=body.src, dst=body.dst)
