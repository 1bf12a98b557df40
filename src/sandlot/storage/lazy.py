"""An image's files fetched as they are read: each chunk comes from the store the first time
anything reads it (or the background prefetch reaches it), is verified against its digest,
and is kept in a local sparse file; nothing unverified is ever written there.

The order in which the first restores read an image's chunks is kept with it in the store
(``orders/<key>.json``: recorded once, by the first host that restores it lazily), and a
prefetch fetches that order first, then every other chunk. A chunk that cannot be had after
bounded retries (the store unreachable, the chunk missing or corrupt) fails the image for
good: every later read of a chunk still missing fails at once (`LazyFiles.failed` says why),
while chunks already local keep being served.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import NotFoundError, StorageError
from sandlot.storage.chunks import chunk_key, unpack_chunk
from sandlot.storage.manifest import FileManifest
from sandlot.storage.objects import ObjectStore

ORDERS = "orders/"
ATTEMPTS = 4  # per chunk, before the image fails
CHUNK_TIMEOUT = 8.0  # seconds for one attempt (the S3 client retries inside it as well)
BACKOFF = 0.5  # seconds before the second attempt, doubling
PREFETCH = 8  # background fetches in flight
MAX_ORDER = 1 << 20  # chunk entries an order may list
FIRST = ("devstate",)  # files every restore reads whole before anything else


def order_key(key: str) -> str:
    return f"{ORDERS}{key}.json"


@dataclass
class _File:
    manifest: FileManifest
    path: Path
    fd: int
    present: bytearray  # per chunk: 1 once local (holes are)
    first_read: bytearray  # per chunk: 1 once read

    @property
    def chunk(self) -> int:
        return self.manifest.chunk_size

    def count(self) -> int:
        return -(-self.manifest.size // self.chunk)


class LazyFiles:
    """`files`: per name, its manifest and the local path to fill. Reads (`read`, from any
    thread) and `prefetch` run their fetches on `loop`."""

    def __init__(self, objects: ObjectStore, files: dict[str, tuple[FileManifest, Path]],
                 what: str, loop: asyncio.AbstractEventLoop, *, attempts: int = ATTEMPTS,
                 timeout: float = CHUNK_TIMEOUT, backoff: float = BACKOFF) -> None:
        self.objects = objects
        self.what = what
        self.loop = loop
        self.attempts, self.timeout, self.backoff = attempts, timeout, backoff
        self.failed: str | None = None
        self.fetched_bytes = 0  # compressed, from the store
        self.fetched_chunks = 0
        self.waits = 0  # reads that waited for a fetch, and how long in all
        self.waited = 0.0
        self.touched: list[tuple[str, int]] = []  # chunks in the order first read
        self._touch_lock = threading.Lock()
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        self._files: dict[str, _File] = {}
        self._missing = 0
        self.complete = asyncio.Event()
        for name, (manifest, path) in files.items():
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
            os.ftruncate(fd, manifest.size)
            count = -(-manifest.size // manifest.chunk_size)
            f = _File(manifest, path, fd, bytearray(b"\1") * count, bytearray(count))
            for index in manifest.chunks:
                f.present[index] = 0
            self._missing += len(manifest.chunks)
            self._files[name] = f
        if not self._missing:
            loop.call_soon_threadsafe(self.complete.set)

    @property
    def missing(self) -> int:
        return self._missing

    def stats(self) -> dict:
        return {"fetched_bytes": self.fetched_bytes, "fetched_chunks": self.fetched_chunks,
                "missing_chunks": self._missing,
                "chunks": sum(len(f.manifest.chunks) for f in self._files.values()),
                "touched_chunks": len(self.touched), "reads_waited": self.waits,
                "waited_ms": round(self.waited * 1000), "failed": self.failed}

    def size(self, name: str) -> int:
        return self._files[name].manifest.size

    def names(self) -> list[str]:
        return list(self._files)

    def close(self) -> None:
        for f in self._files.values():
            os.close(f.fd)

    # ---- reading (FUSE threads) ----------------------------------------------------------

    def read(self, name: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (fewer at the end), fetching the chunks they span that
        are not local yet. Called from any thread but the loop's."""
        f = self._files[name]
        end = min(offset + length, f.manifest.size)
        if offset >= end:
            return b""
        indices = range(offset // f.chunk, (end - 1) // f.chunk + 1)
        self._record(name, f, indices)
        wanted = [i for i in indices if not f.present[i]]
        if wanted:
            t0 = time.monotonic()
            asyncio.run_coroutine_threadsafe(self._ensure_all(name, wanted), self.loop).result()
            with self._touch_lock:
                self.waits += 1
                self.waited += time.monotonic() - t0
        return os.pread(f.fd, end - offset, offset)

    def _record(self, name: str, f: _File, indices: Iterable[int]) -> None:
        with self._touch_lock:
            for i in indices:
                if not f.first_read[i]:
                    f.first_read[i] = 1
                    if i in f.manifest.chunks:
                        self.touched.append((name, i))

    # ---- fetching (the loop) -------------------------------------------------------------

    async def _ensure_all(self, name: str, indices: list[int]) -> None:
        await asyncio.gather(*(self.ensure(name, i) for i in indices))

    async def ensure(self, name: str, index: int) -> None:
        """Chunk `index` of `name` local (fetched and verified if it was not)."""
        f = self._files[name]
        if f.present[index]:
            return
        if self.failed is not None:
            raise StorageError(self.failed)
        fut = self._inflight.get((name, index))
        if fut is None:
            fut = asyncio.ensure_future(self._fetch(name, f, index))
            self._inflight[(name, index)] = fut
            fut.add_done_callback(lambda _: self._inflight.pop((name, index), None))
        await asyncio.shield(fut)

    async def _fetch(self, name: str, f: _File, index: int) -> None:
        digest = f.manifest.chunks[index]
        what = f"{self.what}, {name}"
        delay = self.backoff
        error = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(delay)
                delay *= 2
            try:
                packed = await asyncio.wait_for(self.objects.get(chunk_key(digest)),
                                                self.timeout)
                data = await asyncio.to_thread(unpack_chunk, packed, digest, f.chunk, what)
            except NotFoundError:
                error = f"{what}: chunk {digest[:16]}... is missing from the store"
                break  # it will not appear
            except TimeoutError:
                error = f"{what}: the store did not answer within {self.timeout:.0f} s"
                continue
            except StorageError as e:
                error = str(e)
                continue  # a transport error, or a corrupt copy (not kept either way)
            await asyncio.to_thread(os.pwrite, f.fd, data, index * f.chunk)
            if not f.present[index]:
                f.present[index] = 1
                self.fetched_bytes += len(packed)
                self.fetched_chunks += 1
                self._missing -= 1
                if not self._missing:
                    self.complete.set()
            return
        if self.failed is None:
            self.failed = (f"{error} (after {attempt + 1} attempts); the sandbox's image could "
                           "not be fetched")
        raise StorageError(self.failed)

    def _queue(self, order: Iterable[tuple[str, int]]) -> Iterator[tuple[str, int]]:
        seen: set[tuple[str, int]] = set()
        first = [(n, i) for n in FIRST if n in self._files
                 for i in sorted(self._files[n].manifest.chunks)]
        for name, index in [*first, *order]:
            f = self._files.get(name)
            if f is not None and 0 <= index < f.count() and (name, index) not in seen:
                seen.add((name, index))
                yield name, index
        for name, f in self._files.items():
            for index in sorted(f.manifest.chunks):
                if (name, index) not in seen:
                    yield name, index

    async def prefetch(self, order: Iterable[tuple[str, int]] = (),
                       parallel: int = PREFETCH) -> None:
        """Fetch every missing chunk: `FIRST`'s, then `order`'s, then the rest; stops at the
        first failure."""
        queue = self._queue(order)

        async def worker() -> None:
            for name, index in queue:
                if self.failed is not None:
                    return
                if not self._files[name].present[index]:
                    try:
                        await self.ensure(name, index)
                    except StorageError:
                        return

        await asyncio.gather(*(worker() for _ in range(max(1, parallel))))


def dump_order(touched: list[tuple[str, int]]) -> bytes:
    return json.dumps({"format": "1",
                       "order": [[name, index] for name, index in touched[:MAX_ORDER]]}).encode()


def load_order(raw: bytes) -> list[tuple[str, int]]:
    """An order as `dump_order` wrote it; anything else is ignored (an empty order)."""
    try:
        data = json.loads(raw)
        return [(str(n), int(i)) for n, i in data["order"][:MAX_ORDER]]
    except (ValueError, KeyError, TypeError):
        return []
