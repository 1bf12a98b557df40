"""qcow2 disks: overlays on a backing image, flattening, and a running VM's disk chain.

A VM's disk is always three layers (`DiskChain`): its own overlay, its source's disk (the
snapshot or template it was restored from: a qcow2 layer on the template's raw root
filesystem), and that root filesystem. A capture freezes the own overlay at the instant of the
RAM and stacks a new one on it; the frozen layer and the source's become the snapshot's own
two-layer disk (`flatten_pair`), and the frozen layer is merged into the new overlay in the
background (`compact`), so the chain is three layers again however many captures a VM takes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import VmmError

log = logging.getLogger(__name__)
QEMU_IMG = "qemu-img"
CLUSTER = 65536
# What the host does with the guest's discards (fstrim, `mount -o discard`) and all-zero
# writes: they free the overlay's clusters (punched holes in the qcow2 file), so blocks a guest
# frees stop taking host disk. The virtio-blk device offers discard either way (its own
# `discard` property, on by default), so these change no guest-visible state: they are left
# out of vmm.machine.DEVICE_MODEL, and snapshots taken without them load with them and back.
#
# And flushes stop at the host's page cache (`no-flush` on the overlay and its file): QEMU
# flushes every disk at each `stop` (a capture's pause: 25-30 ms more after the guest wrote
# 60 MiB here) and for each guest fsync. A sandbox's disk does not outlive its host (a paused
# or snapshotted one lives in the store, which syncs what it keeps), and what reads a frozen
# layer (qemu-img, the upload) reads it through the same page cache.
DISK_HOST_OPTIONS = (",discard=unmap,detect-zeroes=unmap,cache.no-flush=on,"
                     "file.cache.no-flush=on")
# A write the host cannot complete (its disks directory full: admission should never let it
# come to that, runtime/capacity.py) fails in the guest as an I/O error, rather than stopping
# the VM (QEMU's default for ENOSPC, `werror=enospc`), which would leave it frozen and
# unanswering. Host-side too: a device property that changes nothing in its migration state.
DISK_ERROR_POLICY = ",werror=report,rerror=report"
# The same for an overlay opened over QMP (blockdev-add: a capture's next overlay).
DISK_HOST_QMP = {"discard": "unmap", "detect-zeroes": "unmap", "cache": {"no-flush": True}}
DISK_HOST_FILE_QMP = {"cache": {"no-flush": True}}


async def _qemu_img(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        QEMU_IMG, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode:
        raise VmmError(f"qemu-img {args[0]} failed: {err.decode(errors='replace').strip()}")
    return out.decode()


def backing_file(path: Path) -> Path | None:
    """The backing file a qcow2's header names (None for raw or no backing), read directly:
    a restore needs it before QEMU runs, and qemu-img would cost a process."""
    with open(path, "rb") as f:
        header = f.read(20)
        if len(header) < 20 or header[:4] != b"QFI\xfb":
            return None
        offset = int.from_bytes(header[8:16], "big")
        size = int.from_bytes(header[16:20], "big")
        if not offset or not 0 < size <= 4096:
            return None
        f.seek(offset)
        name = f.read(size).decode(errors="replace")
    backing = Path(name)
    return backing if backing.is_absolute() else path.parent / backing


def virtual_size(path: Path) -> int:
    """The disk size a qcow2's header says (a raw file: its length), read directly."""
    with open(path, "rb") as f:
        header = f.read(32)
    if len(header) >= 32 and header[:4] == b"QFI\xfb":
        return int.from_bytes(header[24:32], "big")
    return path.stat().st_size


async def create_overlay(path: Path, backing: Path, backing_fmt: str, size: int) -> None:
    """A new empty qcow2 on `backing` (not opened: -u, so a busy backing file is fine)."""
    await _qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", str(backing), "-F", backing_fmt,
                    "-o", f"cluster_size={CLUSTER}", str(path), str(size))


# Empty overlays by (backing file, its format, size): an empty qcow2 on a given backing file is
# the same bytes every time (~200 KB), so a restore writes them instead of running qemu-img
# (a process start per VM: ~7 ms of CPU, which fork children of one image all paid).
_EMPTY: dict[tuple[str, str, int], bytes] = {}
_EMPTY_MAX = 32
_EMPTY_MAX_BYTES = 1 << 20
# The first overlay made on a backing file, while it is being made: the fork(N) children of one
# image all come at once, and wait for it rather than each run qemu-img.
_MAKING: dict[tuple[str, str, int], asyncio.Future] = {}


