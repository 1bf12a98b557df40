"""An image's files fetched as they are read: each chunk comes from the store the first time
anything reads it (or the background prefetch reaches it), is verified against its digest,
and is kept in a local sparse file; nothing unverified is ever written there.

The order in which the first restore read an image's chunks (`Order`, its first minute) is
kept with it in the store, recorded once by the first host that restores it lazily:
``orders/<key>.json``, and the chunks themselves, compressed, one after the other in
``orders/<key>.pack``, so a later restore gets its working set in a few ranged reads
(`load_pack`) instead of one request per chunk. Then the prefetch takes every other chunk.

A chunk that cannot be had after bounded retries (the store unreachable, the chunk missing
or corrupt) fails the image for good: every later read of a chunk still missing fails at
once (`LazyFiles.failed` says why), while chunks already local keep being served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import NotFoundError, SandlotError, StorageError
from sandlot.storage.chunks import blake3_hex, chunk_key, compressor, unpack_chunk
from sandlot.storage.manifest import FileManifest
from sandlot.storage.objects import ObjectStore

ORDERS = "orders/"
ATTEMPTS = 4  # per chunk, before the image fails
CHUNK_TIMEOUT = 8.0  # seconds for one attempt (the S3 client retries inside it as well)
BACKOFF = 0.5  # seconds before the second attempt, doubling
PREFETCH = 8  # background fetches in flight
MAX_ORDER = 1 << 20  # chunk entries an order may list
PACK_CHUNKS = 2048  # chunks a pack holds at most (128 MiB before compression)
PACK_RANGE = 8 << 20  # bytes per ranged read of a pack
PACK_READS = 4  # ranged reads of a pack in flight
ORDER_WINDOW = 60.0  # seconds of first reads an order records
FIRST = ("devstate",)  # files every restore reads whole before anything else
log = logging.getLogger(__name__)


def order_key(key: str) -> str:
    return f"{ORDERS}{key}.json"


def pack_key(key: str) -> str:
    return f"{ORDERS}{key}.pack"


@dataclass(frozen=True)
class Order:
    """The chunks an image's first lazy restore read, in that order; `pack`: where each is
    in the image's pack object (offset, length), if it has one."""

    chunks: list[tuple[str, int]]
    pack: list[tuple[int, int]] | None = None
    blake3: list[str] | None = None  # per chunk in the pack, of its bytes (faster to check)

    def dumps(self) -> bytes:
        data: dict = {"format": "2", "chunks": [list(c) for c in self.chunks[:MAX_ORDER]]}
        if self.pack is not None:
            data["pack"] = [list(p) for p in self.pack[:MAX_ORDER]]
        if self.blake3 is not None:
            data["blake3"] = self.blake3[:MAX_ORDER]
        return json.dumps(data).encode()

    @classmethod
    def loads(cls, raw: bytes) -> Order:
        """An order as `dumps` wrote it; anything else is an empty order."""
        try:
            data = json.loads(raw)
            chunks = [(str(n), int(i)) for n, i in data["chunks"][:MAX_ORDER]]
            pack = data.get("pack")
            if pack is not None:
                pack = [(int(o), int(n)) for o, n in pack[:MAX_ORDER]]
                if len(pack) != len(chunks):
                    pack = None
            b3 = data.get("blake3")
            if b3 is not None:
                b3 = [str(d) for d in b3[:MAX_ORDER]]
                if pack is None or len(b3) != len(chunks):
                    b3 = None
            return cls(chunks, pack, b3)
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls([])


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


def _unpack_write(f: _File, index: int, packed: bytes, digest: str, what: str) -> None:
    """(In a thread.) Check a fetched chunk and write it to its file."""
    os.pwrite(f.fd, unpack_chunk(packed, digest, f.chunk, what), index * f.chunk)


