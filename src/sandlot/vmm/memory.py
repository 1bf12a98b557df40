"""Guest RAM as the host sees it: which pages a VM changed, and copies of them.

A restored VM maps its RAM file copy-on-write (``share=off``: MAP_PRIVATE). A page the guest,
or QEMU for it, writes becomes an anonymous page of the QEMU process, and /proc/PID/pagemap
tells those apart from pages still backed by the file. So a restored VM's memory is its RAM
file plus its anonymous pages: what it changed since the restore, known exactly and without
dirty tracking (the kernel keeps it for us; QEMU's own dirty log lost pages under TCG, see
docs/design.md). A cold-booted VM's RAM is anonymous: its present pages, over zeros.

A capture reads those pages out of the stopped process (`process_vm_readv`, into a buffer
mapped before the pause) and writes a new RAM file: the old one with them written over it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sandlot.errors import VmmError
from sandlot.sparse import data_extents

PAGE = 4096
_PRESENT = np.uint64(1 << 63)
_SWAPPED = np.uint64(1 << 62)
_FILE = np.uint64(1 << 61)
_IOV_MAX = 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_MAP_NORESERVE = 0x4000
COPY_BUFFER = 8 << 20

_libc = ctypes.CDLL(None, use_errno=True)
for _call in (_libc.process_vm_readv, _libc.process_vm_writev):
    _call.restype = ctypes.c_ssize_t
    _call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]


@dataclass(frozen=True)
class Region:
    """One guest RAM block in QEMU's address space."""

    name: str  # "ram" or "dimm": the file it becomes in an image
    start: int
    size: int
    base: Path | None  # the file it maps copy-on-write; None: anonymous (over zeros)


def regions(pid: int, ram: tuple[Path | None, int], dimm: tuple[Path | None, int] | None
            ) -> list[Region]:
    """The RAM blocks of QEMU `pid`: main RAM (`ram`: its file or None, size in bytes) and a
    DIMM if it has one. Anonymous blocks are found by their size."""
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            maps.append((start, end - start, fields[5] if len(fields) >= 6 else None))
    out = []
    for name, block in (("ram", ram), ("dimm", dimm)):
        if block is None:
            continue
        path, size = block
        found = [m for m in maps if m[1] == size and (
            m[2] == str(path) if path is not None else m[2] is None)]
        taken = {r.start for r in out}
        found = [m for m in found if m[0] not in taken]
        if not found:
            raise VmmError(f"QEMU {pid}: no mapping of its {name} ({size >> 20} MiB)")
        out.append(Region(name, found[0][0], size, path))
    return out


