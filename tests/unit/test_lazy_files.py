"""Lazy image files (storage/lazy.py) on a local store: reads fetch just the chunks they span,
once however many read them, verified; a corrupt or missing chunk fails the image and is never
written locally; the prefetch takes the recorded order first and completes the files. The
FUSE mount itself is tested with real VMs (tests/vm/test_lazy_restore.py)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import zstandard

from harness import rand, sparse_file
from sandlot.errors import StorageError
from sandlot.storage.chunks import chunk_key
from sandlot.storage.lazy import LazyFiles, Order, pack_key
from sandlot.storage.objects import LocalObjectStore
from sandlot.storage.store import Source, Store

MiB = 1 << 20
CHUNK = 64 << 10


class Counting(LocalObjectStore):
    def __init__(self, root) -> None:
        super().__init__(root)
        self.gets: list[str] = []

    async def get(self, key: str) -> bytes:
        if key.startswith("chunks/"):
            self.gets.append(key)
            await asyncio.sleep(0.01)  # long enough for readers to overlap
        return await super().get(key)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def _image(tmp_path, loop):
    objects = Counting(tmp_path / "store")
    src = sparse_file(tmp_path / "ram", 8 * MiB, {0: rand(MiB, 1), 4 * MiB: rand(2 * MiB, 2)})
    store = Store(objects)
    manifest = asyncio.run_coroutine_threadsafe(
        store.put("img", "snapshot", {"ram": Source(src)}, {}, {}), loop).result()[0]
    objects.gets.clear()
    files = asyncio.run_coroutine_threadsafe(_files(objects, manifest, tmp_path, loop),
                                             loop).result()
    return objects, src.read_bytes(), manifest, files


async def _files(objects, manifest, where, loop) -> LazyFiles:
    return LazyFiles(objects, {"ram": (manifest.files["ram"], where / "local")}, "image img",
                     loop, attempts=2, timeout=5, backoff=0.01)


def test_reads_fetch_only_what_they_span_once(tmp_path, loop) -> None:
    objects, data, _, files = _image(tmp_path, loop)
    at = 4 * MiB + 3 * CHUNK + 100
    with ThreadPoolExecutor(8) as pool:  # eight readers of the same bytes
        got = list(pool.map(lambda _: files.read("ram", at, 2 * CHUNK), range(8)))
    assert got == [data[at:at + 2 * CHUNK]] * 8
    assert len(objects.gets) == 3  # the three chunks the range spans, each fetched once
    assert files.read("ram", 2 * MiB, 4096) == bytes(4096)  # a hole: nothing fetched
    assert len(objects.gets) == 3
    assert files.touched == [("ram", 67), ("ram", 68), ("ram", 69)]
    assert files.read("ram", 8 * MiB - 10, 100) == data[-10:]  # short at the end


def test_a_corrupt_chunk_fails_the_image_and_is_not_written(tmp_path, loop) -> None:
    objects, data, manifest, files = _image(tmp_path, loop)
    digest = manifest.files["ram"].chunks[1]
    bad = zstandard.ZstdCompressor().compress(b"x" * CHUNK)
    (objects._path(chunk_key(digest))).write_bytes(bad)
    assert files.read("ram", 0, 100) == data[:100]  # chunk 0 is fine
    with pytest.raises(StorageError, match="corrupt"):
        files.read("ram", CHUNK, 100)
    with open(tmp_path / "local", "rb") as f:
        f.seek(CHUNK)
        assert f.read(CHUNK) == bytes(CHUNK)  # nothing of it kept
    assert files.failed and "corrupt" in files.failed
    gets = len(objects.gets)
    with pytest.raises(StorageError):  # another missing chunk: failed at once
        files.read("ram", 5 * MiB, 100)
    assert len(objects.gets) == gets
    assert files.read("ram", 0, 100) == data[:100]  # what is local is still served


def test_a_missing_chunk_is_not_retried(tmp_path, loop) -> None:
    objects, _, manifest, files = _image(tmp_path, loop)
    objects._path(chunk_key(manifest.files["ram"].chunks[2])).unlink()
    with pytest.raises(StorageError, match="missing"):
        files.read("ram", 2 * CHUNK, 10)
    assert len(objects.gets) == 1


def test_the_prefetch_takes_the_order_first_and_completes(tmp_path, loop) -> None:
    objects, data, manifest, files = _image(tmp_path, loop)
    order = [("ram", 70), ("ram", 3), ("ram", 999), ("other", 1), ("ram", 3)]
    asyncio.run_coroutine_threadsafe(files.prefetch([*order, *files.everything()], parallel=1),
                                     loop).result()
    first = [chunk_key(manifest.files["ram"].chunks[i]) for i in (70, 3)]
    assert objects.gets[:2] == first
    assert files.missing == 0 and files.complete.is_set()
    assert (tmp_path / "local").read_bytes() == data
    assert files.stats()["fetched_chunks"] == len(manifest.files["ram"].chunks)


def test_orders_round_trip_and_garbage_is_no_order() -> None:
    order = Order([("ram", 5), ("disk", 1)], [(0, 10), (10, 7)])
    assert Order.loads(order.dumps()) == order
    assert Order.loads(b"{not json") == Order([]) and Order.loads(b'{"chunks": 3}') == Order([])
    assert Order.loads(b'{"chunks": [["ram", 1]], "pack": []}').pack is None  # mismatched


def test_a_pack_brings_the_working_set_in_ranged_reads(tmp_path, loop) -> None:
    objects, data, manifest, first = _image(tmp_path, loop)
    for at in (4 * MiB + 5 * CHUNK, 0, 5 * MiB):  # the first restore reads these
        first.read("ram", at, 100)
    order, blob = first.pack()
    assert order.chunks == [("ram", 69), ("ram", 0), ("ram", 80)]
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result()  # noqa: E731
    run(objects.put(pack_key("img"), blob))
    # Another host: one chunk of the pack is corrupt there; it is fetched on its own.
    broken = bytearray(blob)
    off, length = order.pack[1]
    broken[off:off + length] = bytes(length)
    run(objects.put(pack_key("img"), bytes(broken)))
    objects.gets.clear()
    (tmp_path / "later").mkdir()
    later = run(_files(objects, manifest, tmp_path / "later", loop))
    run(later.load_pack("img", order))
    assert later.fetched_chunks == 2 and objects.gets == []  # from the pack, no chunk reads
    assert later.read("ram", 4 * MiB + 5 * CHUNK, 100) == data[4 * MiB + 5 * CHUNK:][:100]
    assert later.read("ram", 0, 100) == data[:100]  # the corrupt one, fetched on its own
    assert len(objects.gets) == 1


def test_a_spare_mount_process_ends_when_its_server_is_gone() -> None:
    """A spare waits for a mount to serve; its server killed (even before the spare could
    look at it, and with something else holding its stdin open) ends it."""
    import subprocess
    import sys

    gone = subprocess.Popen(["true"])
    gone.wait()  # a server that is gone
    spare = subprocess.Popen([sys.executable, "-m", "sandlot.storage.lazyfs", "--wait",
                              str(gone.pid)], stdin=subprocess.PIPE)
    try:
        assert spare.wait(30) == 0  # stdin still open here: it went on its own
    finally:
        spare.kill()
        spare.stdin.close()
