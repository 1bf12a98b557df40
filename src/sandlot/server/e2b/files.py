"""envd's plain HTTP endpoints: ``GET /health``, ``GET /files`` (download) and ``POST /files``
(upload, as ``multipart/form-data`` with one part per file, or ``application/octet-stream``,
optionally gzip-encoded). Uploads and downloads stream through to the agent."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sandlot.errors import InvalidArgumentError
from sandlot.server.body import metadata_headers
from sandlot.server.e2b.convert import check_user, resolve, write_info
from sandlot.server.e2b.multipart import MultipartReader, boundary_of
from sandlot.server.e2b.state import Envd

# Why: a gzip upload is inflated on the host before it goes to the guest; one compressed
# chunk may not expand past this in a single step, which bounds memory per request.
MAX_INFLATE_STEP = 4 << 20


def _user(ctx: Envd, request: Request) -> str:
    name = request.query_params.get("username")
    return check_user(name) if name else ctx.user


async def health(ctx: Envd, request: Request) -> Response:
    return Response(status_code=204)


async def download(ctx: Envd, request: Request) -> Response:
    path = request.query_params.get("path")
    if not path:
        raise InvalidArgumentError("the path query parameter is required")
    path = resolve(path, _user(ctx, request))
    # to its end: chunked
    _size, chunks = await ctx.core.files.read(ctx.sandbox_id, path, who=ctx.who)
    return StreamingResponse(chunks, media_type="application/octet-stream")


async def _gunzip(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in chunks:
            data = inflater.decompress(chunk, MAX_INFLATE_STEP)
            while True:
                if data:
                    yield data
                if not inflater.unconsumed_tail:
                    break
                data = inflater.decompress(inflater.unconsumed_tail, MAX_INFLATE_STEP)
        if tail := inflater.flush():
            yield tail
    except zlib.error as e:
        raise InvalidArgumentError(f"invalid gzip upload: {e}") from None


async def upload(ctx: Envd, request: Request) -> Response:
    user = _user(ctx, request)
    path_param = request.query_params.get("path")
    content_type = request.headers.get("content-type", "")
    encoding = request.headers.get("content-encoding", "identity").lower()
    chunks: AsyncIterator[bytes] = request.stream()
    metadata = metadata_headers(request)
    if encoding == "gzip":
        chunks = _gunzip(chunks)
    elif encoding not in ("", "identity"):
        raise InvalidArgumentError(f"unsupported Content-Encoding {encoding!r}")
    written = []
    if content_type.lower().startswith("multipart/form-data"):
        reader = MultipartReader(chunks, boundary_of(content_type))
        async for part in reader:
            if part.filename is None and part.name != "file":
                async for _ in reader.body():
                    pass
                continue
            target = path_param or part.filename
            if not target:
                raise InvalidArgumentError("a file part needs a file name or the path parameter")
            target = resolve(target, user)
            entry = await ctx.core.files.write(ctx.sandbox_id, target, reader.body(), user,
                                               metadata, who=ctx.who)
            written.append(write_info(target, entry))
    else:
        if not path_param:
            raise InvalidArgumentError("the path query parameter is required")
        target = resolve(path_param, user)
        entry = await ctx.core.files.write(ctx.sandbox_id, target, chunks, user, metadata,
                                           who=ctx.who)
        written.append(write_info(target, entry))
    if not written:
        raise InvalidArgumentError("the upload holds no file")
    return JSONResponse(written)