def changed_pages(pid: int, region: Region) -> np.ndarray:
    """Indices of the region's pages that differ from its base: anonymous (or swapped) pages
    of a file-backed region, present (or swapped) pages of an anonymous one."""
    count = region.size // PAGE
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
        f.seek(region.start // PAGE * 8)
        raw = f.read(count * 8)
    entries = np.frombuffer(raw, dtype=np.uint64)
    if len(entries) != count:
        raise VmmError(f"QEMU {pid}: short page map ({len(entries)} of {count} pages)")
    mask = (entries & (_PRESENT | _SWAPPED)) != 0
    if region.base is not None:
        mask &= (entries & _FILE) == 0
    return np.flatnonzero(mask)


def runs(pages: np.ndarray) -> np.ndarray:
    """Sorted page indices as (first page, count) runs, shape (n, 2)."""
    if len(pages) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return np.stack([pages[starts], ends - starts], axis=1).astype(np.int64)


class PageBuffer:
    """Anonymous memory for page copies, mapped and faulted in before a pause (so the copy in
    the pause only copies); grows if a copy needs more. `populate`: fault in only that many
    pages of it (the rest is reserved address space, faulted in when written)."""

    def __init__(self, pages: int, populate: int | None = None) -> None:
        self._map: mmap.mmap | None = None
        self.pages = 0
        self._grow(pages, populate)

    def _grow(self, pages: int, populate: int | None = None) -> None:
        if pages <= self.pages:
            return
        size = max(pages, 1)
        grown = mmap.mmap(-1, size * PAGE,
                          flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        if self._map is not None:  # only once the new one is there: a failed grow keeps it
            self._map.close()
        self._map, self.pages = grown, size
        touch = self.pages if populate is None else max(0, min(populate, self.pages))
        if not touch:
            return
        try:
            self._map.madvise(_MADV_POPULATE_WRITE, 0, touch * PAGE)
        except OSError:
            self._map[: touch * PAGE: PAGE] = b"\0" * touch  # touch every page instead

    @property
    def address(self) -> int:
        pointer = ctypes.c_char.from_buffer(self._map)
        try:
            return ctypes.addressof(pointer)
        finally:
            del pointer  # the buffer stays exported while the ctypes object lives

    def view(self, pages: int) -> memoryview:
        with memoryview(self._map) as whole:
            return whole[: pages * PAGE]

    def close(self) -> None:
        if self._map is not None:
            mapped, self._map = self._map, None
            try:
                mapped.close()
            except BufferError:  # a view of it lives on (in a traceback): unmapped with it
                pass


@dataclass
class Delta:
    """Pages copied out of one region: `pages[i]` (ascending) is at `data[slots[i] * PAGE:]`;
    without `slots`, at `data[i * PAGE:]`."""

    region: Region
    pages: np.ndarray
    data: memoryview
    slots: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return len(self.pages) * PAGE

    def slot_of(self) -> np.ndarray:
        """Each page's slot in `data`."""
        if self.slots is None:
            return np.arange(len(self.pages), dtype=np.int64)
        return self.slots


def read_pages(pid: int, regions_pages: list[tuple[Region, np.ndarray]], buffer: PageBuffer,
               threads: int = 2) -> list[Delta]:
    """Copy the given pages out of process `pid` into `buffer`, one region after the other,
    in `threads` threads (see `copy_pages`)."""
    total = sum(len(p) for _, p in regions_pages)
    buffer._grow(total)
    deltas, parts = [], []
    offset = 0
    view = buffer.view(total)
    for region, pages in regions_pages:
        parts.append((region, pages, np.arange(offset, offset + len(pages), dtype=np.int64)))
        deltas.append(Delta(region, pages, view[offset * PAGE: (offset + len(pages)) * PAGE]))
        offset += len(pages)
    view.release()
    copy_pages(pid, parts, buffer.address, threads)
    return deltas


def copy_pages(pid: int, parts: list[tuple[Region, np.ndarray, np.ndarray]], address: int,
               threads: int = 2, *, into: bool = False) -> None:
    """Copy pages of process `pid` to local memory at `address`: for each (region, pages,
    slots), page `pages[i]` of the region to `address + slots[i] * PAGE`. In `threads`
    threads that each copy an equal share of the bytes (a run of pages is cut where a share
    ends: one run often holds most of what changed). `into`: the other way, from local
    memory into the process (a copy-on-write mapping of it gets its own pages)."""
    local_parts, remote_parts, length_parts = [], [], []
    total = 0
    for region, pages, slots in parts:
        if not len(pages):
            continue
        pages, slots = np.asarray(pages, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(slots) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(pages)]))
        local_parts.append(address + slots[starts] * PAGE)
        remote_parts.append(region.start + pages[starts] * PAGE)
        length_parts.append((ends - starts) * PAGE)
        total += len(pages)
    if not total:
        return
    shares = _shares(np.concatenate(local_parts).astype(np.int64),
                     np.concatenate(remote_parts).astype(np.int64),
                     np.concatenate(length_parts).astype(np.int64),
                     threads if total > 256 else 1)

    call, verb = ((_libc.process_vm_writev, "writing") if into
                  else (_libc.process_vm_readv, "reading"))

    def copy(share: tuple[np.ndarray, np.ndarray]) -> None:
        local, remote = share
        for i in range(0, len(local), _IOV_MAX):
            lo, re = local[i:i + _IOV_MAX], remote[i:i + _IOV_MAX]
            want = int(lo[:, 1].sum())
            got = call(pid, lo.ctypes.data, len(lo), re.ctypes.data, len(re), 0)
            if got != want:
                err = ctypes.get_errno()
                raise VmmError(f"{verb} guest RAM of QEMU {pid}: {got} of {want} bytes "
                               f"({os.strerror(err) if got < 0 else 'short copy'})")

    if len(shares) <= 1:
        for share in shares:
            copy(share)
    else:
        with concurrent.futures.ThreadPoolExecutor(len(shares)) as pool:
            list(pool.map(copy, shares))


