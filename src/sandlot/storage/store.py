"""Images in an object store: chunks (storage/chunks.py), a manifest per image, and the
records that keep garbage collection from taking what an upload is about to use.

Layout (keys under the store's URL)::

    chunks/ab/<sha256>          a zstd-compressed chunk
    manifests/<key>.json        an image: present iff complete
    pending/<key>.<nonce>.json  digests an upload in progress references
    tombstones/<sha256>         a chunk GC found unreferenced (storage/gc.py)
    index/templates/<name>.json a template name -> build, so any server finds it

An upload (`put`): hash the files (only what may have changed, against a base image), write
the pending record, put the chunks the store lacks (a tombstoned chunk counts as lacking: it is
put again and its tombstone dropped), write the manifest last, drop the pending record. A
crash at any point leaves no manifest, so never a half-stored image; GC takes the chunks of
an abandoned upload once its pending record is stale.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import NotFoundError, StorageError
from sandlot.storage.chunks import CHUNK_SIZE, ChunkStore, Data, DigestMemo
from sandlot.storage.lazy import order_key, pack_key
from sandlot.storage.manifest import FileManifest, Manifest
from sandlot.storage.objects import ObjectStore

MANIFESTS = "manifests/"
PENDING = "pending/"
TOMBSTONES = "tombstones/"
TEMPLATES = "index/templates/"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A file to store (or its contents, `chunks.Readable`): with `changed` (byte ranges),
    everything else equals the base's."""

    path: Data
    changed: list[tuple[int, int]] | None = None
    ready: Awaitable | None = None  # the file is complete once this is done (files in order)


def manifest_key(key: str) -> str:
    if not key or "/" in key or key.startswith("."):
        raise StorageError(f"bad image key {key!r}")
    return f"{MANIFESTS}{key}.json"


class Store:
    def __init__(self, objects: ObjectStore, chunk_size: int = CHUNK_SIZE) -> None:
        self.objects = objects
        self.chunks = ChunkStore(objects)
        self.chunk_size = chunk_size

    @property
    def url(self) -> str:
        return self.objects.url

    async def put(self, key: str, kind: str, files: dict[str, Source], machine: dict,
                  meta: dict, base: Manifest | None = None,
                  known: list[Manifest] = (),
                  memo: DigestMemo | None = None) -> tuple[Manifest, int]:
        """Store an image; (its manifest, the compressed bytes it added to the store).

        `base`: an earlier version of these files (a file's `changed` ranges are relative to
        it); `known`: other images whose chunks need not be looked up (a snapshot's template,
        the sandbox's previous snapshot); `memo`: digests of chunks hashed before."""
        t0 = time.monotonic()
        fms: dict[str, FileManifest] = {}
        phases: dict[str, float] = {}
        for name, src in files.items():
            if src.ready is not None:
                t = time.monotonic()
                await src.ready
                phases[f"wait {name}"] = (time.monotonic() - t) * 1000
            t = time.monotonic()
            fms[name] = await self.chunks.hash_file(
                src.path, base.files.get(name) if base else None,
                src.changed if base else None, self.chunk_size, memo)
            phases[f"hash {name}"] = (time.monotonic() - t) * 1000
        manifest = Manifest(key=key, kind=kind, files=fms, machine=machine, meta=meta)
        phases["hash"] = (time.monotonic() - t0) * 1000
        hashed = "" if memo is None else (
            f"; {len(memo.seen) - memo.reused} of {len(memo.seen)} chunks hashed with SHA-256")
        t0 = time.monotonic()
        pending = f"{PENDING}{key}.{secrets.token_hex(4)}.json"
        await self.objects.put(pending, json.dumps(
            {"key": key, "at": time.time(), "digests": sorted(manifest.digests)}).encode())
        try:
            present: set[str] = set()
            for other in ([base] if base else []) + list(known):
                if await self.objects.exists(manifest_key(other.key)):
                    present |= other.digests  # referenced by a live manifest, and by our record
            tombstoned = {o.key.rsplit("/", 1)[1]
                          for o in await self.objects.list(TOMBSTONES)}
            phases["lookup"] = (time.monotonic() - t0) * 1000
            t0 = time.monotonic()
            added = 0
            for name, src in files.items():
                result = await self.chunks.upload(src.path, fms[name], present - tombstoned,
                                                  force=tombstoned)
                added += result.added_bytes
            for digest in tombstoned & manifest.digests:
                await self.objects.delete(TOMBSTONES + digest)
            phases["upload"] = (time.monotonic() - t0) * 1000
            t0 = time.monotonic()
            await self.objects.put(manifest_key(key), manifest.dumps())
        finally:
            await self.objects.delete(pending)
        phases["manifest"] = (time.monotonic() - t0) * 1000
        log.info("stored %s: %.1f MiB added (%s ms%s)", key, added / 2**20,
                 ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), hashed)
        return manifest, added

    async def manifest(self, key: str) -> Manifest:
        try:
            raw = await self.objects.get(manifest_key(key))
        except NotFoundError:
            raise NotFoundError(f"image {key} is not in the store ({self.url})") from None
        return Manifest.loads(raw, key)

    async def exists(self, key: str) -> bool:
        return await self.objects.exists(manifest_key(key))

    async def fetch(self, key: str, targets: dict[str, Path],
                    bases: dict[str, tuple[Path, FileManifest]] | None = None,
                    manifest: Manifest | None = None) -> Manifest:
        """Write the image's files to `targets`, verifying every chunk; with `bases` (a local
        copy of an earlier version of a file, and its manifest) only what differs is fetched."""
        manifest = manifest or await self.manifest(key)
        missing = set(targets) - set(manifest.files)
        if missing:
            raise StorageError(f"image {key} has no {', '.join(sorted(missing))}")
        bases = bases or {}

        async def one(name: str) -> None:
            base_path, base = bases.get(name, (None, None))
            await self.chunks.fetch_file(manifest.files[name], targets[name],
                                         f"image {key}, {name}", base_path, base)

        await asyncio.gather(*(one(n) for n in targets))
        return manifest

    async def delete(self, key: str) -> None:
        """The image is gone; its chunks go with the next GC that finds them unreferenced."""
        await self.objects.delete(manifest_key(key))
        for extra in (order_key(key), pack_key(key)):  # what its lazy restores fetch first
            await self.objects.delete(extra)
        await self.abandon(key)

    async def abandon(self, key: str) -> None:
        """Drop the records of an upload of `key` that will never finish (its process died),
        so GC may take its chunks."""
        for obj in await self.objects.list(f"{PENDING}{key}."):
            await self.objects.delete(obj.key)

    async def keys(self) -> list[str]:
        return sorted(o.key[len(MANIFESTS):-len(".json")]
                      for o in await self.objects.list(MANIFESTS) if o.key.endswith(".json"))

    # ---- template index -----------------------------------------------------------------

    async def put_template(self, name: str, info: dict) -> None:
        await self.objects.put(f"{TEMPLATES}{name}.json", json.dumps(info).encode())

    async def get_template(self, name: str) -> dict:
        try:
            return json.loads(await self.objects.get(f"{TEMPLATES}{name}.json"))
        except NotFoundError:
            raise NotFoundError(f"template {name!r} is not in the store") from None

    async def templates(self) -> list[dict]:
        return [json.loads(await self.objects.get(o.key))
                for o in await self.objects.list(TEMPLATES) if o.key.endswith(".json")]

    async def remove_template(self, name: str) -> None:
        await self.objects.delete(f"{TEMPLATES}{name}.json")
