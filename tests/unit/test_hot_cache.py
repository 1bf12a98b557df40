"""The hot cache never pairs an image's cached files with files they were not made from: an
entry made from another build (a rebuild under the same hash, a wiped data dir) is made
again; one that running sandboxes still map is refused with a clear error."""

from __future__ import annotations

import pytest

from sandlot.errors import StorageError
from sandlot.runtime.cache import HotCache


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
