"""Snapshot blob store: a local directory of zstd-compressed, checksummed blobs per snapshot.

Layout: ``<root>/<key>/<name>.zst`` plus ``manifest.json``, written last and atomically, so a
directory without a manifest is an unfinished upload and never a snapshot. Reads verify every
blob's SHA-256 while decompressing; a mismatch or a missing blob is a StorageError.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zstandard

from sandlot.errors import NotFoundError, StorageError

# 2: blobs hold only the data extents of sparse files (RAM files are mostly holes); 1 (whole
# files) is still read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
CHUNK = 1 << 20
PAGE = 4096
_ZERO_PAGE = bytes(PAGE)
# Holes shorter than this are read through (fewer seeks on a fragmented RAM file); their zero
# blocks are then skipped like any others (ZERO_BLOCK).
MIN_HOLE = 1 << 20
# Zero blocks this big inside the data are skipped too: a RAM file just captured has every page
# allocated (the zero ones are given back in the background), and reading, checksumming and
# compressing its zeros would be most of an upload's work.
ZERO_BLOCK = 64 << 10
_ZEROS = bytes(ZERO_BLOCK)
# Why: a manifest is an extent list and a few checksums; anything bigger is not ours.
MAX_MANIFEST = 16 << 20


@dataclass
class BlobInfo:
    size: int  # apparent size of the file
    sha256: str  # of the stored stream: the data extents, in order
    stored_size: int
    extents: list[list[int]] | None = None  # [offset, length]; None: the whole file


@dataclass
class Manifest:
    key: str
    blobs: dict[str, BlobInfo]
    meta: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def stored_bytes(self) -> int:
        return sum(b.stored_size for b in self.blobs.values())

    @property
    def size_bytes(self) -> int:
        return sum(b.size for b in self.blobs.values())


def _storage_error(what: str, e: OSError) -> StorageError:
    return StorageError(f"{what}: {e.strerror or e}", cause=e)


class BlobStore:
    """Compressed, checksummed snapshot blobs under one directory."""

    def __init__(self, root: Path, level: int = 3, threads: int = 2) -> None:
        self.root = root
        self.level = level
        self.threads = threads

    def _dir(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise StorageError(f"bad blob key {key!r}")
        return self.root / key

    def put(self, key: str, files: dict[str, Path], meta: dict | None = None) -> Manifest:
        """Compress and checksum `files` under `key`; the manifest is written last."""
        d = self._dir(key)
        try:
            d.mkdir(parents=True, exist_ok=True)
            blobs = {name: self._put_one(src, d / f"{name}.zst") for name, src in files.items()}
            manifest = Manifest(key=key, blobs=blobs, meta=meta or {})
            tmp = d / "manifest.json.tmp"
            with open(tmp, "w") as f:
                json.dump(asdict(manifest), f)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(d / "manifest.json")
            _fsync_dir(d)
        except OSError as e:
            raise _storage_error(f"writing snapshot {key}", e) from e
        return manifest

    def _put_one(self, src: Path, dst: Path) -> BlobInfo:
        sha = hashlib.sha256()
        cctx = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            size = os.fstat(fin.fileno()).st_size
            stored_extents: list[list[int]] = []
            with cctx.stream_writer(fout, closefd=False) as writer:
                for offset, length in data_extents(fin.fileno(), size):
                    fin.seek(offset)
                    while length > 0:
                        chunk = fin.read(min(CHUNK, length))
                        if not chunk:
                            raise StorageError(f"{src} changed while it was being stored")
                        for at, piece in nonzero_pieces(chunk, offset):
                            last = stored_extents[-1] if stored_extents else None
                            if last is not None and last[0] + last[1] == at:
                                last[1] += len(piece)
                            else:
                                stored_extents.append([at, len(piece)])
                            sha.update(piece)
                            writer.write(piece)
                        offset += len(chunk)
                        length -= len(chunk)
            fout.flush()
            os.fsync(fout.fileno())
            stored = fout.tell()
        return BlobInfo(size=size, sha256=sha.hexdigest(), stored_size=stored,
                        extents=stored_extents)

    def manifest(self, key: str) -> Manifest:
        path = self._dir(key) / "manifest.json"
        try:
            if path.stat().st_size > MAX_MANIFEST:
                raise StorageError(f"snapshot {key}: manifest too large")
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"snapshot data for {key} not found") from None
        except (OSError, ValueError) as e:
            raise StorageError(f"snapshot {key}: unreadable manifest: {e}") from e
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise StorageError(f"snapshot {key}: format {version} is not supported "
                               f"(this sandlot reads {FORMAT_VERSION})")
        blobs = {name: BlobInfo(**info) for name, info in raw["blobs"].items()}
        return Manifest(key=raw["key"], blobs=blobs, meta=raw.get("meta", {}))

    def hydrate(self, key: str, targets: dict[str, Path]) -> Manifest:
        """Decompress blobs to `targets` (sparse), verifying sizes and checksums."""
        manifest = self.manifest(key)
        for name, target in targets.items():
            info = manifest.blobs.get(name)
            if info is None:
                raise StorageError(f"snapshot {key}: no blob {name!r}")
            self._get_one(key, name, info, target)
        return manifest

    def _get_one(self, key: str, name: str, info: BlobInfo, target: Path) -> None:
        src = self._dir(key) / f"{name}.zst"
        tmp = target.with_name(target.name + ".hydrating")
        sha = hashlib.sha256()
        size = 0
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                reader = zstandard.ZstdDecompressor().stream_reader(fin)
                for offset, length in info.extents or [[0, info.size]]:
                    fout.seek(offset)
                    for chunk in _read_exact(reader, length):
                        sha.update(chunk)
                        size += len(chunk)
                        _write_sparse(fout, chunk)
                if reader.read(1):
                    raise zstandard.ZstdError("data after the last extent")
                fout.truncate(info.size)
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"snapshot {key}: blob {name} is missing") from None
        except zstandard.ZstdError as e:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"snapshot {key}: blob {name} is corrupt ({e})") from e
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _storage_error(f"snapshot {key}: reading blob {name}", e) from e
        if size != _data_size(info) or sha.hexdigest() != info.sha256:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"snapshot {key}: blob {name} is corrupt (checksum mismatch)")
        tmp.replace(target)

    def verify(self, key: str) -> Manifest:
        """Check every blob decompresses to its recorded checksum, without writing anything."""
        manifest = self.manifest(key)
        for name, info in manifest.blobs.items():
            sha = hashlib.sha256()
            size = 0
            try:
                with open(self._dir(key) / f"{name}.zst", "rb") as fin:
                    reader = zstandard.ZstdDecompressor().stream_reader(fin)
                    while chunk := reader.read(CHUNK):
                        sha.update(chunk)
                        size += len(chunk)
            except (OSError, zstandard.ZstdError) as e:
                raise StorageError(f"snapshot {key}: blob {name} unreadable ({e})") from e
            if size != _data_size(info) or sha.hexdigest() != info.sha256:
                raise StorageError(f"snapshot {key}: blob {name} is corrupt (checksum mismatch)")
        return manifest

    def exists(self, key: str) -> bool:
        return (self._dir(key) / "manifest.json").exists()

    def delete(self, key: str) -> None:
        shutil.rmtree(self._dir(key), ignore_errors=True)

    def keys(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())


def data_extents(fd: int, size: int) -> list[list[int]]:
    """[offset, length] of the parts of a file that hold data (SEEK_DATA/SEEK_HOLE), with
    holes shorter than MIN_HOLE folded in; the whole file where the filesystem can't tell."""
    extents: list[list[int]] = []
    offset = 0
    try:
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after offset
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if extents and start - (extents[-1][0] + extents[-1][1]) < MIN_HOLE:
                extents[-1][1] = end - extents[-1][0]
            else:
                extents.append([start, end - start])
            offset = end
    except OSError:
        return [[0, size]] if size else []
    return extents


