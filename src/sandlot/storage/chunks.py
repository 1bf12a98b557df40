"""Content-addressed chunks: files cut at fixed offsets, each chunk stored once.

A chunk is zstd-compressed (level 1) and stored under the SHA-256 of its uncompressed bytes
(``chunks/ab/abcd...``), so identical chunks of any file of any image (a snapshot and its
template, two snapshots of one sandbox) are kept once. All-zero chunks are not stored (holes).

`put_file` reads only what may have changed: given the manifest of an earlier version of the
file (`base`) and the byte ranges that may differ from it (`changed`), every other chunk is
taken from the base without reading. A file need not exist yet: anything with a `size`,
`read(offset, length)` and `data_chunks(chunk_size)` (`Readable`: a capture's RAM, served from
its buffer) is stored the same way. Reads, hashing and compression run in threads (zstandard
and hashlib release the GIL), a bounded number of chunks at a time.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import zstandard

try:
    import blake3 as _blake3
except ImportError:  # without it, every chunk that may have changed is hashed with SHA-256
    _blake3 = None

from sandlot.errors import NotFoundError, StorageError
from sandlot.sparse import data_extents
from sandlot.storage.manifest import FileManifest
from sandlot.storage.objects import ObjectStore

CHUNK_SIZE = 64 << 10  # the qcow2 cluster size, and a fine grain for RAM pages
BATCH = 256  # chunks read and hashed per thread task at least (16 MiB at 64 KiB)
HASH_THREADS = 2  # more only contend for the GIL (reads, copies) and two cores
PARALLEL = 16  # object store requests in flight
UPLOAD_BATCH = 16  # chunks compressed and put together (one thread, one fsync of each dir)
UPLOAD_BATCHES = 4  # batches under way at once
# zstd level 1: on guest RAM ~4x faster than level 3 here, for ~5% more bytes (0.244 of the
# raw size against 0.233); a snapshot's new chunks are compressed before it is ready.
LEVEL = 1


class Readable(Protocol):
    """A file's contents without the file."""

    size: int

    def read(self, offset: int, length: int) -> bytes | memoryview: ...

    def read_many(self, offsets: np.ndarray, length: int
                  ) -> Iterator[bytes | memoryview]: ...

    def data_chunks(self, chunk: int) -> np.ndarray: ...


Data = Path | Readable
Buffer = bytes | bytearray | memoryview


def _size(src: Data) -> int:
    return src.stat().st_size if isinstance(src, Path) else src.size


def _chunks(src: Data, indices, chunk: int) -> Iterator[tuple[int, Buffer]]:
    """(index, bytes) of each chunk (a view that is valid until the next one)."""
    indices = np.asarray(indices, dtype=np.int64)
    if not isinstance(src, Path):
        yield from zip(indices.tolist(), src.read_many(indices * chunk, chunk), strict=True)
        return
    with open(src, "rb", buffering=0) as f:
        for i in indices.tolist():
            yield i, os.pread(f.fileno(), chunk, i * chunk)


@functools.lru_cache(maxsize=8)
def _zero_digests(length: int) -> tuple[str, bytes | None]:
    """SHA-256 (hex) and BLAKE3 digests of `length` zero bytes."""
    zeros = bytes(length)
    return (hashlib.sha256(zeros).hexdigest(),
            _blake3.blake3(zeros).digest() if _blake3 is not None else None)


class DigestMemo:
    """SHA-256 digests of chunks hashed before, by their BLAKE3 digest.

    A sandbox's snapshot hashes every chunk it changed since its restore, most of them
    unchanged since its last snapshot. BLAKE3 is ~4x faster than SHA-256 here (SIMD) and
    collision resistant like it, so a chunk whose BLAKE3 digest the last snapshot saw has
    that snapshot's SHA-256 digest, and is not hashed with SHA-256 again. `known`: what the
    last one saw; `seen`: what this one did (the next one's `known`). Thread-safe."""

    def __init__(self, known: dict[bytes, str] | None = None) -> None:
        self.known = known or {}
        self.seen: dict[bytes, str] = {}
        self.reused = 0

    @staticmethod
    def available() -> bool:
        return _blake3 is not None

    def digest(self, data: Buffer) -> str | None:
        """The chunk's SHA-256 digest (hex), or None if it is all zeros."""
        if _blake3 is None:
            return _sha256(data)
        key = _blake3.blake3(data).digest()
        if key == _zero_digests(len(data))[1]:
            return None
        digest = self.known.get(key)
        if digest is None:
            digest = hashlib.sha256(data).hexdigest()
        else:
            self.reused += 1
        self.seen[key] = digest
        return digest


