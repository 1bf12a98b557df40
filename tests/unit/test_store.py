"""The chunk store on a local directory: round trips, incremental sizes, fetching only what
differs, corruption, manifest versions, and garbage collection (tests/storage has the same
against a real S3 server)."""

from __future__ import annotations

import asyncio
import os

import pytest

from harness import gc_under_concurrent_uploads, rand, sparse_file
from sandlot.errors import NotFoundError, StorageError
from sandlot.storage.gc import collect_garbage
from sandlot.storage.manifest import Manifest
from sandlot.storage.objects import LocalObjectStore, ObjectStore
from sandlot.storage.store import Source, Store
from sandlot.vmm.memory import data_bytes

MiB = 1 << 20


class Counting(LocalObjectStore):
    """Counts reads, to see what a fetch asked the store for."""

    gets = 0

    async def get(self, key: str) -> bytes:
        if key.startswith("chunks/"):
            self.gets += 1
        return await super().get(key)


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(Counting(tmp_path / "store"))


async def test_round_trip_keeps_holes_and_content(store: Store, tmp_path) -> None:
    src = sparse_file(tmp_path / "ram", 64 * MiB, {0: rand(MiB, 1), 40 * MiB: rand(3 * MiB, 2)})
    manifest, added = await store.put("snap-a", "snapshot", {"ram": Source(src)},
                                      {"machine_type": "pc-q35-7.2"}, {"x": 1})
    assert manifest.size_bytes == 64 * MiB and 0 < added < 5 * MiB
    got = await store.manifest("snap-a")
    assert got.machine == {"machine_type": "pc-q35-7.2"} and got.meta == {"x": 1}
    out = tmp_path / "out"
    await store.fetch("snap-a", {"ram": out})
    assert out.read_bytes() == src.read_bytes()
    assert data_bytes(out) <= 4 * MiB + 2 * 65536  # holes stay holes
    assert await store.keys() == ["snap-a"]


async def test_ten_versions_cost_what_changed(store: Store, tmp_path) -> None:
    """A file of 64 MiB with 16 MiB of (incompressible) data, 2 MiB of it changed between
    versions (scaled from 512/100/10 MiB): each version adds what changed and no more (plus
    chunk alignment), the second at most 15% of the first; ten versions then cost the first
    plus nine changes, the least any store can keep of incompressible data."""
    path = sparse_file(tmp_path / "ram", 64 * MiB, {8 * MiB: rand(16 * MiB, 0)})
    base, added = None, []
    for version in range(10):
        changed = []
        if version:
            offset = 8 * MiB + (version * 1337 * 4096) % (14 * MiB)
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(rand(2 * MiB, 100 + version))
            changed = [(offset, 2 * MiB)]
        base, n = await store.put(f"v{version}", "snapshot", {"ram": Source(path, changed)},
                                  {}, {}, base=base)
        added.append(n)
    assert added[1] <= 0.15 * added[0], added
    assert all(n <= 2 * MiB + 2 * 65536 + 4096 for n in added[1:]), added
    assert sum(added) <= added[0] + 9 * (2 * MiB + 2 * 65536 + 4096), added
    out = tmp_path / "out"
    await store.fetch("v9", {"ram": out})
    assert out.read_bytes() == path.read_bytes()


async def test_fetch_with_a_local_base_reads_only_what_differs(store: Store, tmp_path) -> None:
    path = sparse_file(tmp_path / "ram", 32 * MiB, {0: rand(8 * MiB, 3)})
    v1, _ = await store.put("v1", "snapshot", {"ram": Source(path)}, {}, {})
    old = tmp_path / "old"
    await store.fetch("v1", {"ram": old})
    with open(path, "r+b") as f:
        f.seek(MiB)
        f.write(rand(256 << 10, 4))  # 4 chunks
        f.seek(6 * MiB)
        f.write(bytes(64 << 10))  # a chunk becomes zero
    await store.put("v2", "snapshot", {"ram": Source(path)}, {}, {})
    store.objects.gets = 0
    new = tmp_path / "new"
    await store.fetch("v2", {"ram": new}, bases={"ram": (old, v1.files["ram"])})
    assert new.read_bytes() == path.read_bytes()
    assert store.objects.gets == 4


