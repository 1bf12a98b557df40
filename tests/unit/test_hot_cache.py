"""The hot cache never pairs an image's cached files with files they were not made from: an
entry made from another build (a rebuild under the same hash, a wiped data dir) is made
again; one that running sandboxes still map is refused with a clear error."""

from __future__ import annotations

import asyncio

import pytest

from sandlot.errors import StorageError
from sandlot.runtime.cache import HotCache
from sandlot.runtime.lazy import LazyMount


def hydrator(calls: list[str], content: str):
    async def hydrate(paths):
        calls.append(content)
        for path in paths.values():
            path.write_text(content)
    return hydrate


async def test_an_entry_made_from_other_files_is_made_again(tmp_path) -> None:
    cache = HotCache(tmp_path / "hot")
    calls: list[str] = []
    lease = await cache.acquire("tpl-x", False, hydrator(calls, "old"), identity="build-1")
    lease.release()
    again = await cache.acquire("tpl-x", False, hydrator(calls, "unused"), identity="build-1")
    again.release()
    assert calls == ["old"]  # same build: the cached files are used
    fresh = await cache.acquire("tpl-x", False, hydrator(calls, "new"), identity="build-2")
    assert calls == ["old", "new"]
    assert fresh.files()["ram"].read_text() == "new"
    fresh.release()


async def test_a_stale_entry_in_use_is_refused(tmp_path) -> None:
    cache = HotCache(tmp_path / "hot")
    held = await cache.acquire("tpl-x", False, hydrator([], "old"), identity="build-1")
    with pytest.raises(StorageError, match="no longer has"):
        await cache.acquire("tpl-x", False, hydrator([], "new"), identity="build-2")
    assert held.files()["ram"].read_text() == "old"  # what the running VM maps is untouched
    held.release()


async def test_an_entry_from_before_identities_is_kept(tmp_path) -> None:
    cache = HotCache(tmp_path / "hot")
    calls: list[str] = []
    (await cache.acquire("tpl-x", False, hydrator(calls, "old"))).release()
    (await cache.acquire("tpl-x", False, hydrator(calls, "x"), identity="build-1")).release()
    (await cache.acquire("tpl-x", False, hydrator(calls, "y"), identity="build-1")).release()
    assert calls == ["old"]


async def test_a_restore_waits_for_an_entry_whose_files_are_being_written(tmp_path) -> None:
    """A snapshot is ready before its RAM file is written (runtime/qemu.py): a restore from
    the cache entry meanwhile waits for it, and never takes it for a broken one to fetch."""
    cache = HotCache(tmp_path / "hot")
    calls: list[str] = []
    capture = cache.create("snap-a", persistent=True)
    filled = await cache.filling("snap-a")
    restore = asyncio.create_task(cache.acquire("snap-a", False, hydrator(calls, "store")))
    await asyncio.sleep(0.05)
    assert not restore.done()
    for path in cache.paths("snap-a").values():
        path.write_text("captured")
    cache.mark_ready("snap-a")
    filled()
    filled()  # once or more
    lease = await asyncio.wait_for(restore, 5)
    assert calls == [] and lease.files()["ram"].read_text() == "captured"
    lease.release()
    capture.release()


async def test_an_entry_whose_files_could_not_be_written_is_fetched(tmp_path) -> None:
    cache = HotCache(tmp_path / "hot")
    calls: list[str] = []
    capture = cache.create("snap-a", persistent=True)
    filled = await cache.filling("snap-a")
    restore = asyncio.create_task(cache.acquire("snap-a", False, hydrator(calls, "store")))
    await asyncio.sleep(0.05)
    cache.paths("snap-a")["ram"].write_text("half")
    cache.remove("snap-a")  # the write failed
    filled()
    capture.release()
    lease = await asyncio.wait_for(restore, 5)
    assert calls == ["store"] and lease.files()["ram"].read_text() == "store"
    lease.release()


class FakeMount(LazyMount):
    """A lazy mount without FUSE: its files are plain files in the mount dir."""

    unmounted = False

    def mounted(self) -> bool:
        return not self.unmounted

    def unmount(self) -> None:
        self.unmounted = True


def mounter(made: list[FakeMount]):
    async def mount(entry, names):
        lazy = FakeMount(entry, names, prefetch=8)
        lazy.path.mkdir()
        for filename in names.values():
            (lazy.path / filename).write_text("lazy")
        made.append(lazy)
        return lazy
    return mount


async def test_a_lazy_entry_is_shared_until_complete_then_ready(tmp_path) -> None:
    cache = HotCache(tmp_path / "hot")
    made: list[FakeMount] = []
    one = await cache.acquire("snap-1", False, hydrator([], "never"), mount=mounter(made))
    two = await cache.acquire("snap-1", False, hydrator([], "never"), mount=mounter(made))
    assert len(made) == 1 and one.lazy is two.lazy is made[0]
    assert one.files()["ram"] == made[0].path / "ram" and not cache.ready("snap-1")
    entry = cache.dir("snap-1")
    for name in ("ram", "devstate", "disk.qcow2"):  # what the mount's process fills in
        (entry / name).write_text("local")
    (entry / "lazy.complete").write_text("{}")
    three = await cache.acquire("snap-1", False, hydrator([], "never"), mount=mounter(made))
    assert three.lazy is None and three.files()["ram"].read_text() == "local"
    assert cache.ready("snap-1") and len(made) == 1
    one.release()
    assert not made[0].unmounted  # `two` still maps it
    two.release()
    assert made[0].unmounted
    three.release()
    assert cache.ready("snap-1")  # kept, as a hydrated entry is


async def test_a_failed_lazy_entry_is_refused_then_mounted_afresh(tmp_path) -> None:
    cache = HotCache(tmp_path / "hot")
    made: list[FakeMount] = []
    held = await cache.acquire("snap-1", False, hydrator([], "never"), mount=mounter(made))
    (cache.dir("snap-1") / "lazy.failed").write_text("chunk 1234 is corrupt")
    with pytest.raises(StorageError, match="corrupt"):
        await cache.acquire("snap-1", False, hydrator([], "never"), mount=mounter(made))
    held.release()
    assert made[0].unmounted and not cache.dir("snap-1").exists()
    again = await cache.acquire("snap-1", False, hydrator([], "never"), mount=mounter(made))
    assert len(made) == 2 and again.lazy is made[1]
    again.release()
