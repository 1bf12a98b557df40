"""Restore sources: the uncompressed files a restore maps (the hot cache), and where they come from.

A source is a template's boot snapshot or a user snapshot. Its hot files (``ram``, ``devstate``,
``disk.qcow2``) live on tmpfs so every restore shares the RAM file's page cache; when they are
missing (after a reboot, or evicted) they are hydrated from the blob store, checksums verified.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.errors import InvalidStateError
from sandlot.storage.blobs import BlobStore
from sandlot.vmm.machine import DEVICE_MODEL

HOT_FILES = ("ram", "devstate", "disk")
_OK = ".ok"


@dataclass(frozen=True)
class Source:
    """Everything a restore needs to know about where it comes from."""

    key: str  # hot cache entry: "tpl-<hash>" or a snapshot id
    build: Path  # template build dir: vmlinuz, initramfs.gz, rootfs.ext4
    store: BlobStore
    blob_key: str
    memory_mb: int  # main RAM
    cpus: int
    dimm_mb: int = 0  # hotplugged RAM captured with the snapshot
    env: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    snapshot_id: str | None = None
    workdir: str | None = None
    device_model: str = ""

    def check_loadable(self) -> None:
        """A snapshot only loads into the device model it was taken with."""
        if self.device_model != DEVICE_MODEL:
            what = f"template {self.template!r}" if not self.snapshot_id else \
                f"snapshot {self.snapshot_id}"
            fix = (f"rebuild it: `sandlot template build {self.template}`"
                   if not self.snapshot_id else "it cannot be restored by this version")
            raise InvalidStateError(
                f"{what} was taken with VM device model {self.device_model or '?'}, this "
                f"server runs model {DEVICE_MODEL}: {fix}")

    @property
    def kernel(self) -> Path:
        return self.build / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.build / "initramfs.gz"

    @property
    def rootfs(self) -> Path:
        return self.build / "rootfs.ext4"


class HotCache:
    """Uncompressed snapshot files on tmpfs, one directory per source key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._locks: dict[str, asyncio.Lock] = {}

    def dir(self, key: str) -> Path:
        return self.root / key

    def paths(self, key: str, dimm: bool = False) -> dict[str, Path]:
        d = self.dir(key)
        paths = {"ram": d / "ram", "devstate": d / "devstate", "disk": d / "disk.qcow2"}
        if dimm or (d / "ram.dimm").exists():
            paths["dimm"] = d / "ram.dimm"
        return paths

    def ready(self, key: str, dimm: bool = False) -> bool:
        return (self.dir(key) / _OK).exists() and all(
            p.exists() for p in self.paths(key, dimm).values())

    def mark_ready(self, key: str) -> None:
        (self.dir(key) / _OK).touch()

    async def ensure(self, source: Source) -> dict[str, Path]:
        """The source's hot files, hydrating them from the blob store if needed."""
        lock = self._locks.setdefault(source.key, asyncio.Lock())
        async with lock:
            dimm = bool(source.dimm_mb)
            if not self.ready(source.key, dimm):
                self.remove(source.key)
                paths = self.paths(source.key, dimm)
                await asyncio.to_thread(source.store.hydrate, source.blob_key, paths)
                self.mark_ready(source.key)
        return self.paths(source.key, bool(source.dimm_mb))

    def remove(self, key: str) -> None:
        shutil.rmtree(self.dir(key), ignore_errors=True)

    def keys(self) -> list[str]:
        if not self.root.exists():
            return []
        return [p.name for p in self.root.iterdir() if p.is_dir()]
