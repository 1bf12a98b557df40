"""How a capture copies the pages a VM changed: all of them in the pause (`StoppedCopy`), or
most while the VM runs and in the pause only those written meanwhile (`TrackedCopy`, with the
kernel's write tracking: vmm/write_tracking.py).

Both are used the same way by vmm/snapshot.py: `prepare` before the pause, `in_pause` with
the VM stopped, `finish` after it runs again (each blocking: run them in threads), then
`buffer` and the `finish`ed deltas hold the pages as they were at the pause.
"""

from __future__ import annotations

import logging

import numpy as np

from sandlot.errors import VmmError
from sandlot.vmm import memory
from sandlot.vmm.memory import PAGE, Delta, PageBuffer, Region
from sandlot.vmm.write_tracking import WriteTracker

log = logging.getLogger(__name__)

MARGIN_PAGES = 8192  # 32 MiB: pages a running guest may change between the count and the pause
WRITTEN_MARGIN_PAGES = 2048  # 8 MiB: pages written during a precopy, before the buffer grows


class StoppedCopy:
    """Every changed page (vmm/memory.changed_pages) copied with the VM stopped; before the
    pause only the buffer is mapped and faulted in."""

    quick = False  # what `in_pause` copies is small
    tracking_failed = False  # write tracking failed in the pause: do without it from now on

    def __init__(self, pid: int, regions: list[Region]) -> None:
        self.pid = pid
        self.regions = regions
        self.buffer: PageBuffer | None = None
        self.deltas: list[Delta] = []
        self.pages_in_pause = 0  # pages copied with the VM stopped

    def prepare(self) -> None:
        expected = sum(len(memory.changed_pages(self.pid, r)) for r in self.regions)
        self.buffer = PageBuffer(expected + MARGIN_PAGES)

    def in_pause(self) -> None:
        changed = [(r, memory.changed_pages(self.pid, r)) for r in self.regions]
        self.deltas = memory.read_pages(self.pid, changed, self.buffer)
        self.pages_in_pause = sum(len(p) for _, p in changed)

    def finish(self) -> list[Delta]:
        return self.deltas

    def _release_deltas(self) -> None:
        for delta in self.deltas:
            try:
                delta.data.release()
            except BufferError:  # a failed write's traceback holds it
                pass
        self.deltas = []

    def close(self) -> None:
        """Free the buffer (unless the caller took it: `buffer` None)."""
        self._release_deltas()
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None


class TrackedCopy(StoppedCopy):
    """Precopy with exact write tracking:

    1. (running) the tracker is armed: every page is write-protected;
    2. (running) the changed pages are copied out;
    3. (stopped) the pages written since 1 are copied again (a page the guest wrote after
       its copy, or that became changed after the count), read and re-armed in one walk;
    4. (running) pages new in 3 are merged in, in order.

    A page not written since 1 reads the same at the pause as at its copy in 2; every other
    page is copied in 3. So the pause costs what the guest wrote during the copy, not what it
    changed since its restore.
    """

    quick = True

    def __init__(self, pid: int, regions: list[Region], tracker: WriteTracker) -> None:
        super().__init__(pid, regions)
        self.tracker = tracker
        self._extra: PageBuffer | None = None
        self._extra_pages: list[np.ndarray] = []

    def prepare(self) -> None:
        for region in self.regions:
            self.tracker.collect(region)
        changed = [(r, memory.changed_pages(self.pid, r)) for r in self.regions]
        self.buffer = PageBuffer(sum(len(p) for _, p in changed))
        self._extra = PageBuffer(WRITTEN_MARGIN_PAGES)
        self.deltas = memory.read_pages(self.pid, changed, self.buffer)

    def in_pause(self) -> None:
        try:
            self._copy_written()
        except VmmError as e:  # e.g. the userfaultfd is gone: copy it all, as without
            log.warning("QEMU %d: copying every changed page in the pause: %s", self.pid, e)
            self.tracking_failed = True
            self._release_deltas()
            self._extra_pages = []
            self.pages_in_pause = 0
            super().in_pause()

    def _copy_written(self) -> None:
        inside, outside = [], []
        offset = 0
        extra_count = 0
        for delta in self.deltas:
            written = self.tracker.collect(delta.region)
            self.pages_in_pause += len(written)
            pages = delta.pages
            at = np.searchsorted(pages, written)
            known = at < len(pages)
            known[known] = pages[at[known]] == written[known]
            inside.append((delta.region, written[known], offset + at[known]))
            new = written[~known]
            outside.append((delta.region, new,
                            np.arange(extra_count, extra_count + len(new), dtype=np.int64)))
            self._extra_pages.append(new)
            extra_count += len(new)
            offset += len(pages)
        self._extra._grow(extra_count)  # rarely needed: a margin is mapped
        memory.copy_pages(self.pid, inside, self.buffer.address)
        memory.copy_pages(self.pid, outside, self._extra.address)

    def finish(self) -> list[Delta]:
        if not any(len(p) for p in self._extra_pages):
            return self.deltas
        # Pages that became changed during the copy: one buffer with every region's pages in
        # order again.
        merged_pages = [np.union1d(d.pages, new) for d, new in zip(
            self.deltas, self._extra_pages, strict=True)]
        merged = PageBuffer(sum(len(p) for p in merged_pages))
        out = merged.view(merged.pages)
        target = np.frombuffer(out, dtype=np.uint8).reshape(-1, PAGE)
        old = np.frombuffer(self.buffer.view(self.buffer.pages), dtype=np.uint8).reshape(-1, PAGE)
        extra = np.frombuffer(self._extra.view(self._extra.pages),
                              dtype=np.uint8).reshape(-1, PAGE)
        deltas = []
        offset = extra_offset = old_offset = 0
        for delta, new, pages in zip(self.deltas, self._extra_pages, merged_pages, strict=True):
            at_old = np.searchsorted(pages, delta.pages)
            at_new = np.searchsorted(pages, new)
            target[offset + at_old] = old[old_offset: old_offset + len(delta.pages)]
            target[offset + at_new] = extra[extra_offset: extra_offset + len(new)]
            deltas.append(Delta(delta.region, pages,
                                out[offset * PAGE: (offset + len(pages)) * PAGE]))
            offset += len(pages)
            old_offset += len(delta.pages)
            extra_offset += len(new)
        del target, old, extra
        out.release()
        self._close_buffers()
        self.buffer, self.deltas = merged, deltas
        return deltas

    def _close_buffers(self) -> None:
        self._release_deltas()
        for buffer in (self.buffer, self._extra):
            if buffer is not None:
                buffer.close()
        self.buffer = self._extra = None

    def close(self) -> None:
        super().close()
        if self._extra is not None:
            self._extra.close()
            self._extra = None


def ram_copy(pid: int, regions: list[Region], tracker: WriteTracker | None) -> StoppedCopy:
    """The copy a capture of QEMU `pid` uses: tracked where its writes are tracked."""
    if tracker is None:
        return StoppedCopy(pid, regions)
    return TrackedCopy(pid, regions, tracker)