async def test_corrupt_and_missing_chunks_are_typed_errors(store: Store, tmp_path) -> None:
    path = sparse_file(tmp_path / "ram", 4 * MiB, {0: rand(2 * MiB, 5)})
    manifest, _ = await store.put("s", "snapshot", {"ram": Source(path)}, {}, {})
    digests = sorted(manifest.digests)
    chunk_files = {p.name: p for p in (store.objects.root / "chunks").rglob("*")
                   if p.is_file()}
    victim = chunk_files[digests[0]]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(StorageError, match="corrupt") as err:
        await store.fetch("s", {"ram": out})
    assert "image s" in err.value.message
    assert not out.exists() and not list(tmp_path.glob("out*"))
    victim.unlink()
    with pytest.raises(StorageError, match="missing"):
        await store.fetch("s", {"ram": out})
    assert not out.exists()
    with pytest.raises(NotFoundError):
        await store.manifest("nothing")


async def test_manifest_versions_are_checked(store: Store, tmp_path) -> None:
    path = sparse_file(tmp_path / "f", MiB, {0: b"x"})
    manifest, _ = await store.put("m", "snapshot", {"f": Source(path)}, {}, {})
    for fmt in ("2.0", "1.9"):
        raw = manifest.dumps().replace(b'"format": "1.0"', f'"format": "{fmt}"'.encode())
        with pytest.raises(StorageError, match=f"format {fmt}"):
            Manifest.loads(raw, "m")
    with pytest.raises(StorageError, match="unreadable"):
        Manifest.loads(b'{"format": "1.0"}', "m")


async def test_gc_frees_only_unreferenced_chunks_after_two_passes(store: Store,
                                                                  tmp_path) -> None:
    shared = rand(MiB, 6)
    a = sparse_file(tmp_path / "a", 4 * MiB, {0: shared, 2 * MiB: rand(MiB, 7)})
    b = sparse_file(tmp_path / "b", 4 * MiB, {0: shared})
    ma, _ = await store.put("a", "snapshot", {"f": Source(a)}, {}, {})
    mb, _ = await store.put("b", "snapshot", {"f": Source(b)}, {}, {})
    only_a = ma.digests - mb.digests
    await store.delete("a")
    first = await collect_garbage(store, grace=0)
    assert first.tombstoned == len(only_a) and first.deleted == 0
    second = await collect_garbage(store, grace=0)
    assert second.deleted == len(only_a)
    out = tmp_path / "out"
    await store.fetch("b", {"f": out})
    assert out.read_bytes() == b.read_bytes()


async def test_an_upload_takes_back_tombstoned_chunks(store: Store, tmp_path) -> None:
    data = rand(MiB, 8)
    a = sparse_file(tmp_path / "a", MiB, {0: data})
    await store.put("a", "snapshot", {"f": Source(a)}, {}, {})
    await store.delete("a")
    await collect_garbage(store, grace=0)  # every chunk of a is tombstoned now
    # A new image with the same content: its upload puts them again and drops the tombstones,
    # so the next pass finds them referenced.
    await store.put("again", "snapshot", {"f": Source(a)}, {}, {})
    stats = await collect_garbage(store, grace=0)
    assert stats.deleted == 0
    out = tmp_path / "out"
    await store.fetch("again", {"f": out})
    assert out.read_bytes() == data


async def test_gc_under_concurrent_uploads_loses_nothing(store: Store, tmp_path) -> None:
    await gc_under_concurrent_uploads(store, tmp_path, count=12, mib=4, gcs=30)


async def test_template_index(store: Store) -> None:
    await store.put_template("py", {"name": "py", "hash": "h1"})
    assert (await store.get_template("py"))["hash"] == "h1"
    assert [t["name"] for t in await store.templates()] == ["py"]
    await store.remove_template("py")
    with pytest.raises(NotFoundError):
        await store.get_template("py")


def test_object_keys_are_checked(tmp_path) -> None:
    from sandlot.errors import InvalidArgumentError

    objects: ObjectStore = LocalObjectStore(tmp_path)
    for key in ("../x", "/abs", ""):
        with pytest.raises(InvalidArgumentError):
            asyncio.run(objects.put(key, b""))
    assert not os.listdir(tmp_path)
