"""The manifest: what a stored image is made of, and what it is.

One JSON object per image (a snapshot or a template), written after all its chunks, so an
image is in the store exactly when its manifest is. It names every file's chunks by digest
(packed: an index array and a digest array, compressed), and carries two records for the
layers above: `machine` (the versioned machine description, vmm/description.py) and `meta`.

Versioned like Firecracker's snapshot format: ``major.minor``; a reader refuses another major
and a newer minor, and reads are size-capped before parsing.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field

import numpy as np
import zstandard

from sandlot.errors import StorageError

FORMAT = "1.0"
# Why: a manifest lists digests of a few thousand chunks per GiB; anything near this is not
# ours (and must not be parsed into memory).
MAX_MANIFEST = 64 << 20
DIGEST = 32  # SHA-256


@dataclass
class FileManifest:
    """A file as chunks: `chunks[index]` is the SHA-256 (hex) of bytes [index * chunk_size,
    ...) of it; missing indices are zeros (holes)."""

    size: int
    chunk_size: int
    chunks: dict[int, str] = field(default_factory=dict)

    @property
    def digests(self) -> set[str]:
        return set(self.chunks.values())

    def to_json(self) -> dict:
        index = np.array(sorted(self.chunks), dtype=np.uint32)
        digests = b"".join(bytes.fromhex(self.chunks[int(i)]) for i in index)
        pack = zstandard.ZstdCompressor(level=3)
        return {"size": self.size, "chunk_size": self.chunk_size,
                "index": base64.b64encode(pack.compress(index.tobytes())).decode(),
                "digests": base64.b64encode(pack.compress(digests)).decode()}

    @classmethod
    def from_json(cls, data: dict) -> FileManifest:
        unpack = zstandard.ZstdDecompressor()
        index = np.frombuffer(unpack.decompress(base64.b64decode(data["index"]),
                                                max_output_size=MAX_MANIFEST), dtype=np.uint32)
        digests = unpack.decompress(base64.b64decode(data["digests"]),
                                    max_output_size=MAX_MANIFEST)
        if len(digests) != len(index) * DIGEST:
            raise ValueError("chunk index and digests do not match")
        chunks = {int(i): digests[n * DIGEST:(n + 1) * DIGEST].hex() for n, i in enumerate(index)}
        size, chunk_size = int(data["size"]), int(data["chunk_size"])
        if chunk_size <= 0 or any(i * chunk_size >= size for i in chunks):
            raise ValueError("chunk index out of the file")
        return cls(size=size, chunk_size=chunk_size, chunks=chunks)


@dataclass
class Manifest:
    key: str
    kind: str  # "snapshot" or "template"
    files: dict[str, FileManifest]
    machine: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    format: str = FORMAT

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def digests(self) -> set[str]:
        return set().union(*(f.digests for f in self.files.values())) if self.files else set()

    def dumps(self) -> bytes:
        return json.dumps({
            "format": self.format, "key": self.key, "kind": self.kind,
            "created_at": self.created_at, "machine": self.machine, "meta": self.meta,
            "files": {name: f.to_json() for name, f in self.files.items()},
        }).encode()

    @classmethod
    def loads(cls, raw: bytes, key: str = "?") -> Manifest:
        if len(raw) > MAX_MANIFEST:
            raise StorageError(f"image {key}: manifest too large ({len(raw)} bytes)")
        try:
            data = json.loads(raw)
            fmt = str(data.get("format", ""))
            check_format(fmt, key)
            return cls(key=str(data["key"]), kind=str(data["kind"]),
                       files={n: FileManifest.from_json(f) for n, f in data["files"].items()},
                       machine=dict(data.get("machine") or {}),
                       meta=dict(data.get("meta") or {}), created_at=float(data["created_at"]),
                       format=fmt)
        except StorageError:
            raise
        except (ValueError, KeyError, TypeError, zstandard.ZstdError) as e:
            raise StorageError(f"image {key}: unreadable manifest ({e})") from e


def check_format(fmt: str, key: str) -> None:
    """Refuse a manifest of another major version or a newer minor one."""
    try:
        major, minor = (int(x) for x in fmt.split("."))
    except ValueError:
        raise StorageError(f"image {key}: manifest format {fmt!r} is not major.minor") from None
    mine = tuple(int(x) for x in FORMAT.split("."))
    if major != mine[0] or minor > mine[1]:
        raise StorageError(f"image {key}: manifest format {fmt} is not readable by this "
                           f"sandlot (it reads {mine[0]}.0 to {FORMAT})")
