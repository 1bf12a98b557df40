"""Garbage collection of chunks: safe with several servers sharing a store, and with uploads
and restores running meanwhile.

Two phases, a grace period apart. A chunk referenced by no manifest and no pending upload, and
older than the grace period, gets a tombstone; a later run deletes chunks whose tombstone is
older than the grace period and that are still unreferenced (and drops the tombstones of chunks
referenced again). Why it is safe: an upload writes its pending record (every digest it will
reference) before it looks at any chunk, and puts again any chunk it finds tombstoned; so a
chunk an upload relies on without putting it was untombstoned when the upload looked, and a
run that deletes it must come a whole grace period after its tombstone, when it finds the
upload's pending record or manifest. The assumption: an upload, and a GC run, take less than
the grace period. Restores only read chunks of manifests that exist, which reference them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from sandlot.errors import NotFoundError, StorageError
from sandlot.storage.chunks import chunk_key
from sandlot.storage.lazy import ORDERS
from sandlot.storage.manifest import Manifest
from sandlot.storage.store import MANIFESTS, PENDING, TOMBSTONES, Store

log = logging.getLogger(__name__)
GRACE = 3600.0
PENDING_LIMIT = 24 * 3600.0  # an upload's record older than this was abandoned


@dataclass
class GcStats:
    manifests: int = 0
    chunks: int = 0
    referenced: int = 0
    tombstoned: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    revived: int = 0


async def references(store: Store, now: float) -> tuple[set[str], int]:
    """Digests referenced by pending uploads and by manifests (stale upload records are
    dropped). Pending records are read first: an upload that finishes meanwhile has written
    its manifest before the manifests are listed."""
    refs: set[str] = set()
    for obj in await store.objects.list(PENDING):
        if now - obj.modified > PENDING_LIMIT:
            await store.objects.delete(obj.key)
            continue
        try:
            refs |= set(json.loads(await store.objects.get(obj.key))["digests"])
        except NotFoundError:
            continue  # that upload finished meanwhile: its manifest is read below
        except (ValueError, KeyError) as e:
            raise StorageError(f"unreadable upload record {obj.key}: {e}") from e
    count = 0
    for obj in await store.objects.list(MANIFESTS):
        try:
            refs |= Manifest.loads(await store.objects.get(obj.key), obj.key).digests
            count += 1
        except NotFoundError:
            continue  # deleted meanwhile
    return refs, count


async def collect_garbage(store: Store, grace: float = GRACE) -> GcStats:
    now = time.time()
    refs, manifests = await references(store, now)
    stats = GcStats(manifests=manifests, referenced=len(refs))
    tombs = {o.key[len(TOMBSTONES):]: o.modified for o in await store.objects.list(TOMBSTONES)}
    chunks = {o.key.rsplit("/", 1)[1]: o for o in await store.objects.list("chunks/")}
    stats.chunks = len(chunks)
    for digest, marked in tombs.items():
        if digest in refs:
            await store.objects.delete(TOMBSTONES + digest)
            stats.revived += 1
        elif now - marked >= grace:
            if await store.objects.head(TOMBSTONES + digest) is None:
                continue  # an upload took it back just now
            info = chunks.get(digest)
            await store.objects.delete(chunk_key(digest))
            await store.objects.delete(TOMBSTONES + digest)
            stats.deleted += 1
            stats.deleted_bytes += info.size if info else 0
    for digest, info in chunks.items():
        if digest not in refs and digest not in tombs and now - info.modified >= grace:
            await store.objects.put(TOMBSTONES + digest, b"")
            stats.tombstoned += 1
    # Prefetch orders of images that are gone (one recorded after its image was deleted).
    images = {o.key[len(MANIFESTS):-len(".json")] for o in await store.objects.list(MANIFESTS)}
    for obj in await store.objects.list(ORDERS):
        if obj.key[len(ORDERS):].rsplit(".", 1)[0] not in images \
                and now - obj.modified >= grace:
            await store.objects.delete(obj.key)
    log.info("store GC of %s: %s", store.url, stats)
    return stats
