"""The snapshot blob store: sparse round trips, checksums, corruption, old formats."""

from __future__ import annotations

import json
import os

import pytest

from sandlot.errors import NotFoundError, StorageError
from sandlot.storage.blobs import BlobStore


def sparse_file(path, size=64 << 20):
    with open(path, "wb") as f:
        f.truncate(size)
        for offset in (0, 5 << 20, 33 << 20, size - 4096):
            f.seek(offset)
            f.write(os.urandom(4096) * 3 if offset < size - 4096 else os.urandom(4096))
    return path


def test_round_trip_keeps_content_and_holes(tmp_path):
    src = sparse_file(tmp_path / "ram")
    small = tmp_path / "devstate"
    small.write_bytes(os.urandom(1000))
    store = BlobStore(tmp_path / "store")
    manifest = store.put("snap-1", {"ram": src, "devstate": small}, {"memory_mb": 64})
    assert manifest.blobs["ram"].size == 64 << 20
    assert manifest.stored_bytes < 1 << 20  # holes are not stored
    out = tmp_path / "out"
    store.hydrate("snap-1", {"ram": out / "ram", "devstate": out / "devstate"})
    assert (out / "ram").read_bytes() == src.read_bytes()
    assert (out / "devstate").read_bytes() == small.read_bytes()
    assert (out / "ram").stat().st_blocks * 512 < 8 << 20  # hydrated sparse
    assert store.verify("snap-1").meta == {"memory_mb": 64}


def test_allocated_zeros_are_not_stored(tmp_path):
    """A RAM file right after a capture: every page allocated, most of them zero."""
    src = tmp_path / "ram"
    data = bytearray(8 << 20)
    for offset in (0, 100_000, 3 << 20, (8 << 20) - 10):
        data[offset : offset + 10] = os.urandom(10)
    src.write_bytes(bytes(data))
    store = BlobStore(tmp_path / "store")
    info = store.put("snap-z", {"ram": src}).blobs["ram"]
    assert sum(length for _, length in info.extents) <= 4 * (64 << 10) * 2
    assert info.extents[0][0] == 0 and len(info.extents) == 3  # the first two blocks touch
    store.hydrate("snap-z", {"ram": tmp_path / "out"})
    assert (tmp_path / "out").read_bytes() == bytes(data)
    assert (tmp_path / "out").stat().st_blocks * 512 <= 1 << 20


def test_corrupt_or_missing_blob_is_a_storage_error(tmp_path):
    store = BlobStore(tmp_path / "store")
    store.put("snap-1", {"ram": sparse_file(tmp_path / "ram")})
    blob = tmp_path / "store" / "snap-1" / "ram.zst"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="corrupt"):
        store.hydrate("snap-1", {"ram": tmp_path / "out"})
    assert not (tmp_path / "out").exists()
    with pytest.raises(StorageError):
        store.verify("snap-1")
    blob.unlink()
    with pytest.raises(StorageError, match="missing"):
        store.hydrate("snap-1", {"ram": tmp_path / "out"})
    with pytest.raises(NotFoundError):
        store.manifest("snap-2")


def test_unfinished_upload_has_no_manifest(tmp_path):
    store = BlobStore(tmp_path / "store")
    (tmp_path / "store" / "snap-x").mkdir(parents=True)
    (tmp_path / "store" / "snap-x" / "ram.zst").write_bytes(b"partial")
    assert not store.exists("snap-x")
    with pytest.raises(NotFoundError):
        store.hydrate("snap-x", {"ram": tmp_path / "out"})


def test_reads_format_1_and_refuses_unknown_formats(tmp_path):
    import hashlib

    import zstandard

    store = BlobStore(tmp_path / "store")
    d = tmp_path / "store" / "old"
    d.mkdir(parents=True)
    payload = b"hello" * 1000
    (d / "disk.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    info = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
            "stored_size": 1}
    (d / "manifest.json").write_text(json.dumps(
        {"key": "old", "blobs": {"disk": info}, "meta": {}, "format_version": 1}))
    store.hydrate("old", {"disk": tmp_path / "disk"})
    assert (tmp_path / "disk").read_bytes() == payload
    (d / "manifest.json").write_text(json.dumps(
        {"key": "old", "blobs": {}, "meta": {}, "format_version": 99}))
    with pytest.raises(StorageError, match="format 99"):
        store.manifest("old")
