"""The runtime's front to the image store: storing captures (digests the VM's last snapshot
hashed are reused), stored images' metadata and deletion, templates published, imported and
reconciled with object storage, and the store's garbage collection."""

from __future__ import annotations

from sandlot.runtime.base import Captured, Image, Stored
from sandlot.runtime.capture import Capturer
from sandlot.runtime.host import Part, QemuHost
from sandlot.storage.chunks import DigestMemo


class StoreFront(Part):
    """Publishes, imports and deletes images in the store (runtime/images.py)."""

    def __init__(self, host: QemuHost, captures: Capturer) -> None:
        super().__init__(host)
        self._captures = captures
        self._memos: dict[str, dict[bytes, str]] = {}  # VM id -> its last snapshot's digests

    def forget(self, vm_id: str) -> None:
        """A VM is gone: its last snapshot's digests with it."""
        self._memos.pop(vm_id, None)

    async def persist(self, captured: Captured, meta: dict) -> Stored:
        key = captured.image.key
        held = self._captures.held(key)
        files: dict = self.cache.paths(key)
        if held.pending is not None:  # the RAM from the capture's buffer: no file yet
            files = self.cache.paths(key, dimm="dimm" in held.pending.files)
            files |= held.pending.files
        # The disk is hashed once flattened (after the RAM, so its flattening overlaps).
        ready = {"disk": held.flatten} if held.flatten is not None else {}
        # What the VM's last snapshot hashed: most of what it changed since its restore is
        # unchanged since then.
        vm = held.vm
        memo = None
        if vm is not None and DigestMemo.available():
            memo = DigestMemo(self._memos.get(vm.id))
        stored = await self.store.put(captured.image, files, held.changed, meta, held.related,
                                      memo, ready, since=held.since)
        if memo is not None and vm is not None and not vm.machine.exited:
            self._memos[vm.id] = memo.seen
        held.stored = True
        return stored

    async def stored_meta(self, key: str) -> dict:
        return dict((await self.store.manifest(key)).meta)

    async def discard(self, key: str) -> None:
        await self.store.delete(key)
        self.cache.discard(key)

    async def publish_template(self, image: Image, info: dict) -> Stored:
        return await self.store.publish_template(image, info)

    async def import_template(self, image: Image, info: dict) -> bool:
        return await self.store.import_template(image, info)

    async def reconcile_template(self, image: Image) -> bool:
        if not await self.store.store.exists(image.key):
            return False
        return await self.store.reconcile_build(image)

    async def template_info(self, name: str) -> dict:
        return await self.store.template_info(name)

    async def collect_garbage(self, grace: float) -> dict:
        from sandlot.storage.gc import collect_garbage

        return vars(await collect_garbage(self.store.store, grace))