def nonzero_pieces(chunk: bytes, offset: int) -> Iterator[tuple[int, bytes]]:
    """(file offset, data) of the runs of `chunk` (read at `offset`) that are not whole zero
    blocks of ZERO_BLOCK bytes."""
    start = None
    for i in range(0, len(chunk), ZERO_BLOCK):
        block = chunk[i : i + ZERO_BLOCK]
        if block == _ZEROS[: len(block)]:
            if start is not None:
                yield offset + start, chunk[start:i]
                start = None
        elif start is None:
            start = i
    if start is not None:
        yield offset + start, chunk[start:]


def _data_size(info: BlobInfo) -> int:
    return sum(length for _, length in info.extents) if info.extents is not None else info.size


def _read_exact(reader, length: int):
    while length > 0:
        chunk = reader.read(min(CHUNK, length))
        if not chunk:
            raise zstandard.ZstdError("stream ends before the last extent")
        length -= len(chunk)
        yield chunk


def _write_sparse(f, chunk: bytes) -> None:
    """Write `chunk`, seeking over whole zero pages so tmpfs does not allocate them."""
    mv = memoryview(chunk)
    start = 0
    n = len(chunk)
    i = 0
    while i < n:
        if chunk[i : i + PAGE] == _ZERO_PAGE:  # bytes compare: memcmp, unlike memoryview's
            if start < i:
                f.write(mv[start:i])
            f.seek(min(PAGE, n - i), os.SEEK_CUR)
            start = i + PAGE
        i += PAGE
    if start < n:
        f.write(mv[start:n])


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