def write_delta(pid: int, region: Region, delta: Delta, threads: int = 2) -> None:
    """Write `delta`'s pages into process `pid`'s `region` (another QEMU's mapping of the
    file the delta was taken over): that process's memory becomes the delta's image."""
    if not len(delta.pages):
        return
    pointer = ctypes.c_char.from_buffer(delta.data)
    try:
        address = ctypes.addressof(pointer)
    finally:
        del pointer
    copy_pages(pid, [(region, delta.pages, delta.slot_of())], address, threads, into=True)


def _shares(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, n: int
            ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Runs (local address, remote address, length) as `n` (local, remote) iovec arrays of
    about equal bytes, cutting runs at page boundaries where a share ends."""
    total = int(lengths.sum())
    if total == 0:
        return []
    n = max(1, min(n, total // PAGE))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cuts = [round(total * k / n / PAGE) * PAGE for k in range(1, n)]
    out = []
    lo = 0
    for hi in cuts + [total]:
        if hi <= lo:
            continue
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))  # runs [first, last) overlap
        begin = np.maximum(lo - starts[first:last], 0)  # int64 (addresses < 2**47)
        stop = np.minimum(lengths[first:last], hi - starts[first:last])
        loc = np.empty((last - first, 2), dtype=np.uint64)
        rem = np.empty((last - first, 2), dtype=np.uint64)
        loc[:, 0] = local[first:last] + begin
        rem[:, 0] = remote[first:last] + begin
        loc[:, 1] = rem[:, 1] = stop - begin
        out.append((loc, rem))
        lo = hi
    return out


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy `src`'s data extents to a new sparse `dst` of the same size."""
    with open(src, "rb", buffering=0) as fin:
        _copy_sparse_fd(fin.fileno(), dst, str(src))


def _copy_sparse_fd(fd: int, dst: Path, what: str) -> None:
    with open(dst, "wb", buffering=0) as fout:
        size = os.fstat(fd).st_size
        fout.truncate(size)
        buf = bytearray(COPY_BUFFER)
        for start, end in data_extents(fd, size):
            pos = start
            while pos < end:
                n = os.preadv(fd, [memoryview(buf)[: min(len(buf), end - pos)]], pos)
                if n <= 0:
                    raise VmmError(f"{what} changed while it was copied")
                os.pwrite(fout.fileno(), memoryview(buf)[:n], pos)
                pos += n


def write_image(delta: Delta, out: Path, base_fd: int | None = None) -> None:
    """`out`: the region's base file (or zeros) with the delta's pages written over it; zero
    pages become holes, so tmpfs holds only data. `base_fd`: the base file, already open."""
    if base_fd is not None:
        _copy_sparse_fd(base_fd, out, str(delta.region.base))
    elif delta.region.base is not None:
        copy_sparse(delta.region.base, out)
    else:
        with open(out, "wb") as f:
            f.truncate(delta.region.size)
    if not len(delta.pages):
        return
    words = np.frombuffer(delta.data, dtype=np.uint64).reshape(-1, PAGE // 8)
    all_slots = delta.slot_of()
    nonzero = words.any(axis=1)[all_slots]
    fd = os.open(out, os.O_WRONLY)
    try:
        for kind, selected in ((True, nonzero), (False, ~nonzero)):
            for first, slot, count in joint_runs(delta.pages[selected], all_slots[selected]):
                if kind:
                    os.pwrite(fd, delta.data[slot * PAGE: (slot + count) * PAGE], first * PAGE)
                elif delta.region.base is not None:  # zero over old data: make it a hole
                    _punch(fd, first * PAGE, count * PAGE)
    finally:
        os.close(fd)


class Patched:
    """A region's new contents before (or without) its file: its base file (an open fd, so
    that it stays readable whatever happens to its path) or zeros, with a delta's pages over
    it. `read` serves any byte range, from any thread; `write` makes the file."""

    def __init__(self, delta: Delta) -> None:
        self.delta = delta
        self.size = delta.region.size
        self._fd = (os.open(delta.region.base, os.O_RDONLY)
                    if delta.region.base is not None else None)

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """The bytes at `offset` (a page boundary): a view of the buffer where every page of
        the range changed (valid until `close`), else a copy."""
        length = max(0, min(length, self.size - offset))
        if offset % PAGE:
            raise ValueError("reads start at a page")
        first, count = offset // PAGE, -(-length // PAGE)
        lo, hi = (int(x) for x in np.searchsorted(self.delta.pages, [first, first + count]))
        return self._read(offset, length, lo, hi)

    def read_many(self, offsets: np.ndarray, length: int) -> Iterator[bytes | memoryview]:
        """`read(offset, length)` of each offset (ascending page boundaries)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        firsts = offsets // PAGE
        bounds = np.searchsorted(self.delta.pages, np.concatenate(
            [firsts, firsts + -(-length // PAGE)]))
        his = bounds[len(offsets):]
        for k, offset in enumerate(offsets.tolist()):
            yield self._read(offset, max(0, min(length, self.size - offset)), int(bounds[k]),
                             int(his[k]))

    def _read(self, offset: int, length: int, lo: int, hi: int) -> bytes | memoryview:
        """Pages lo:hi of the delta are the changed ones in the range."""
        first, count = offset // PAGE, -(-length // PAGE)
        pages, data, slots = self.delta.pages, self.delta.data, self.delta.slots
        if hi - lo == count and (slots is None or hi - lo <= 1 or bool(
                (np.diff(slots[lo:hi]) == 1).all())):
            at = lo if slots is None or hi == lo else int(slots[lo])
            return data[at * PAGE: at * PAGE + length]  # every page of the range changed
        buf = bytearray(length)
        if self._fd is not None:
            os.preadv(self._fd, [buf], offset)  # short at the end of the base: zeros stay
        page_slots = np.arange(lo, hi) if slots is None else slots[lo:hi]
        for page, slot, n in joint_runs(pages[lo:hi], page_slots):
            at = (page - first) * PAGE
            end = min(at + n * PAGE, length)
            buf[at:end] = data[slot * PAGE: slot * PAGE + end - at]
        return buf

    def data_chunks(self, chunk: int) -> np.ndarray:
        """Indices of the `chunk`-byte chunks that may hold data (the rest are zeros)."""
        found = [self.delta.pages // (chunk // PAGE)]
        if self._fd is not None:
            found += [np.arange(start // chunk, (end - 1) // chunk + 1)
                      for start, end in data_extents(self._fd, self.size)]
        return np.unique(np.concatenate(found)).astype(np.int64)

    def write(self, out: Path) -> None:
        write_image(self.delta, out, self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self.delta.data.release()
        except BufferError:  # exported (an array in a failed write's traceback): freed with it
            pass


def joint_runs(pages: np.ndarray, slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(first page, its slot, count) of each run of pages consecutive both as pages and in
    their slots."""
    if len(pages) == 0:
        return []
    breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(slots) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(pages)])))
    return list(zip(pages[starts].tolist(), slots[starts].tolist(), counts.tolist(),
                    strict=True))


_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _punch(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length):
        err = ctypes.get_errno()
        raise VmmError(f"punching a hole: {os.strerror(err)}")


def data_bytes(path: Path) -> int:
    """How much of a sparse file holds data."""
    with open(path, "rb") as f:
        return sum(end - start for start, end in data_extents(f.fileno(),
                                                               os.fstat(f.fileno()).st_size))
