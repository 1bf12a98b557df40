"""Object stores: a local directory (the embedded default) or S3, behind one async interface.

`open_store(url)`: ``s3://BUCKET/PREFIX`` is S3 through obstore, configured the standard way
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``; a plain
``http://`` endpoint is allowed, for a server on loopback); anything else is a directory.
Transient S3 errors are retried by obstore's client (bounded); what is left becomes a
StorageError, a missing object a NotFoundError.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sandlot.errors import InvalidArgumentError, NotFoundError, StorageError


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # epoch seconds


class ObjectStore(abc.ABC):
    """Keys are relative paths (``chunks/ab/abcd...``)."""

    url: str

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Write `data` under `key`, durably and atomically (readers see all or nothing)."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """NotFoundError if there is no such object."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo | None:
        """None if there is no such object."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Idempotent."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`."""

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (NotFoundError if there is none)."""
        return (await self.get(key))[start:end]

    async def exists(self, key: str) -> bool:
        return await self.head(key) is not None

    async def put_many(self, items: list[tuple[str, bytes]], parallel: int = 4) -> None:
        """`put` each (key, data), `parallel` at a time; all are durable when it returns."""
        slots = asyncio.Semaphore(parallel)

        async def one(key: str, data: bytes) -> None:
            async with slots:
                await self.put(key, data)

        await asyncio.gather(*(one(k, d) for k, d in items))

    async def existing(self, keys: list[str], parallel: int = 16) -> set[str]:
        """Which of `keys` there are objects under (looked up `parallel` at a time)."""
        slots = asyncio.Semaphore(parallel)

        async def one(key: str) -> str | None:
            async with slots:
                return key if await self.head(key) is not None else None

        return {k for k in await asyncio.gather(*(one(k) for k in keys)) if k is not None}


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise InvalidArgumentError(f"bad object key {key!r}")
    return key


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalObjectStore(ObjectStore):
    """Objects as files under `root`: written to a temp file, fsynced, renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        with contextlib.suppress(OSError):  # snapshots' contents: the server's only
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if root.stat().st_uid == os.geteuid():
                os.chmod(root, 0o700)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    async def put(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._put, self._path(key), data)

    @staticmethod
    def _put(path: Path, data: bytes, sync_dir: bool = True) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
            if sync_dir:
                _fsync_dir(path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)  # a full disk must not keep the partial write
            raise StorageError(f"writing {path}: {e.strerror or e}", cause=e) from e

    async def put_many(self, items: list[tuple[str, bytes]], parallel: int = 4) -> None:
        """In one thread: each object written and fsynced, renamed into place; then each
        directory they went to fsynced once."""
        paths = [(self._path(key), data) for key, data in items]
        await asyncio.to_thread(self._put_many, paths)

    def _put_many(self, items: list[tuple[Path, bytes]]) -> None:
        dirs = set()
        for path, data in items:
            self._put(path, data, sync_dir=False)
            dirs.add(path.parent)
        for d in dirs:
            try:
                _fsync_dir(d)
            except OSError as e:
                raise StorageError(f"writing {d}: {e.strerror or e}", cause=e) from e

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise NotFoundError(f"{key} is not in the store") from None
        except OSError as e:
            raise StorageError(f"reading {path}: {e.strerror or e}", cause=e) from e

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)

        def read() -> bytes:
            with open(path, "rb") as f:
                return os.pread(f.fileno(), max(0, end - start), start)

        try:
            return await asyncio.to_thread(read)
        except FileNotFoundError:
            raise NotFoundError(f"{key} is not in the store") from None
        except OSError as e:
            raise StorageError(f"reading {path}: {e.strerror or e}", cause=e) from e

    async def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    async def existing(self, keys: list[str], parallel: int = 16) -> set[str]:
        paths = [(key, self._path(key)) for key in keys]  # checked here, in the loop
        return await asyncio.to_thread(lambda: {k for k, p in paths if p.exists()})

    async def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await asyncio.to_thread(self._list, prefix)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        top = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        out = []
        for dirpath, _, files in os.walk(top):
            for name in files:
                if name.startswith("."):
                    continue  # a write in progress
                path = Path(dirpath) / name
                key = str(path.relative_to(self.root))
                if key.startswith(prefix):
                    try:
                        st = path.stat()
                    except FileNotFoundError:
                        continue
                    out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return out


