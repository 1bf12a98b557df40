"""The chunk store against a real S3 server on loopback (SeaweedFS, started here): round trips,
a second client reading what the first wrote, bounded memory for big files, corrupt and
missing chunks, GC under concurrent uploads, an upload killed half way."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from harness import gc_under_concurrent_uploads, rand, sparse_file
from sandlot.errors import StorageError
from sandlot.storage.chunks import chunk_key
from sandlot.storage.gc import collect_garbage
from sandlot.storage.objects import open_store
from sandlot.storage.store import Source, Store
from sandlot.testing import S3Server

MiB = 1 << 20


@pytest.fixture(autouse=True)
def s3_env(s3, monkeypatch) -> S3Server:
    """The session's S3 server (tests/conftest.py), as the standard variables name it."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return s3


def store_at(s3: S3Server, prefix: str) -> Store:
    return Store(open_store(s3.url(prefix)))


async def test_a_second_client_reads_what_the_first_wrote(s3, tmp_path) -> None:
    first, second = store_at(s3, "t1"), store_at(s3, "t1")
    src = sparse_file(tmp_path / "ram", 32 * MiB, {0: rand(3 * MiB, 1), 20 * MiB: rand(MiB, 2)})
    manifest, added = await first.put("snap-x", "snapshot", {"ram": Source(src)},
                                      {"machine_type": "pc-q35-7.2"}, {"k": "v"})
    assert added > 0 and await second.keys() == ["snap-x"]
    got = await second.manifest("snap-x")
    assert got.machine["machine_type"] == "pc-q35-7.2" and got.digests == manifest.digests
    out = tmp_path / "out"
    await second.fetch("snap-x", {"ram": out})
    assert out.read_bytes() == src.read_bytes()


async def test_big_files_stream_with_bounded_memory(s3, tmp_path) -> None:
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(512 * MiB)
        for i in range(0, 256, 8):  # 256 MiB of data in 8 MiB pieces, some compressible
            f.seek(i * MiB)
            f.write(rand(4 * MiB, i) + bytes(range(256)) * (16 * 1024))
    store = store_at(s3, "big")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    manifest, added = await store.put("big", "snapshot", {"ram": Source(path)}, {}, {})
    put_s = time.monotonic() - t0
    t0 = time.monotonic()
    out = tmp_path / "out"
    await store.fetch("big", {"ram": out})
    get_s = time.monotonic() - t0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"\nS3 on loopback: put {256 / put_s:.0f} MB/s, fetch {256 / get_s:.0f} MB/s, "
          f"peak RSS grew {grown_mib:.0f} MiB, stored {added / MiB:.0f} MiB")
    assert grown_mib < 128, grown_mib
    assert out.read_bytes() == path.read_bytes()


async def test_corrupt_and_deleted_chunks_are_typed_errors(s3, tmp_path) -> None:
    store = store_at(s3, "corrupt")
    src = sparse_file(tmp_path / "ram", 4 * MiB, {0: rand(MiB, 3)})
    manifest, _ = await store.put("s", "snapshot", {"ram": Source(src)}, {}, {})
    digests = sorted(manifest.digests)
    await store.objects.put(chunk_key(digests[0]), b"not zstd at all")
    out = tmp_path / "out"
    with pytest.raises(StorageError, match="corrupt"):
        await store.fetch("s", {"ram": out})
    assert not out.exists()
    await store.objects.delete(chunk_key(digests[0]))
    with pytest.raises(StorageError, match="missing"):
        await store.fetch("s", {"ram": out})
    assert not out.exists()


async def test_gc_under_concurrent_uploads_loses_nothing(s3, tmp_path) -> None:
    await gc_under_concurrent_uploads(store_at(s3, "gc"), tmp_path, count=8, mib=2, gcs=10)


UPLOADER = """
import asyncio, sys
from pathlib import Path
from sandlot.storage.objects import open_store
from sandlot.storage.store import Source, Store
store = Store(open_store(sys.argv[1]))
asyncio.run(store.put("killed", "snapshot", {"f": Source(Path(sys.argv[2]))}, {}, {}))
"""


async def test_an_upload_killed_half_way_leaves_no_image_and_gc_cleans_up(s3, tmp_path) -> None:
    store = store_at(s3, "killed")
    path = sparse_file(tmp_path / "f", 256 * MiB, {0: rand(128 * MiB, 11)})
    proc = subprocess.Popen([sys.executable, "-c", UPLOADER, s3.url("killed"), str(path)],
                            env=os.environ.copy())
    deadline = time.monotonic() + 60
    while len(await store.objects.list("chunks/")) < 50:
        assert proc.poll() is None, "the upload finished before it was killed"
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not await store.exists("killed")
    assert await store.keys() == []
    assert await store.objects.list("pending/")  # its record protects its chunks
    await store.abandon("killed")  # what the server's recovery does for its own uploads
    await collect_garbage(store, grace=0)
    stats = await collect_garbage(store, grace=0)
    assert stats.deleted > 0 and await store.objects.list("chunks/") == []
