"""Where images are stored: compressed and checksummed, each with a manifest that describes it.

A template build's boot image lives with the build (``<images>/builds/<build>/store``); a
snapshot's in the data dir's store. Each manifest's meta holds the versioned machine
description (vmm/description.py), so a stored image describes itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from sandlot.config import Settings
from sandlot.runtime.base import Image, Stored
from sandlot.storage.blobs import BlobStore
from sandlot.vmm.description import MachineDescription

TEMPLATE_BLOB = "snapshot"


class ImageStore:
    def __init__(self, settings: Settings) -> None:
        self.builds = settings.images / "builds"
        self.snapshots = BlobStore(settings.store_dir)

    def build_dir(self, build: str) -> Path:
        return self.builds / build

    def _where(self, key: str) -> tuple[BlobStore, str]:
        if key.startswith("tpl-"):
            return BlobStore(self.build_dir(key[4:]) / "store"), TEMPLATE_BLOB
        return self.snapshots, key

    async def put(self, key: str, files: dict[str, Path], machine: MachineDescription,
                  meta: dict) -> Stored:
        store, blob = self._where(key)
        manifest = await asyncio.to_thread(store.put, blob, files,
                                           {**meta, "machine": machine.to_dict()})
        return Stored(size_bytes=manifest.size_bytes, stored_bytes=manifest.stored_bytes)

    async def fetch(self, key: str, targets: dict[str, Path]) -> None:
        store, blob = self._where(key)
        await asyncio.to_thread(store.hydrate, blob, targets)

    async def delete(self, key: str) -> None:
        store, blob = self._where(key)
        await asyncio.to_thread(store.delete, blob)

    def exists(self, key: str) -> bool:
        store, blob = self._where(key)
        return store.exists(blob)

    def image(self, key: str, build: str) -> Image:
        """The image `key` as its manifest describes it."""
        store, blob = self._where(key)
        meta = store.manifest(blob).meta
        return Image(key=key, build=build, machine=MachineDescription.from_dict(
            meta.get("machine")))
