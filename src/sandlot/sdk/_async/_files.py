"""Reading and writing files in a sandbox (async)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal, overload

from .. import _base
from .._models import EntryInfo, parse_list
from ._http import AsyncAPI, AsyncByteStream


class AsyncFiles:
    """``sbx.files``: the sandbox's file system. Paths are absolute guest paths."""

    def __init__(self, api: AsyncAPI, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    async def read(self, path: str, format: Literal["stream"]) -> AsyncByteStream: ...

    async def read(self, path: str, format: str = "text") -> str | bytes | AsyncByteStream:
        """Read a file as ``"text"`` (UTF-8), ``"bytes"``, or ``"stream"``.

        ``"stream"`` returns an async iterator of byte chunks that downloads as you consume it;
        close it (or use it in ``async with``) if you stop early.
        """
        req = _base.read_file(self._sandbox_id, path, format)
        if format == "stream":
            response = await self._api.send(req, stream=True, timeout=_base.STREAM_TIMEOUT)
            return AsyncByteStream(self._api, response)
        response = await self._api.send(req, timeout=_base.STREAM_TIMEOUT)
        return _base.decode_file(response.content, format)

    async def read_to(self, path: str, local_path: str | Path) -> int:
        """Download `path` into the local file `local_path` in chunks; return the byte count."""
        total = 0
        async with await self.read(path, format="stream") as chunks:
            with open(local_path, "wb") as out:
                async for chunk in chunks:
                    out.write(chunk)
                    total += len(chunk)
        return total

    async def write(self, path: str, data: _base.UploadData | AsyncIterator[bytes], *,
                    user: str = "root", metadata: dict[str, str] | None = None) -> EntryInfo:
        """Write `data` to `path`, creating parent directories; return the new entry.

        `data` is a str (UTF-8), bytes, a binary file object, or an (async) iterator of byte
        chunks. File objects and iterators are streamed, never held whole in memory.
        `metadata` (keys lowercased; keys HTTP tokens, values printable ASCII) is kept with
        the file as extended attributes, shown by `stat` and `list`, kept by `rename` and
        replaced by the next write (E2B's file metadata).
        """
        req = _base.write_file(self._sandbox_id, path, user, metadata)
        content = _base.aupload_content(data)
        data_ = await self._api.call(req, content=content, timeout=_base.STREAM_TIMEOUT)
        return EntryInfo.model_validate(data_)

    async def write_from(self, path: str, local_path: str | Path, *, user: str = "root",
                         ) -> EntryInfo:
        """Upload the local file `local_path` to `path`, streaming it in chunks."""
        with open(local_path, "rb") as fileobj:
            return await self.write(path, fileobj, user=user)

    async def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        """The entries under directory `path`, down to `depth` levels."""
        data = await self._api.call(_base.list_files(self._sandbox_id, path, depth))
        return parse_list(EntryInfo, data, "entries")

    async def exists(self, path: str) -> bool:
        """Whether `path` exists."""
        data = await self._api.call(_base.file_exists(self._sandbox_id, path))
        return bool((data or {}).get("exists", False))

    async def stat(self, path: str) -> EntryInfo:
        """Information about `path`; raises `NotFoundError` if it does not exist."""
        return EntryInfo.model_validate(
            await self._api.call(_base.stat_file(self._sandbox_id, path)))

    async def remove(self, path: str) -> None:
        """Delete a file, or a directory recursively."""
        await self._api.call(_base.remove_file(self._sandbox_id, path))

    async def make_dir(self, path: str, *, user: str = "root") -> bool:
        """Create directory `path` and its parents; False if it already existed."""
        data = await self._api.call(_base.make_dir(self._sandbox_id, path, user))
        return bool((data or {}).get("created", True))

    async def rename(self, src: str, dst: str) -> EntryInfo:
        """Move `src` to `dst`; return the entry at `dst`."""
        return EntryInfo.model_validate(
            await self._api.call(_base.rename_file(self._sandbox_id, src, dst)))
