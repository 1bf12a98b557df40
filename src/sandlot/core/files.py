"""Files in a running sandbox, streamed through the guest agent in chunks."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

from sandlot.config import Limits
from sandlot.core.limits import check_file_metadata, check_path, check_user
from sandlot.core.live import LiveSandbox
from sandlot.core.models import FileInfo, MkdirResult
from sandlot.core.tenancy import Principal
from sandlot.errors import InvalidArgumentError


def _info(entry) -> FileInfo:
    return FileInfo(**asdict(entry))


class Files:
    def __init__(self, live_of: Callable[[str, Principal], LiveSandbox],
                 limits: Limits | None = None
                 ) -> None:
        self.live_of = live_of  # a running sandbox by id, or NotFoundError
        self.limits = limits or Limits()

    async def _guest(self, sandbox_id: str, *paths: str, user: str | None = None,
                     who: Principal):
        for path in paths:
            check_path(self.limits, path)
        check_user(user)
        return await self.live_of(sandbox_id, who).guest()

    async def read(self, sandbox_id: str, path: str, *, who: Principal
                   ) -> tuple[int, AsyncIterator[bytes]]:
        """Open a file for streaming: (size, chunks). Errors raise before any byte."""
        guest = await self._guest(sandbox_id, path, who=who)
        live = self.live_of(sandbox_id, who)
        live.open_stream(self.limits.streams)
        try:
            size, chunks = await guest.read(path)
        except BaseException:
            live.close_stream()
            raise

        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                live.close_stream()

        async def counted() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                release()
                await chunks.aclose()

        stream = counted()
        weakref.finalize(stream, release)  # a response never sent never starts it
        return size, stream

    async def write(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                    user: str | None = None, metadata: dict[str, str] | None = None, *,
                    who: Principal) -> FileInfo:
        """Write a file (a new one: an overwrite replaces its content and its metadata)."""
        check_file_metadata(self.limits, metadata)
        guest = await self._guest(sandbox_id, path, user=user, who=who)
        return _info(await guest.write(path, chunks, user=user,
                                       metadata={k.lower(): v for k, v in metadata.items()}
                                       if metadata else None))

    async def list(self, sandbox_id: str, path: str, depth: int = 1, *, who: Principal
                   ) -> list[FileInfo]:
        """Entries under `path`, `depth` levels down (at most `limits.list_depth`); a listing
        of more than `limits.list_entries` entries is refused (InvalidArgumentError)."""
        if not 1 <= depth <= self.limits.list_depth:
            raise InvalidArgumentError(
                f"depth must be between 1 and {self.limits.list_depth}, got {depth}")
        guest = await self._guest(sandbox_id, path, who=who)
        entries = await guest.list_dir(path, depth, max_entries=self.limits.list_entries)
        if len(entries) > self.limits.list_entries:  # an agent that does not know the limit
            raise InvalidArgumentError(
                f"{path} holds more than {self.limits.list_entries} entries at depth {depth}; "
                "list a subdirectory or a smaller depth")
        return [_info(e) for e in entries]

    async def stat(self, sandbox_id: str, path: str, *, who: Principal) -> FileInfo:
        return _info(await (await self._guest(sandbox_id, path, who=who)).stat(path))

    async def exists(self, sandbox_id: str, path: str, *, who: Principal) -> bool:
        return await (await self._guest(sandbox_id, path, who=who)).exists(path)

    async def remove(self, sandbox_id: str, path: str, *, who: Principal) -> None:
        await (await self._guest(sandbox_id, path, who=who)).remove(path)

    async def mkdir(self, sandbox_id: str, path: str, user: str | None = None, *,
                    who: Principal) -> MkdirResult:
        guest = await self._guest(sandbox_id, path, user=user, who=who)
        created, entry = await guest.mkdir(path, user=user)
        return MkdirResult(created=created, **asdict(entry))

    async def rename(self, sandbox_id: str, src: str, dst: str, *, who: Principal
                     ) -> FileInfo:
        guest = await self._guest(sandbox_id, src, dst, who=who)
        return _info(await guest.rename(src, dst))
