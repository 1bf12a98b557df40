"""A volume's files read and written from outside any sandbox (E2B's volume content API):
the tenant's volume, on this host, through the same confined file operations that serve the
guests' mounts (guest/volserve.py: paths resolved one component at a time, no `..`, no
symlink followed, no setuid). Blocking file I/O runs in threads; file bodies stream through
in chunks, never whole."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from sandlot.core.tenancy import Principal
from sandlot.errors import (
    ConflictError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    PermissionDeniedError,
    SandlotError,
    StorageError,
)
from sandlot.guest.volserve import MAX_PATH, VolumeServer

if TYPE_CHECKING:
    from sandlot.core.volumes import Volumes

T = TypeVar("T")
CHUNK = 1 << 20  # bytes per read or write of a file body
MAX_DEPTH = 16  # levels a listing goes down
MAX_ENTRIES = 10_000  # entries a listing answers


class VolumeContent:
    """File operations on the volumes of `volumes` (each one call of the content API)."""

    def __init__(self, volumes: Volumes) -> None:
        self.volumes = volumes

    async def _files(self, volume_id: str, path: str, who: Principal
                     ) -> tuple[VolumeServer, str, str]:
        """The host's volume files, the volume's id and `path` relative to its root."""
        info = await self.volumes.get(volume_id, who)
        if info.host != self.volumes.host_id:
            raise ConflictError(f"volume {info.volume_id} lives on host {info.host}, which "
                                f"is not reachable from this one: use that host's URL")
        files = self.volumes.runtime.volume_files()
        with _errors(path, info.volume_id):
            return files, info.volume_id, files.content_path(path)

    async def _run(self, volume_id: str, path: str, who: Principal,
                   op: Callable[[VolumeServer, int, str], T], changes: bool = False) -> T:
        """`op` on the volume's files (`changes`: what its files take is counted again)."""
        files, vid, rel = await self._files(volume_id, path, who)

        def run() -> T:
            with _errors(path, vid), files.root_fd(vid) as root_fd:
                try:
                    return op(files, root_fd, rel)
                finally:
                    if changes:
                        files.forget_usage(vid)

        return await asyncio.to_thread(run)

    async def stat(self, volume_id: str, path: str, who: Principal) -> dict:
        return await self._run(volume_id, path, who, lambda f, r, p: f.entry(r, p))

    async def list(self, volume_id: str, path: str, depth: int, who: Principal
                   ) -> list[dict]:
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidArgumentError(f"depth must be 1 to {MAX_DEPTH}, not {depth}")
        return await self._run(volume_id, path, who,
                               lambda f, r, p: f.list_dir(r, p, depth, MAX_ENTRIES))

    async def make_dir(self, volume_id: str, path: str, mode: int | None, parents: bool,
                       who: Principal) -> dict:
        return await self._run(volume_id, path, who, lambda f, r, p: f.make_dir(
            r, p, _mode(mode, 0o755), parents), changes=True)

    async def remove(self, volume_id: str, path: str, who: Principal) -> None:
        def remove(f: VolumeServer, r: int, p: str) -> None:
            if not p:
                raise InvalidArgumentError("the root of a volume cannot be removed (destroy "
                                           "the volume instead)")
            f.remove(r, p)

        await self._run(volume_id, path, who, remove, changes=True)

    async def chmod(self, volume_id: str, path: str, mode: int | None, who: Principal
                    ) -> dict:
        if mode is None:
            return await self.stat(volume_id, path, who)
        return await self._run(volume_id, path, who,
                               lambda f, r, p: f.chmod(r, p, _mode(mode, 0)))

    async def read(self, volume_id: str, path: str, who: Principal
                   ) -> tuple[int, AsyncIterator[bytes]]:
        """A file's size and its bytes, read as they are sent."""
        files, vid, rel = await self._files(volume_id, path, who)

        def open_() -> tuple[int, int]:
            with _errors(path, vid):
                fd = files.open_read(vid, rel)
                return fd, os.fstat(fd).st_size

        fd, size = await asyncio.to_thread(open_)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while data := await asyncio.to_thread(os.read, fd, CHUNK):
                    yield data
            finally:
                os.close(fd)

        return size, chunks()

    async def write(self, volume_id: str, path: str, body: AsyncIterator[bytes],
                    mode: int | None, who: Principal) -> dict:
        """Write a file from `body` as it arrives; put in place (replacing one there) only
        when all of it is written."""
        files, vid, rel = await self._files(volume_id, path, who)

        def begin():
            with _errors(path, vid):
                return files.upload(vid, rel, _mode(mode, 0o644))

        upload = await asyncio.to_thread(begin)

        def write(data: bytes) -> None:
            with _errors(path, vid):
                upload.write(data)

        try:
            pending = bytearray()
            async for chunk in body:
                pending += chunk
                if len(pending) >= CHUNK:
                    await asyncio.to_thread(write, bytes(pending))
                    pending.clear()
            if pending:
                await asyncio.to_thread(write, bytes(pending))
        except BaseException:
            await asyncio.to_thread(upload.abort)
            raise

        def finish() -> dict:
            with _errors(path, vid):
                return upload.finish()

        return await asyncio.to_thread(finish)


def _mode(mode: int | None, default: int) -> int:
    if mode is None:
        return default
    if not 0 <= mode <= 0o7777:
        raise InvalidArgumentError(f"mode must be 0 to 0o7777, not {mode}")
    return mode


@contextlib.contextmanager
def _errors(path: str, volume_id: str) -> Iterator[None]:
    """The file operations' errnos as sandlot's errors, naming the path."""
    try:
        yield
    except SandlotError:
        raise
    except OSError as e:
        shown = repr(path[:MAX_PATH // 16])
        code = e.errno
        if code == errno.ENOENT:
            raise NotFoundError(f"path {shown} not found in volume {volume_id}") from None
        if code == errno.ESTALE:
            raise NotFoundError(f"volume {volume_id} not found (deleted)") from None
        if code == errno.EEXIST:
            raise ConflictError(f"path {shown} exists already") from None
        if code == errno.ENOTEMPTY:
            raise ConflictError(f"directory {shown} is not empty") from None
        if code == errno.EISDIR:
            raise InvalidArgumentError(f"path {shown} is a directory") from None
        if code == errno.ENOTDIR:
            raise InvalidArgumentError(f"path {shown}: a component of it is not a directory "
                                       "(symlinks are not followed)") from None
        if code == errno.ELOOP:
            raise InvalidArgumentError(f"path {shown} is a symlink: symlinks in a volume are "
                                       "not followed") from None
        if code in (errno.EPERM, errno.EACCES):
            raise PermissionDeniedError(f"path {shown}: not a regular file or directory, or "
                                        "not permitted") from None
        if code in (errno.EINVAL, errno.ENAMETOOLONG):
            raise InvalidArgumentError(
                f"bad volume path {shown}: an absolute path in the volume (like /dir/file), "
                "without '..', '.' or empty components, each at most 255 bytes") from None
        if code == errno.E2BIG:
            raise InvalidArgumentError(f"directory {shown} holds more than {MAX_ENTRIES} "
                                       "entries at that depth: list with a smaller depth "
                                       "or a deeper path") from None
        if code == errno.EDQUOT:
            raise InvalidStateError(f"volume {volume_id} is full: it holds at most "
                                    "SANDLOT_MAX_VOLUME_MB of files") from None
        if code == errno.ENOSPC:
            raise InvalidStateError("no space left for the volume on its host") from None
        raise StorageError(f"volume {volume_id}, path {shown}: {e.strerror}") from None
