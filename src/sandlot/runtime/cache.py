"""The hot cache: uncompressed image files on tmpfs that restores map, held by leases.

One directory per image key holds ``ram`` (mapped copy-on-write by every VM restored from it,
so they share its pages), ``devstate``, ``disk.qcow2`` and, for a VM that had hotplugged memory,
``ram.dimm`` (a filesystem-only image: ``disk.qcow2`` alone); plus ``entry.json`` (whether the
image is also in the store, whether it has memory) and ``.ok`` once the files are complete.
Every user of an entry holds a `Lease`: each VM restored from it, and a capture until its
upload is done. An entry that is not in the store (a fork's) goes with its
last lease; one whose image was deleted (`discard`) too. Stored images stay cached, least
recently used first out once the cache holds more than its bound (`max_bytes`; entries a lease
holds are never evicted), and are hydrated again from the store when missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import StorageError
from sandlot.runtime.lazy import MOUNT, LazyMount

FILES = {"ram": "ram", "devstate": "devstate", "disk": "disk.qcow2", "dimm": "ram.dimm"}
_OK = ".ok"
_ENTRY = "entry.json"

Hydrate = Callable[[dict[str, Path]], Awaitable[None]]
# Mounts an entry's files from the store (runtime/lazy.py): (entry dir, name -> file name)
Mount = Callable[[Path, dict[str, str]], Awaitable[LazyMount]]


@dataclass
class Lease:
    """A hold on one cache entry; `release` (once) lets it go."""

    cache: HotCache
    key: str
    lazy: LazyMount | None = None  # the files are this mount's (fetched as they are read)
    released: bool = field(default=False, repr=False)

    def path(self, name: str) -> Path:
        return self.files()[name]

    def files(self) -> dict[str, Path]:
        """The entry's files that exist (``dimm`` only where there is one)."""
        if self.lazy is not None:
            return self.lazy.files(self.lazy.names)
        return self.cache.paths(self.key)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.cache._release(self)


