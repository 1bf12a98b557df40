# Generated from src/sandlot/sdk/_async/_files.py by scripts/unasync.py; do not edit.
# ruff: noqa: I001
"""Reading and writing files in a sandbox (sync)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Literal, overload

from .. import _base
from .._models import EntryInfo, parse_list
from ._http import API, ByteStream


class Files:
    """``sbx.files``: the sandbox's file system. Paths are absolute guest paths."""

    def __init__(self, api: API, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    @overload
    def read(self, path: str, format: Literal["stream"]) -> ByteStream: ...

    def read(self, path: str, format: str = "text") -> str | bytes | ByteStream:
        """Read a file as ``"text"`` (UTF-8), ``"bytes"``, or ``"stream"``.

        ``"stream"`` returns an iterator of byte chunks that downloads as you consume it;
        close it (or use it in ``with``) if you stop early.
        """
        req = _base.read_file(self._sandbox_id, path, format)
        if format == "stream":
            response = self._api.send(req, stream=True, timeout=_base.STREAM_TIMEOUT)
            return ByteStream(self._api, response)
        response = self._api.send(req, timeout=_base.STREAM_TIMEOUT)
        return _base.decode_file(response.content, format)

    def read_to(self, path: str, local_path: str | Path) -> int:
        """Download `path` into the local file `local_path` in chunks; return the byte count."""
        total = 0
        with self.read(path, format="stream") as chunks:
            with open(local_path, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    total += len(chunk)
        return total

    def write(self, path: str, data: _base.UploadData | Iterator[bytes], *,
              user: str = "root", metadata: dict[str, str] | None = None) -> EntryInfo:
        """Write `data` to `path`, creating parent directories; return the new entry.

        `data` is a str (UTF-8), bytes, a binary file object, or an iterator of byte
        chunks. File objects and iterators are streamed, never held whole in memory.
        `metadata` (keys lowercased; keys HTTP tokens, values printable ASCII) is kept with
        the file as extended attributes, shown by `stat` and `list`, kept by `rename` and
        replaced by the next write (E2B's file metadata).
        """
        req = _base.write_file(self._sandbox_id, path, user, metadata)
        content = _base.upload_content(data)
        data_ = self._api.call(req, content=content, timeout=_base.STREAM_TIMEOUT)
        return EntryInfo.model_validate(data_)

    def write_from(self, path: str, local_path: str | Path, *, user: str = "root",
                   ) -> EntryInfo:
        """Upload the local file `local_path` to `path`, streaming it in chunks."""
        with open(local_path, "rb") as fileobj:
            return self.write(path, fileobj, user=user)

    def list(self, path: str, depth: int = 1) -> list[EntryInfo]:
        """The entries under directory `path`, down to `depth` levels."""
        data = self._api.call(_base.list_files(self._sandbox_id, path, depth))
        return parse_list(EntryInfo, data, "entries")

    def exists(self, path: str) -> bool:
        """Whether `path` exists."""
        data = self._api.call(_base.file_exists(self._sandbox_id, path))
        return bool((data or {}).get("exists", False))

    def stat(self, path: str) -> EntryInfo:
        """Information about `path`; raises `NotFoundError` if it does not exist."""
        return EntryInfo.model_validate(
            self._api.call(_base.stat_file(self._sandbox_id, path)))

    def remove(self, path: str) -> None:
        """Delete a file, or a directory recursively."""
        self._api.call(_base.remove_file(self._sandbox_id, path))

    def make_dir(self, path: str, *, user: str = "root") -> bool:
        """Create directory `path` and its parents; False if it already existed."""
        data = self._api.call(_base.make_dir(self._sandbox_id, path, user))
        return bool((data or {}).get("created", True))

    def rename(self, src: str, dst: str) -> EntryInfo:
        """Move `src` to `dst`; return the entry at `dst`."""
        return EntryInfo.model_validate(
            self._api.call(_base.rename_file(self._sandbox_id, src, dst)))