async def create_overlay_cached(path: Path, backing: Path, backing_fmt: str, size: int) -> None:
    """`create_overlay`, from a copy of one made before for the same backing file if any."""
    key = (str(backing), backing_fmt, size)
    data = _EMPTY.get(key)
    making = _MAKING.get(key)
    if data is None and making is not None and not making.get_loop().is_closed():
        await asyncio.shield(making)  # never fails: then this one runs qemu-img itself
        data = _EMPTY.get(key)
    if data is None:
        made = _MAKING[key] = asyncio.get_running_loop().create_future()
        try:
            await create_overlay(path, backing, backing_fmt, size)
            if path.stat().st_size <= _EMPTY_MAX_BYTES:
                if len(_EMPTY) >= _EMPTY_MAX:
                    _EMPTY.pop(next(iter(_EMPTY)))
                _EMPTY[key] = await asyncio.to_thread(path.read_bytes)
        finally:
            made.set_result(None)
            if _MAKING.get(key) is made:
                del _MAKING[key]
        return
    await asyncio.to_thread(_write_new, path, data)


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)


async def flatten_onto(src: Path, dst: Path, base: Path, base_fmt: str) -> None:
    """Copy `src`'s own layer (not its backing chain) into a new qcow2 backed by `base`.

    `src`'s backing file must have the same content as `base` (qemu-img convert -B copies
    only the top layer).
    """
    tmp = dst.with_suffix(".tmp")
    await _qemu_img("convert", "-U", "-q", "-O", "qcow2", "-B", str(base), "-F", base_fmt,
                    "-o", f"cluster_size={CLUSTER}", str(src), str(tmp))
    tmp.replace(dst)


async def flatten_pair(top: Path, lower: Path, dst: Path) -> None:
    """One qcow2 holding `lower`'s layer with `top`'s written over it, on `lower`'s backing.

    `top` is a frozen overlay whose backing is `lower`; `lower` is a snapshot disk whose
    backing is the root filesystem. The result keeps a snapshot's disk at two layers (root
    filesystem + its own), however long its history. Neither input is changed.
    """
    tmp = dst.with_suffix(".tmp")
    merged_top = dst.with_suffix(".top")
    try:
        await asyncio.to_thread(shutil.copyfile, lower, tmp)
        await asyncio.to_thread(shutil.copyfile, top, merged_top)
        await _qemu_img("rebase", "-u", "-b", str(tmp), "-F", "qcow2", str(merged_top))
        await _qemu_img("commit", "-q", str(merged_top))
        tmp.replace(dst)
    finally:
        merged_top.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


_TOP_NAME = re.compile(r"disk-(\d+)\.qcow2$")
_OPENED_NODE = re.compile(r"ov(\d+)")  # open_next's node names