class LazyFiles:
    """`files`: per name, its manifest and the local path to fill. Reads (`read`, from any
    thread) and `prefetch` run their fetches on `loop`."""

    def __init__(self, objects: ObjectStore, files: dict[str, tuple[FileManifest, Path]],
                 what: str, loop: asyncio.AbstractEventLoop, *, attempts: int = ATTEMPTS,
                 timeout: float = CHUNK_TIMEOUT, backoff: float = BACKOFF,
                 record_for: float = ORDER_WINDOW) -> None:
        self.objects = objects
        self.what = what
        self.loop = loop
        self.attempts, self.timeout, self.backoff = attempts, timeout, backoff
        self.failed: str | None = None
        self.fetched_bytes = 0  # compressed, from the store
        self.fetched_chunks = 0
        self.waits = 0  # reads that waited for a fetch, and how long in all
        self.waited = 0.0
        self.last_wait = self.last_read = time.monotonic()
        self.touched: list[tuple[str, int]] = []  # chunks in the order first read
        self._record_until = time.monotonic() + record_for
        self._touch_lock = threading.Lock()
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        # checks and writes: for reads that wait on them, and for the prefetch
        self._demand_pool = ThreadPoolExecutor(4, "lazy-demand")
        self._bulk_pool = ThreadPoolExecutor(2, "lazy-bulk")
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
        self._demand_pool.shutdown(wait=True, cancel_futures=True)  # before the fds go
        self._bulk_pool.shutdown(wait=True, cancel_futures=True)
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
        self.last_read = time.monotonic()
        self._record(name, f, indices)
        wanted = [i for i in indices if not f.present[i]]
        if wanted:
            t0 = self.last_wait = time.monotonic()
            asyncio.run_coroutine_threadsafe(self._ensure_all(name, wanted), self.loop).result()
            with self._touch_lock:
                self.waits += 1
                self.waited += time.monotonic() - t0
        return os.pread(f.fd, end - offset, offset)

    def _record(self, name: str, f: _File, indices: Iterable[int]) -> None:
        if time.monotonic() > self._record_until:
            return
        with self._touch_lock:
            for i in indices:
                if not f.first_read[i]:
                    f.first_read[i] = 1
                    if i in f.manifest.chunks:
                        self.touched.append((name, i))

    # ---- fetching (the loop) -------------------------------------------------------------

    async def _ensure_all(self, name: str, indices: list[int]) -> None:
        await asyncio.gather(*(self.ensure(name, i, demand=True) for i in indices))

    async def ensure(self, name: str, index: int, demand: bool = False) -> None:
        """Chunk `index` of `name` local (fetched and verified if it was not); `demand`: a
        read waits for it (its checks never queue behind the prefetch's)."""
        f = self._files[name]
        if f.present[index]:
            return
        if self.failed is not None:
            raise StorageError(self.failed)
        fut = self._inflight.get((name, index))
        if fut is None:
            fut = asyncio.ensure_future(self._fetch(name, f, index, demand))
            self._inflight[(name, index)] = fut
            fut.add_done_callback(lambda _: self._inflight.pop((name, index), None))
        await asyncio.shield(fut)

    async def _fetch(self, name: str, f: _File, index: int, demand: bool) -> None:
        digest = f.manifest.chunks[index]
        pool = self._demand_pool if demand else self._bulk_pool
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
                await asyncio.get_running_loop().run_in_executor(
                    pool, _unpack_write, f, index, packed, digest, what)
            except NotFoundError:
                error = f"{what}: chunk {digest[:16]}... is missing from the store"
                break  # it will not appear
            except TimeoutError:
                error = f"{what}: the store did not answer within {self.timeout:.0f} s"
                continue
            except StorageError as e:
                error = str(e)
                continue  # a transport error, or a corrupt copy (not kept either way)
            self._mark(f, index, len(packed))
            return
        if self.failed is None:
            self.failed = (f"{error} (after {attempt + 1} attempts); the sandbox's image could "
                           "not be fetched")
        raise StorageError(self.failed)

    async def quiet(self, idle: float, at_most: float) -> None:
        """Return once nothing has been read for `idle` seconds, or after `at_most` (the
        VMs' first steps are over: the rest can be fetched without taking the CPU from
        them)."""
        deadline = time.monotonic() + at_most
        while (now := time.monotonic()) < deadline and now - self.last_read < idle:
            await asyncio.sleep(min(idle - (now - self.last_read), deadline - now))

    def _mark(self, f: _File, index: int, fetched: int) -> None:
        """Chunk `index` of `f` is local (verified, written)."""
        if not f.present[index]:
            f.present[index] = 1
            self.fetched_bytes += fetched
            self.fetched_chunks += 1
            self._missing -= 1
            if not self._missing:
                self.complete.set()

    async def load_pack(self, key: str, order: Order, parallel: int = PACK_READS) -> None:
        """`order`'s chunks from the image's pack, in ranged reads, each chunk verified.
        Best effort: what a read or a check fails is fetched chunk by chunk later."""
        if order.pack is None:
            return
        b3s = order.blake3 or [None] * len(order.chunks)
        entries = sorted(((off, length, name, index, b3)
                          for (name, index), (off, length), b3 in zip(order.chunks, order.pack,
                                                                      b3s, strict=True)
                          if name in self._files and index in self._files[name].manifest.chunks
                          and length > 0), key=lambda e: e[0])
        groups: list[list[tuple[int, int, str, int, str | None]]] = []
        for entry in entries:
            if groups and entry[0] + entry[1] - groups[-1][0][0] <= PACK_RANGE:
                groups[-1].append(entry)
            else:
                groups.append([entry])
        slots = asyncio.Semaphore(parallel)

        async def one(group: list[tuple[int, int, str, int, str | None]]) -> None:
            if self.failed is not None or all(self._files[n].present[i]
                                              for _, _, n, i, _ in group):
                return
            start, end = group[0][0], group[-1][0] + group[-1][1]
            async with slots:
                try:
                    blob = await asyncio.wait_for(
                        self.objects.get_range(pack_key(key), start, end), self.timeout * 4)
                except (SandlotError, TimeoutError) as e:
                    log.warning("%s: pack of %s not read (%s): fetching its chunks one by one",
                                self.what, key, e)
                    return
                done = await asyncio.get_running_loop().run_in_executor(
                    self._bulk_pool, self._unpack_group, blob, start, group)
            for name, index, length in done:
                self._mark(self._files[name], index, length)

        await asyncio.gather(*(one(g) for g in groups))

    def _unpack_group(self, blob: bytes, start: int,
                      group: list[tuple[int, int, str, int, str | None]]
                      ) -> list[tuple[str, int, int]]:
        """(In a thread.) Verify and write a pack range's chunks; those that fail the check
        are left to be fetched one by one."""
        done = []
        for off, length, name, index, b3 in group:
            f = self._files[name]
            if f.present[index]:
                continue
            digest = f.manifest.chunks[index]
            try:
                data = unpack_chunk(blob[off - start:off - start + length], digest, f.chunk,
                                    f"{self.what}, {name} (pack)", blake3=b3)
            except StorageError as e:
                log.warning("%s", e)
                continue
            os.pwrite(f.fd, data, index * f.chunk)
            done.append((name, index, length))
        return done

    def pack(self, limit: int = PACK_CHUNKS) -> tuple[Order, bytes]:
        """(In a thread.) The order read so far and its pack: its first `limit` chunks that
        are local, compressed, one after the other."""
        compress = compressor()
        chunks, offsets, b3s, parts, at = [], [], [], [], 0
        for name, index in list(self.touched):
            f = self._files[name]
            if len(chunks) >= limit or not f.present[index]:
                continue
            size = min(f.chunk, f.manifest.size - index * f.chunk)
            data = os.pread(f.fd, size, index * f.chunk)  # checked when it was fetched
            packed = compress.compress(data)
            chunks.append((name, index))
            offsets.append((at, len(packed)))
            b3s.append(blake3_hex(data))
            parts.append(packed)
            at += len(packed)
        blake3 = b3s if all(b is not None for b in b3s) else None
        return Order(chunks, offsets, blake3), b"".join(parts)

    def first(self) -> list[tuple[str, int]]:
        """The chunks of `FIRST`'s files, which every restore reads whole first."""
        return [(n, i) for n in FIRST if n in self._files
                for i in sorted(self._files[n].manifest.chunks)]

    def everything(self) -> Iterator[tuple[str, int]]:
        """Every chunk of the image, file by file."""
        for name, f in self._files.items():
            for index in sorted(f.manifest.chunks):
                yield name, index

    def _valid(self, chunks: Iterable[tuple[str, int]]) -> Iterator[tuple[str, int]]:
        """`chunks` that name a chunk of the image, each once."""
        seen: set[tuple[str, int]] = set()
        for name, index in chunks:
            f = self._files.get(name)
            if f is not None and 0 <= index < f.count() and (name, index) not in seen:
                seen.add((name, index))
                yield name, index

    async def prefetch(self, chunks: Iterable[tuple[str, int]], parallel: int = PREFETCH
                       ) -> None:
        """Fetch those of `chunks` that are missing, in their order, `parallel` at once
        (chunks the image does not have are skipped); stops at the first failure."""
        queue = self._valid(chunks)

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