def _sha256(data: Buffer) -> str | None:
    """The chunk's SHA-256 digest (hex), or None if it is all zeros."""
    digest = hashlib.sha256(data).hexdigest()
    return None if digest == _zero_digests(len(data))[0] else digest


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


@dataclass
class PutResult:
    manifest: FileManifest
    added_bytes: int  # compressed bytes this file added to the store
    new: set[str]  # digests it uploaded


def _data_chunks(fd: int, size: int, chunk: int) -> np.ndarray:
    """Indices of the chunks of a sparse file that overlap data (all of them where the file
    system cannot say)."""
    try:
        found = [np.arange(start // chunk, (end - 1) // chunk + 1)
                 for start, end in data_extents(fd, size)]
    except OSError:
        return np.arange(-(-size // chunk))
    return np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def _overlapping(ranges: Iterable[tuple[int, int]], chunk: int) -> np.ndarray:
    idx = [np.arange(off // chunk, (off + length - 1) // chunk + 1)
           for off, length in ranges if length > 0]
    return np.unique(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.int64)


def _read_hash(src: Data, indices: np.ndarray, chunk: int, memo: DigestMemo | None = None
               ) -> list[tuple[int, str | None]]:
    """(index, sha256 hex or None for an all-zero chunk) of each chunk."""
    digest = memo.digest if memo is not None else _sha256
    return [(i, digest(data)) for i, data in _chunks(src, indices, chunk)]


def compressor(level: int = LEVEL) -> zstandard.ZstdCompressor:
    """What packs chunks (one per thread: a compressor is not thread-safe); `unpack_chunk`
    undoes it."""
    return zstandard.ZstdCompressor(level=level)


def _read_compress(src: Data, indices: list[int], chunk: int, level: int) -> list[bytes]:
    pack = compressor(level)
    return [pack.compress(data) for _, data in _chunks(src, indices, chunk)]


class ChunkStore:
    def __init__(self, objects: ObjectStore, level: int = LEVEL, parallel: int = PARALLEL
                 ) -> None:
        self.objects = objects
        self.level = level
        self._slots = asyncio.Semaphore(parallel)

    async def hash_file(self, path: Data, base: FileManifest | None = None,
                        changed: Iterable[tuple[int, int]] | None = None,
                        chunk_size: int = CHUNK_SIZE,
                        memo: DigestMemo | None = None) -> FileManifest:
        """The file's manifest; with `base` and `changed`, chunks outside `changed` are the
        base's (not read); with `memo`, chunks hashed before are not hashed again."""
        size = _size(path)
        reuse = base is not None and changed is not None and base.chunk_size == chunk_size \
            and base.size == size
        if reuse:
            todo = _overlapping(changed, chunk_size)
            chunks = {i: d for i, d in base.chunks.items() if i not in set(todo.tolist())}
        elif isinstance(path, Path):
            with open(path, "rb") as f:
                todo = _data_chunks(f.fileno(), size, chunk_size)
            chunks = {}
        else:
            todo, chunks = path.data_chunks(chunk_size), {}
        todo = todo[todo * chunk_size < size]
        per = max(BATCH, -(-len(todo) // HASH_THREADS))
        batches = [todo[i:i + per] for i in range(0, len(todo), per)]
        for result in await asyncio.gather(*(asyncio.to_thread(_read_hash, path, b, chunk_size,
                                                               memo)
                                             for b in batches)):
            for index, digest in result:
                if digest is None:
                    chunks.pop(index, None)
                else:
                    chunks[index] = digest
        return FileManifest(size=size, chunk_size=chunk_size, chunks=chunks)

    async def upload(self, path: Data, manifest: FileManifest, present: set[str],
                     force: set[str] = frozenset()) -> PutResult:
        """Put the file's chunks that the store lacks. `present`: digests known to be there
        (skipped without asking); `force`: put even if there (GC is about to take them); the
        rest are looked up, and put if missing."""
        first: dict[str, int] = {}
        for index, digest in manifest.chunks.items():
            if digest not in present:
                first.setdefault(digest, index)
        there = await self.objects.existing([chunk_key(d) for d in first if d not in force],
                                            PARALLEL)
        todo = [(d, i) for d, i in first.items() if chunk_key(d) not in there]
        added = 0
        new: set[str] = set()
        batches = asyncio.Semaphore(UPLOAD_BATCHES)

        async def one(batch: list[tuple[str, int]]) -> None:
            nonlocal added
            async with batches:
                packed = await asyncio.to_thread(_read_compress, path, [i for _, i in batch],
                                                 manifest.chunk_size, self.level)
                await self.objects.put_many(
                    [(chunk_key(d), data) for (d, _), data in zip(batch, packed, strict=True)])
                added += sum(len(data) for data in packed)
                new.update(d for d, _ in batch)

        size = max(1, min(UPLOAD_BATCH, -(-len(todo) // UPLOAD_BATCHES)))
        await asyncio.gather(*(one(todo[k:k + size]) for k in range(0, len(todo), size)))
        return PutResult(manifest=manifest, added_bytes=added, new=new)

    async def fetch_file(self, manifest: FileManifest, target: Path, what: str,
                         base_path: Path | None = None,
                         base: FileManifest | None = None) -> None:
        """Write the file to `target` (sparse), verifying every chunk. With a local copy of an
        earlier version (`base_path`, whose manifest is `base`), only the chunks that differ
        are fetched. Nothing is left at `target` on failure."""
        tmp = target.with_name(target.name + ".fetching")
        size, chunk = manifest.size, manifest.chunk_size
        use_base = base is not None and base_path is not None and base.chunk_size == chunk \
            and base.size == size and base_path.exists()
        try:
            if use_base:
                from sandlot.vmm.memory import copy_sparse

                await asyncio.to_thread(copy_sparse, base_path, tmp)
                wanted = {i: d for i, d in manifest.chunks.items() if base.chunks.get(i) != d}
                zeroed = [i for i in base.chunks if i not in manifest.chunks]
            else:
                with open(tmp, "wb") as f:
                    f.truncate(size)
                wanted, zeroed = dict(manifest.chunks), []
            fd = os.open(tmp, os.O_WRONLY)
            try:
                for i in zeroed:
                    os.pwrite(fd, bytes(min(chunk, size - i * chunk)), i * chunk)

                async def one(index: int, digest: str) -> None:
                    async with self._slots:
                        try:
                            packed = await self.objects.get(chunk_key(digest))
                        except NotFoundError:
                            raise StorageError(f"{what}: chunk {digest[:16]}... is missing from "
                                               f"the store") from None
                        data = await asyncio.to_thread(unpack_chunk, packed, digest, chunk, what)
                        await asyncio.to_thread(os.pwrite, fd, data, index * chunk)

                await asyncio.gather(*(one(i, d) for i, d in wanted.items()))
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            tmp.replace(target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def unpack_chunk(packed: bytes, digest: str, chunk: int, what: str,
                 blake3: str | None = None) -> bytes:
    """A chunk's bytes, checked against its SHA-256 `digest`, or against `blake3` (its
    BLAKE3, as a host that checked its SHA-256 recorded it: ~4x faster) where given."""
    try:
        data = zstandard.ZstdDecompressor().decompress(packed, max_output_size=chunk)
    except zstandard.ZstdError as e:
        raise StorageError(f"{what}: chunk {digest[:16]}... is corrupt ({e})") from e
    if blake3 is not None and _blake3 is not None:
        ok = _blake3.blake3(data).hexdigest() == blake3
    else:
        ok = hashlib.sha256(data).hexdigest() == digest
    if not ok:
        raise StorageError(f"{what}: chunk {digest[:16]}... is corrupt (checksum mismatch)")
    return data


def blake3_hex(data: bytes) -> str | None:
    """BLAKE3 of `data` (None without the blake3 module)."""
    return _blake3.blake3(data).hexdigest() if _blake3 is not None else None
