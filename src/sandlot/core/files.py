"""Files in a running sandbox, streamed through the guest agent in chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

from sandlot.core.live import LiveSandbox
from sandlot.core.models import FileInfo, MkdirResult
from sandlot.errors import InvalidArgumentError


def check_path(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidArgumentError(f"path must be absolute, got {path!r}")


def _info(entry) -> FileInfo:
    return FileInfo(**asdict(entry))


class Files:
    def __init__(self, live_of: Callable[[str], LiveSandbox]) -> None:
        self.live_of = live_of  # a running sandbox by id, or NotFoundError

    async def _guest(self, sandbox_id: str, *paths: str):
        for path in paths:
            check_path(path)
        return await self.live_of(sandbox_id).guest()

    async def read(self, sandbox_id: str, path: str) -> tuple[int, AsyncIterator[bytes]]:
        """Open a file for streaming: (size, chunks). Errors raise before any byte."""
        return await (await self._guest(sandbox_id, path)).read(path)

    async def write(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                    user: str | None = None) -> FileInfo:
        return _info(await (await self._guest(sandbox_id, path)).write(path, chunks, user=user))

    async def list(self, sandbox_id: str, path: str, depth: int = 1) -> list[FileInfo]:
        guest = await self._guest(sandbox_id, path)
        return [_info(e) for e in await guest.list_dir(path, depth)]

    async def stat(self, sandbox_id: str, path: str) -> FileInfo:
        return _info(await (await self._guest(sandbox_id, path)).stat(path))

    async def exists(self, sandbox_id: str, path: str) -> bool:
        return await (await self._guest(sandbox_id, path)).exists(path)

    async def remove(self, sandbox_id: str, path: str) -> None:
        await (await self._guest(sandbox_id, path)).remove(path)

    async def mkdir(self, sandbox_id: str, path: str, user: str | None = None) -> MkdirResult:
        created, entry = await (await self._guest(sandbox_id, path)).mkdir(path, user=user)
        return MkdirResult(created=created, **asdict(entry))

    async def rename(self, sandbox_id: str, src: str, dst: str) -> FileInfo:
        return _info(await (await self._guest(sandbox_id, src, dst)).rename(src, dst))