@dataclass
class DiskChain:
    """A VM's disk: its own overlay (`top`) on its source's disk on the root filesystem.

    `Machine` here is vmm.machine.Machine; every method that talks to QEMU takes it. Not safe
    for concurrent use: the runtime calls it under the VM's lock.
    """

    dir: Path
    source: Path  # the source's disk: qcow2 on the root filesystem, never written
    size: int  # virtual size, bytes
    source_fmt: str = "qcow2"  # raw: a cold boot, right on the root filesystem
    index: int = 0
    node: str = "disk0"  # QEMU's node name of `top`
    frozen: Path | None = None  # a layer a capture froze, until `compact` merges it
    owner: int | None = None  # the VM's uid (vmm/jail.py): its overlays are its own
    _next: tuple[Path, str] | None = None

    def _own(self, path: Path) -> None:
        if self.owner is not None:
            os.chown(path, self.owner, self.owner)
            os.chmod(path, 0o700 if path.is_dir() else 0o600)

    @property
    def top(self) -> Path:
        return self.dir / f"disk-{self.index}.qcow2"

    async def create(self) -> Path:
        """The VM's first overlay, on its source's disk."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._own(self.dir)
        self.top.unlink(missing_ok=True)
        await create_overlay_cached(self.top, self.source, self.source_fmt, self.size)
        self._own(self.top)
        return self.top

    # ---- capture: open_next before the pause, stack_next in it -------------------------

    def _spare(self) -> Path:
        """Where `prepare_next` leaves the next overlay (named for the top it goes on)."""
        return self.dir / f"spare-{self.index + 1}-{self.size}.qcow2"

    async def prepare_next(self) -> None:
        """Make the next capture's overlay file ahead of it (its `open_next` then only
        opens it, with no qemu-img to run)."""
        spare = self._spare()
        for old in self.dir.glob("spare-*"):
            if old != spare:
                old.unlink(missing_ok=True)
        if spare.exists():
            return
        tmp = spare.with_name(spare.name + ".tmp")
        try:
            await create_overlay(tmp, self.top, "qcow2", self.size)
            self._own(tmp)
            tmp.replace(spare)
        finally:
            tmp.unlink(missing_ok=True)

    async def open_next(self, machine) -> None:
        """Create (or take `prepare_next`'s) and open the next overlay (not yet in the
        chain), so the pause only stacks it. Its backing is the current top, which it will
        freeze."""
        path = self.dir / f"disk-{self.index + 1}.qcow2"
        node = f"ov{self.index + 1}"
        try:
            self._spare().replace(path)
        except FileNotFoundError:
            await create_overlay(path, self.top, "qcow2", self.size)
        try:
            self._own(path)
            await machine.execute("blockdev-add", {
                "driver": "qcow2", "node-name": node, "backing": None, **DISK_HOST_QMP,
                "file": {"driver": "file", "filename": str(path), "aio": "threads",
                         **DISK_HOST_FILE_QMP},
            })
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self._next = (path, node)

    async def stack_next(self, machine) -> None:
        """With the VM stopped: the opened overlay goes on top; the old top is frozen."""
        if self._next is None:
            raise VmmError("no overlay opened to stack")
        path, node = self._next
        await machine.execute("blockdev-snapshot", {"node": self.node, "overlay": node})
        self.frozen = self.top
        self.index += 1
        self.node = node
        self._next = None
        machine.spec = machine.spec.with_(disk=path)
        machine.spec.save()

    async def drop_next(self, machine) -> None:
        """A capture failed before `stack_next`: close and remove the opened overlay."""
        if self._next is None:
            return
        path, node = self._next
        self._next = None
        try:
            await machine.execute("blockdev-del", {"node-name": node})
        except VmmError:
            pass
        path.unlink(missing_ok=True)

    async def flatten_frozen(self, out: Path) -> None:
        """The snapshot's own disk: the frozen layer over the source's, on the root fs."""
        if self.frozen is None:
            raise VmmError("no frozen disk layer to flatten")
        if self.source_fmt == "qcow2":
            await flatten_pair(self.frozen, self.source, out)
        else:
            await flatten_onto(self.frozen, out, self.source, self.source_fmt)

    async def compact(self, machine, timeout: float = 600) -> None:
        """Merge the frozen layer into the top (QMP block-stream), so the chain is top <-
        source again, and remove it. Runs while the guest runs."""
        if self.frozen is None:
            return
        nodes = await machine.execute("query-named-block-nodes", {"flat": True})
        base = next((n["node-name"] for n in nodes
                     if n.get("drv") == self.source_fmt and n.get("file") == str(self.source)),
                    None)
        if base is None:
            raise VmmError(f"no disk node for {self.source}")
        job = f"merge-{self.node}"
        await machine.execute("block-stream", {"job-id": job, "device": self.node,
                                               "base-node": base})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(j.get("device") == job or j.get("id") == job
                  for j in await machine.execute("query-block-jobs")):
            if loop.time() > deadline:
                raise VmmError(f"block-stream {job} did not finish in {timeout}s")
            await asyncio.sleep(0.02)
        self.frozen.unlink(missing_ok=True)
        self.frozen = None

    # ---- persistence ----------------------------------------------------------------------

    @classmethod
    async def adopt(cls, dir: Path, source: Path, size: int, machine,
                    owner: int | None = None) -> DiskChain:
        """The chain of a VM an earlier server process left running, as QEMU has it (a
        capture may have stacked an overlay whose merge never ran)."""
        node, top, backing = await machine.top_disk()
        match = _TOP_NAME.search(top.name)
        chain = cls(dir=dir, source=source, size=size, index=int(match.group(1)) if match else 0,
                    node=node, owner=owner)
        if backing and Path(backing) != source:
            chain.frozen = Path(backing)
        await chain.drop_strays(machine)
        return chain

    async def drop_strays(self, machine) -> None:
        """Close and remove overlays a capture opened (`open_next`) but never stacked, its
        server killed in between: QEMU still has them open and write-locked, so the next
        capture could not make its overlay under the same name."""
        for node in await machine.execute("query-named-block-nodes", {"flat": True}):
            match = _OPENED_NODE.fullmatch(node.get("node-name") or "")
            if match and int(match.group(1)) > self.index:
                log.info("closing overlay node %s a capture left open", node["node-name"])
                try:
                    await machine.execute("blockdev-del", {"node-name": node["node-name"]})
                except VmmError as e:
                    log.warning("cannot close overlay node %s: %s", node["node-name"], e)
        for path in self.dir.glob("disk-*.qcow2"):
            match = _TOP_NAME.search(path.name)
            if match and int(match.group(1)) > self.index:
                path.unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- size -----------------------------------------------------------------------------

    def held(self) -> int:
        """The bytes the writable layer (`top`) takes on the host now."""
        try:
            return self.top.stat().st_blocks * 512
        except FileNotFoundError:
            return 0

    async def grow(self, machine, size: int) -> None:
        """Grow the disk the guest sees to `size` bytes (QMP block_resize of the top layer:
        the guest is told by the device's config interrupt); never shrinks. The layers a
        capture stacks later have the new size; their flattened images keep it."""
        if size <= self.size:
            return
        await machine.execute("block_resize", {"node-name": self.node, "size": size})
        self.size = size