class S3ObjectStore(ObjectStore):
    """A bucket (and key prefix) of an S3-compatible store, through obstore."""

    def __init__(self, bucket: str, prefix: str = "") -> None:
        from obstore.store import S3Store

        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        client = {"allow_http": True} if endpoint.startswith("http://") else {}
        config = {}
        if endpoint:
            config["endpoint"] = endpoint
        if not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
            config["region"] = "us-east-1"
        retry = {"max_retries": 5, "backoff": {"init_backoff": timedelta(milliseconds=50),
                                               "max_backoff": timedelta(seconds=5),
                                               "base": 2.0},
                 "retry_timeout": timedelta(seconds=60)}
        self._store = S3Store(bucket, prefix=prefix or None, config=config or None,
                              client_options=client or None, retry_config=retry)

    async def _call(self, what: str, fn: Callable[[], Awaitable]):
        import obstore.exceptions as oe

        try:
            return await fn()
        except (FileNotFoundError, oe.NotFoundError) as e:
            raise NotFoundError(f"{what}: not in the store") from e
        except Exception as e:  # noqa: BLE001 - obstore raises its own tree and OSErrors
            raise StorageError(f"{what} ({self.url}): {type(e).__name__}: {e}", cause=e) from e

    async def put(self, key: str, data: bytes) -> None:
        import obstore

        await self._call(f"writing {key}",
                         lambda: obstore.put_async(self._store, _check_key(key), data))

    async def get(self, key: str) -> bytes:
        import obstore

        async def fetch() -> bytes:
            result = await obstore.get_async(self._store, _check_key(key))
            return bytes(await result.bytes_async())

        return await self._call(f"reading {key}", fetch)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        import obstore

        async def fetch() -> bytes:
            return bytes(await obstore.get_range_async(self._store, _check_key(key),
                                                       start=start, end=end))

        return await self._call(f"reading {key} [{start}, {end})", fetch)

    async def head(self, key: str) -> ObjectInfo | None:
        import obstore

        try:
            meta = await self._call(f"looking up {key}",
                                    lambda: obstore.head_async(self._store, _check_key(key)))
        except NotFoundError:
            return None
        return ObjectInfo(key, int(meta["size"]), meta["last_modified"].timestamp())

    async def delete(self, key: str) -> None:
        import obstore

        try:
            await self._call(f"deleting {key}",
                             lambda: obstore.delete_async(self._store, _check_key(key)))
        except NotFoundError:
            pass

    async def list(self, prefix: str) -> list[ObjectInfo]:
        import obstore

        # S3 lists by path segments: list the prefix's directory, keep what matches.
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""

        async def collect() -> list[ObjectInfo]:
            out = []
            async for batch in obstore.list(self._store, directory or None, chunk_size=1000):
                out += [ObjectInfo(m["path"], int(m["size"]), m["last_modified"].timestamp())
                        for m in batch if m["path"].startswith(prefix)]
            return out

        return await self._call(f"listing {prefix or '/'}", collect)


def open_store(url: str | Path) -> ObjectStore:
    """``s3://BUCKET/PREFIX`` or a directory."""
    text = str(url)
    if text.startswith("s3://"):
        bucket, _, prefix = text[5:].partition("/")
        if not bucket:
            raise InvalidArgumentError(f"no bucket in store URL {text!r}")
        return S3ObjectStore(bucket, prefix.strip("/"))
    if "://" in text and not text.startswith("file://"):
        raise InvalidArgumentError(f"store URL {text!r}: use s3://BUCKET/PREFIX or a path")
    return LocalObjectStore(Path(text.removeprefix("file://")))
