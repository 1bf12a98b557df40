"""Where images live: the store (storage.Store: chunks and manifests, a directory or S3) and
what a host keeps of template builds.

A snapshot is stored against what it came from: its RAM file's chunks outside the pages the VM
changed are its source image's (not read again), and chunks the source or the sandbox's
previous snapshot already has are not looked up. A template is stored whole: its boot image
and its build's kernel, initramfs and root filesystem, plus an index entry (name -> build), so
a server that never built it can restore it.

Locally, a build keeps its boot image uncompressed (``builds/<hash>/image``), so this host
fills its hot cache from there without the store; a store that lacks the template (a new
store, a test's) is given it by `import_template`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
from collections import OrderedDict
from collections.abc import Awaitable
from pathlib import Path

from sandlot.config import Settings
from sandlot.errors import NotFoundError
from sandlot.runtime.base import Image, Stored
from sandlot.storage.chunks import Data, DigestMemo
from sandlot.storage.manifest import Manifest
from sandlot.storage.objects import open_store
from sandlot.storage.store import Source, Store
from sandlot.vmm.description import MachineDescription
from sandlot.vmm.memory import copy_sparse

STORED_MARK = ".stored"  # in a build dir: the store's manifest this build was found equal to
BUILD_FILES = {"vmlinuz": "vmlinuz", "initramfs": "initramfs.gz", "rootfs": "rootfs.ext4"}
IMAGE_FILES = {"ram": "ram", "devstate": "devstate", "disk": "disk.qcow2", "dimm": "ram.dimm"}
LOCAL_IMAGE = "image"
MANIFEST_CACHE = 64
log = logging.getLogger(__name__)


class ImageStore:
    def __init__(self, settings: Settings) -> None:
        self.store = Store(open_store(settings.store_url))
        self.builds = settings.images / "builds"
        self._manifests: OrderedDict[str, Manifest] = OrderedDict()
        self._build_locks: dict[str, asyncio.Lock] = {}

    def build_dir(self, build: str) -> Path:
        return self.builds / build

    def local_image(self, build: str) -> Path:
        """A build's boot image, uncompressed, as the build left it."""
        return self.build_dir(build) / LOCAL_IMAGE

    def identity(self, image: Image) -> str | None:
        """What a template image's cached files were made from: its build's root filesystem
        and boot RAM as they are on disk now (a rebuild under the same hash, or a wiped data
        dir, gives new files). None for snapshots: their keys are never reused."""
        if not image.is_template:
            return None
        parts = []
        for path in (self.build_dir(image.build) / BUILD_FILES["rootfs"],
                     self.local_image(image.build) / IMAGE_FILES["ram"]):
            try:
                st = path.stat()
            except FileNotFoundError:
                parts.append("-")
                continue
            parts.append(f"{st.st_ino}.{st.st_mtime_ns}.{st.st_size}")
        return "/".join(parts)

    async def manifest(self, key: str) -> Manifest:
        manifest = self._manifests.get(key)
        if manifest is None:
            manifest = await self.store.manifest(key)
            self._manifests[key] = manifest
            while len(self._manifests) > MANIFEST_CACHE:
                self._manifests.popitem(last=False)
        self._manifests.move_to_end(key)
        return manifest

    async def _first(self, keys: list[str]) -> list[Manifest]:
        out = []
        for key in keys:
            try:
                out.append(await self.manifest(key))
            except NotFoundError:
                continue
        return out

    async def put(self, image: Image, files: dict[str, Data],
                  changed: dict[str, list[tuple[int, int]]], meta: dict,
                  related: list[str], memo: DigestMemo | None = None,
                  ready: dict[str, Awaitable] | None = None,
                  since: tuple[str, dict[str, list[tuple[int, int]]]] | None = None) -> Stored:
        """Store a captured image. `related`: images it came from, nearest first (its
        source, the sandbox's previous snapshot); `changed`: per file, the byte ranges that
        may differ from the first of them; `since`: another image and, per file, the byte
        ranges that may differ from it (the sandbox's last stored capture and what was written
        since: used first while its manifest is there). A file is a path or its contents (a
        capture's RAM before its file is written); `ready`: per file, what to wait for before
        reading it."""
        ranges = {related[0]: changed} if related else {}
        if since is not None and since[0] != image.key:
            related = [since[0], *(k for k in related if k != since[0])]
            ranges = {since[0]: since[1], **ranges}
        known = await self._first(related)
        base = known[0] if known and image.key != known[0].key else None
        ready = ready or {}
        base_ranges = ranges.get(base.key, {}) if base is not None else {}
        sources = {n: Source(p, base_ranges.get(n) if base is not None and base.key in ranges
                             else None, ready.get(n))
                   for n, p in files.items()}
        manifest, added = await self.store.put(
            image.key, "template" if image.is_template else "snapshot", sources,
            image.machine.to_dict(), {**meta, "build": image.build}, base=base,
            known=known[1:], memo=memo)
        self._manifests[image.key] = manifest
        return Stored(size_bytes=manifest.size_bytes, stored_bytes=added)

    def local(self, image: Image, names: tuple[str, ...] = ("ram", "devstate", "disk")) -> bool:
        """Whether this host has the image's files without the store (a template it built)."""
        local = self.local_image(image.build)
        return image.is_template and all((local / IMAGE_FILES[n]).exists() for n in names)

    async def fetch(self, image: Image, targets: dict[str, Path]) -> None:
        """An image's files into `targets`: a template's from its local build when this host
        has it, else from the store, every chunk verified."""
        local = self.local_image(image.build)
        if self.local(image, tuple(targets)):
            for name, target in targets.items():
                await asyncio.to_thread(copy_sparse, local / IMAGE_FILES[name], target)
            return
        await self.store.fetch(image.key, targets, manifest=await self.manifest(image.key))

    async def delete(self, key: str) -> None:
        self._manifests.pop(key, None)
        await self.store.delete(key)

    async def image(self, key: str) -> Image:
        """An image as its manifest describes it (for a host that never saw it)."""
        manifest = await self.manifest(key)
        return Image(key=key, build=str(manifest.meta.get("build", "")),
                     machine=MachineDescription.from_dict(manifest.machine))

    # ---- templates ------------------------------------------------------------------------

    async def publish_template(self, image: Image, info: dict) -> Stored:
        """Store a template build whole (boot image and build files), unless the store has
        it, and point its name at it."""
        if await self.store.exists(image.key):
            stored = Stored(size_bytes=(await self.manifest(image.key)).size_bytes,
                            stored_bytes=0)
        else:
            local, build = self.local_image(image.build), self.build_dir(image.build)
            files = {n: local / f for n, f in IMAGE_FILES.items() if (local / f).exists()}
            files |= {n: build / f for n, f in BUILD_FILES.items()}
            stored = await self._put_whole(image, files, {"template": info.get("name")})
        await self.store.put_template(str(info["name"]), info)
        return stored

    async def _put_whole(self, image: Image, files: dict[str, Path], meta: dict) -> Stored:
        manifest, added = await self.store.put(
            image.key, "template", {n: Source(p) for n, p in files.items()},
            image.machine.to_dict(), {**meta, "build": image.build})
        return Stored(size_bytes=manifest.size_bytes, stored_bytes=added)

    async def import_template(self, image: Image, info: dict) -> bool:
        """Give the store a template this host has built, if it lacks it. True if it did.
        If the store has another build under the same hash (built on another host: root
        filesystems are not reproducible), the store's replaces this host's, so that every
        host restores a snapshot over the root filesystem it was taken on."""
        if not all((self.build_dir(image.build) / f).exists() for f in BUILD_FILES.values()):
            return False
        if await self.store.exists(image.key):
            await self.reconcile_build(image)
            return False
        await self.publish_template(image, info)
        (self.build_dir(image.build) / STORED_MARK).write_text(
            _fingerprint(await self.manifest(image.key)))
        return True

    async def reconcile_build(self, image: Image) -> bool:
        """Make this host's build of `image` the store's; True if it had to be replaced."""
        manifest = await self.manifest(image.key)
        build, mark = self.build_dir(image.build), self.build_dir(image.build) / STORED_MARK
        if mark.exists() and mark.read_text() == _fingerprint(manifest):
            return False  # checked before, against this very manifest
        local = await self.store.chunks.hash_file(build / BUILD_FILES["rootfs"])
        stored = manifest.files.get("rootfs")
        if stored is not None and (local.size, local.chunks) != (stored.size, stored.chunks):
            log.warning("template build %s: this host's root filesystem differs from the "
                        "store's (built elsewhere under the same hash); using the store's",
                        image.build)
            tmp = build.with_name(build.name + ".replacing")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / LOCAL_IMAGE).mkdir(parents=True)
            names = {n: tmp / f for n, f in BUILD_FILES.items()}
            names |= {n: tmp / LOCAL_IMAGE / f for n, f in IMAGE_FILES.items()
                      if n in manifest.files}
            try:
                await self.store.fetch(image.key, names, manifest=manifest)
                for f in BUILD_FILES.values():  # new inodes: running VMs keep the old ones
                    (tmp / f).replace(build / f)
                shutil.rmtree(build / LOCAL_IMAGE, ignore_errors=True)
                (tmp / LOCAL_IMAGE).replace(build / LOCAL_IMAGE)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            mark.write_text(_fingerprint(manifest))
            return True
        mark.write_text(_fingerprint(manifest))
        return False

    async def ensure_build(self, build: str) -> Path:
        """The build's kernel, initramfs and root filesystem on this host, fetched from the
        store if this host never had them."""
        d = self.build_dir(build)
        if all((d / f).exists() for f in BUILD_FILES.values()):
            return d
        lock = self._build_locks.setdefault(build, asyncio.Lock())
        async with lock:
            if all((d / f).exists() for f in BUILD_FILES.values()):
                return d
            tmp = d.with_name(d.name + ".fetching")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                await self.store.fetch(f"tpl-{build}",
                                       {n: tmp / f for n, f in BUILD_FILES.items()},
                                       manifest=await self.manifest(f"tpl-{build}"))
                d.mkdir(parents=True, exist_ok=True)
                for f in BUILD_FILES.values():
                    (tmp / f).replace(d / f)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return d

    async def template_info(self, name: str) -> dict:
        return await self.store.get_template(name)


def _fingerprint(manifest: Manifest) -> str:
    """What identifies a stored template build's root filesystem."""
    rootfs = manifest.files.get("rootfs")
    chunks = sorted(rootfs.chunks.items()) if rootfs is not None else []
    return hashlib.sha256(json.dumps([manifest.created_at, chunks]).encode()).hexdigest()
