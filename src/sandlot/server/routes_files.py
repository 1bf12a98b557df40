"""/v1/sandboxes/{id}/files: streamed download and upload, list, stat, exists, rm, mkdir, mv."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from sandlot.core.models import Exists, FileInfo, FileList, MkdirResult
from sandlot.server.auth import who
from sandlot.server.body import metadata_headers
from sandlot.server.deps import core

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/files", tags=["files"])


class MkdirBody(BaseModel):
    path: str
    user: str | None = None


class RenameBody(BaseModel):
    src: str
    dst: str


@router.get("", response_class=StreamingResponse, responses={
    200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes."}})
async def download(sandbox_id: str, path: str, request: Request) -> StreamingResponse:
    """The file's bytes as the guest reads them to its end (chunked: the size the guest
    reported is no promise: /proc files say 0, a growing file says what it was)."""
    _size, chunks = await core(request).files.read(sandbox_id, path, who=who(request))
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.put("", response_model=FileInfo)
async def upload(sandbox_id: str, path: str, request: Request, user: str | None = None
                 ) -> FileInfo:
    """Write the request body to `path` (streamed; parents are made). `X-Metadata-<key>`
    headers set the new file's user metadata (keys lowercased), as E2B's envd does."""
    return await core(request).files.write(sandbox_id, path, request.stream(), user,
                                           metadata_headers(request), who=who(request))


@router.get("/list", response_model=FileList)
async def list_dir(sandbox_id: str, path: str, request: Request, depth: int = 1) -> FileList:
    return FileList(entries=await core(request).files.list(sandbox_id, path, depth,
                                                                who=who(request)))


@router.get("/stat", response_model=FileInfo)
async def stat(sandbox_id: str, path: str, request: Request) -> FileInfo:
    return await core(request).files.stat(sandbox_id, path, who=who(request))


@router.get("/exists", response_model=Exists)
async def exists(sandbox_id: str, path: str, request: Request) -> Exists:
    return Exists(exists=await core(request).files.exists(sandbox_id, path, who=who(request)))


@router.delete("", status_code=204)
async def remove(sandbox_id: str, path: str, request: Request) -> Response:
    await core(request).files.remove(sandbox_id, path, who=who(request))
    return Response(status_code=204)


@router.post("/mkdir", response_model=MkdirResult)
async def mkdir(sandbox_id: str, body: MkdirBody, request: Request) -> MkdirResult:
    return await core(request).files.mkdir(sandbox_id, body.path, body.user,
                                              who=who(request))


@router.post("/rename", response_model=FileInfo)
async def rename(sandbox_id: str, body: RenameBody, request: Request) -> FileInfo:
    return await core(request).files.rename(sandbox_id, body.src, body.dst,
                                               who=who(request))