class HotCache:
    def __init__(self, root: Path, max_bytes: int | None = None,
                 share: Callable[[Path], None] | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._share = share  # makes a ready entry's files usable by confined VMs
        self._leases: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._mounts: dict[str, LazyMount] = {}  # entries served lazily, and their VMs
        self._lazy_holders: dict[str, int] = {}
        for entry in root.iterdir() if root.is_dir() else ():
            if share is not None and (entry / _OK).exists():
                share(entry)
            if (entry / MOUNT).is_dir():  # a lazy mount a server before this one started
                mount = LazyMount.existing(entry)
                if mount.mounted():
                    self._mounts[entry.name] = mount  # its VMs are adopted
                else:
                    mount.unmount()

    def dir(self, key: str) -> Path:
        if "/" in key or key.startswith(".") or not key:
            raise ValueError(f"bad image key {key!r}")
        return self.root / key

    def paths(self, key: str, dimm: bool | None = None, memory: bool | None = None
              ) -> dict[str, Path]:
        """The entry's files: RAM and device state unless it is filesystem-only (`memory`,
        by default as the entry was made), the disk, and the DIMM's RAM where it has one."""
        d = self.dir(key)
        if memory is None:
            memory = self._entry(key).get("memory", True)
        out = {name: d / FILES[name] for name in (("ram", "devstate", "disk") if memory
                                                   else ("disk",))}
        if dimm or (dimm is None and (d / FILES["dimm"]).exists()):
            out["dimm"] = d / FILES["dimm"]
        return out

    def ready(self, key: str) -> bool:
        return (self.dir(key) / _OK).exists()

    def holders(self, key: str) -> int:
        return self._leases.get(key, 0)

    def _entry(self, key: str) -> dict:
        try:
            return json.loads((self.dir(key) / _ENTRY).read_text())
        except (OSError, ValueError):
            return {}

    def _write_entry(self, key: str, **fields) -> None:
        d = self.dir(key)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (_ENTRY + ".tmp")
        tmp.write_text(json.dumps({**self._entry(key), **fields}))
        tmp.replace(d / _ENTRY)

    def _hold(self, key: str, lazy: LazyMount | None = None) -> Lease:
        self._leases[key] = self._leases.get(key, 0) + 1
        if lazy is not None:
            self._lazy_holders[key] = self._lazy_holders.get(key, 0) + 1
        with contextlib.suppress(OSError):
            os.utime(self.dir(key))  # recently used
        return Lease(self, key, lazy)

    async def acquire(self, key: str, dimm: bool, hydrate: Hydrate,
                      identity: str | None = None, memory: bool = True,
                      mount: Mount | None = None) -> Lease:
        """A lease on `key`'s files, hydrating them with `hydrate(paths)` if missing, or
        with `mount` (lazily: the lease's files are the mount's until the entry is complete).

        `identity` names the files the entry must have been made from (a template's build,
        which a rebuild replaces under the same key): an entry made from others is stale and
        made again, never paired with files it was not captured with."""
        for idle in [k for k in self._mounts if not self._lazy_holders.get(k)]:
            self._settle(idle)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            made_from = self._entry(key).get("identity")
            if identity is not None and self.ready(key) and made_from is None:
                self._write_entry(key, identity=identity)  # made before identities were kept
                made_from = identity
            stale = identity is not None and self.ready(key) and made_from != identity
            if stale and self.holders(key):
                raise StorageError(
                    f"image {key} in this host's cache was made from files its build no "
                    "longer has, and running sandboxes use it; kill them to use the new build")
            lazy = self._mounts.get(key)
            if lazy is not None and not stale:
                if lazy.complete() and not self.ready(key):
                    self.mark_ready(key)
                if not self.ready(key):
                    if lazy.failed() is None and lazy.mounted() \
                            and (not dimm or "dimm" in lazy.names):
                        return self._hold(key, lazy)
                    if self.holders(key):
                        raise StorageError(lazy.failed() or f"image {key}: its lazy mount "
                                           "is gone")
            if not self.ready(key) and not stale and self.holders(key):
                raise StorageError(f"image {key} in this host's cache is incomplete and "
                                   "running sandboxes use it; kill them to fetch it again")
            if stale or not self.ready(key) or (dimm and "dimm" not in self.paths(key)):
                self.remove(key)
                self._write_entry(key, persistent=True, identity=identity, memory=memory)
                paths = self.paths(key, dimm, memory)
                if mount is not None:
                    lazy = await mount(self.dir(key), {n: p.name for n, p in paths.items()})
                    self._mounts[key] = lazy
                    lease = self._hold(key, lazy)
                    self.evict()
                    return lease
                await hydrate(paths)
                self.mark_ready(key)
                lease = self._hold(key)
                self.evict()
                return lease
            return self._hold(key)

    def share(self, key: str) -> None:
        """Open the entry to confined VMs before it is ready (`mark_ready` does it then)."""
        if self._share is not None:
            self._share(self.dir(key))

    def hold(self, key: str) -> Lease:
        """A lease on an entry that is there, ready or not (a restore that needs only the
        files it has)."""
        return self._hold(key)

    def forget(self, key: str) -> None:
        """An entry whose RAM files could not be made while VMs use its other files: the
        RAM files go now, the entry with its last lease."""
        for name in ("ram", "dimm"):
            (self.dir(key) / FILES[name]).unlink(missing_ok=True)
        self._write_entry(key, persistent=False)

    def create(self, key: str, persistent: bool, memory: bool = True) -> Lease:
        """A lease on a new, empty entry for a capture to fill (`mark_ready` when done)."""
        self.remove(key)
        self._write_entry(key, persistent=persistent, memory=memory)
        return self._hold(key)

    async def filling(self, key: str) -> Callable[[], None]:
        """Make `acquire(key)` wait (its files are still being written) until the returned
        function is called (once or more). Call right after `create`."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        await lock.acquire()
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                lock.release()

        return release

    def adopt(self, key: str) -> Lease | None:
        """After a restart: a lease on an entry a surviving VM maps."""
        if not self.dir(key).is_dir():
            return None
        return self._hold(key, self._mounts.get(key) if not self.ready(key) else None)

    def mark_ready(self, key: str) -> None:
        self.share(key)
        (self.dir(key) / _OK).touch()

    def _release(self, lease: Lease) -> None:
        key = lease.key
        if lease.lazy is not None:
            lazy_left = self._lazy_holders.get(key, 0) - 1
            if lazy_left > 0:
                self._lazy_holders[key] = lazy_left
            else:  # the last VM that maps the mount is gone
                self._lazy_holders.pop(key, None)
                self._settle(key)
        left = self._leases.get(key, 0) - 1
        if left > 0:
            self._leases[key] = left
            return
        self._leases.pop(key, None)
        if not self._entry(key).get("persistent", False):
            self.remove(key)

    def discard(self, key: str) -> None:
        """The image was deleted: its files go now, or with their last lease."""
        if not self.dir(key).exists():
            return
        lock = self._locks.get(key)
        if self.holders(key) or (lock is not None and lock.locked()):  # held, or being fetched
            self._write_entry(key, persistent=False)
        else:
            self.remove(key)

    def _settle(self, key: str) -> None:
        """A lazy mount no VM maps: complete, its entry is ready and it goes; failed, it
        goes with the entry, as it does if it fetches only what is read; else it stays to
        finish fetching (a later restore maps it, or the first `acquire` after it is complete
        makes the entry ready)."""
        lazy = self._mounts.get(key)
        if lazy is None or self._lazy_holders.get(key):
            return
        if lazy.failed() is None and lazy.complete():
            if not self.ready(key):
                self.mark_ready(key)
            self._unmount(key)
        elif lazy.failed() is not None or not lazy.mounted() or not lazy.prefetch:
            self._unmount(key)
            self._write_entry(key, persistent=False)  # incomplete: goes with its leases

    def _unmount(self, key: str) -> None:
        lazy = self._mounts.pop(key, None)
        if lazy is not None:
            lazy.unmount()

    def lazy(self, key: str) -> LazyMount | None:
        """The entry's lazy mount, while it has one."""
        return self._mounts.get(key)

    def remove(self, key: str) -> None:
        self._unmount(key)
        shutil.rmtree(self.dir(key), ignore_errors=True)

    def keys(self) -> list[str]:
        if not self.root.exists():
            return []
        return [p.name for p in self.root.iterdir() if p.is_dir()]

    def size(self, key: str) -> int:
        """Bytes of data the entry holds (its files are sparse)."""
        from sandlot.vmm.memory import data_bytes

        total = 0
        for path in self.dir(key).iterdir() if self.dir(key).is_dir() else ():
            with contextlib.suppress(OSError):
                total += data_bytes(path)
        return total

    def evict(self) -> list[str]:
        """Drop least recently used unheld entries while the cache is above its bound."""
        if self.max_bytes is None:
            return []
        sizes = {key: self.size(key) for key in self.keys()}
        total = sum(sizes.values())
        evicted = []
        for key in sorted(sizes, key=lambda k: self.dir(k).stat().st_mtime):
            if total <= self.max_bytes:
                break
            if self.holders(key):
                continue
            self.remove(key)
            total -= sizes[key]
            evicted.append(key)
        return evicted

    def prune(self, keep: set[str]) -> list[str]:
        """Remove unheld entries that are not in the store, or are not in `keep`."""
        removed = []
        for key in self.keys():
            if self.holders(key):
                continue
            if key not in keep or not self._entry(key).get("persistent", False):
                self.remove(key)
                removed.append(key)
        return removed
