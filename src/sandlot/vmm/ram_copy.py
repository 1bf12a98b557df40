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
WRITTEN_MARGIN_PAGES = 2048  # 8 MiB faulted in ahead for pages new in the pause (more: on write)


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

    def written(self) -> dict[str, np.ndarray] | None:
        """Per region, the pages written since the machine's last capture's pause, as the
        tracker saw them (None: not tracked)."""
        return None

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


class _BufferFull(Exception):
    """The pages new in the pause do not fit in the precopy's buffer."""


class TrackedCopy(StoppedCopy):
    """Precopy with exact write tracking:

    1. (running) the tracker is armed: every page is write-protected;
    2. (running) the changed pages are copied out;
    3. (stopped) the pages written since 1 are copied again: into their slots, or, for a page
       that became changed after the count, into a slot after all of them (the buffer
       reserves room for every page of RAM, and faults in a margin of it ahead); read and
       re-armed in one walk.

    A page not written since 1 reads the same at the pause as at its copy in 2; every other
    page is copied in 3. So the pause costs what the guest wrote during the copy, not what it
    changed since its restore. The deltas list each region's pages in order, with their
    slots (`Delta.slots`): nothing is moved after the pause.
    """

    quick = True

    def __init__(self, pid: int, regions: list[Region], tracker: WriteTracker) -> None:
        super().__init__(pid, regions)
        self.tracker = tracker
        self._used = 0  # slots taken in the buffer
        self._new: list[np.ndarray] = []  # per region: pages new in the pause, their slots
        self._collected: dict[str, list[np.ndarray]] = {}  # what each collect returned

    def prepare(self) -> None:
        for region in self.regions:
            self._collected[region.name] = [self.tracker.collect(region)]
        changed = [(r, memory.changed_pages(self.pid, r)) for r in self.regions]
        counted = sum(len(p) for _, p in changed)
        room = counted + sum(r.size // PAGE for r in self.regions)
        try:
            self.buffer = PageBuffer(room, populate=counted + WRITTEN_MARGIN_PAGES)
        except OSError:  # no room to reserve (strict overcommit): the margin alone
            self.buffer = PageBuffer(counted + WRITTEN_MARGIN_PAGES)
        self.deltas = memory.read_pages(self.pid, changed, self.buffer)
        self._used = counted

    def in_pause(self) -> None:
        try:
            self._copy_written()
        except _BufferFull:  # more pages new than the buffer holds: copy it all, tracked still
            log.info("QEMU %d: copying every changed page in the pause (%d new)", self.pid,
                     self.pages_in_pause)
            self._release_deltas()
            self._new = []
            self.pages_in_pause = 0
            StoppedCopy.in_pause(self)
        except VmmError as e:  # e.g. the userfaultfd is gone: copy it all, as without
            log.warning("QEMU %d: copying every changed page in the pause: %s", self.pid, e)
            self.tracking_failed = True
            self._release_deltas()
            self._new = []
            self.pages_in_pause = 0
            super().in_pause()

    def _copy_written(self) -> None:
        parts = []
        offset = 0
        for delta in self.deltas:
            written = self.tracker.collect(delta.region)
            self._collected[delta.region.name].append(written)
            self.pages_in_pause += len(written)
            pages = delta.pages
            at = np.searchsorted(pages, written)
            known = at < len(pages)
            known[known] = pages[at[known]] == written[known]
            new = written[~known]
            slots = np.empty(len(written), dtype=np.int64)
            slots[known] = offset + at[known]
            slots[~known] = np.arange(self._used, self._used + len(new), dtype=np.int64)
            self._used += len(new)
            parts.append((delta.region, written, slots))
            self._new.append(np.stack([new, slots[~known]]))
            offset += len(pages)
        if self._used > self.buffer.pages:  # every region collected: `written` holds
            raise _BufferFull
        memory.copy_pages(self.pid, parts, self.buffer.address)

    def written(self) -> dict[str, np.ndarray] | None:
        """What the two collects of this capture returned: the pages written since the last
        collect before it (the last capture's pause, or a first arming: then every page not
        yet protected, a superset), up to this pause."""
        if self.tracking_failed:
            return None
        return {name: np.unique(np.concatenate(parts)) for name, parts in self._collected.items()}

    def finish(self) -> list[Delta]:
        if not any(new.shape[1] for new in self._new):
            return self.deltas
        # Pages that became changed during the copy: each region's pages in order, with the
        # slots they are in.
        view = self.buffer.view(self._used)
        deltas = []
        offset = 0
        for delta, new in zip(self.deltas, self._new, strict=True):
            pages = np.concatenate([delta.pages, new[0]])
            slots = np.concatenate([np.arange(offset, offset + len(delta.pages)), new[1]])
            order = np.argsort(pages, kind="stable")
            deltas.append(Delta(delta.region, pages[order], view, slots[order]))
            offset += len(delta.pages)
        self._release_deltas()
        self.deltas = deltas
        return deltas


def ram_copy(pid: int, regions: list[Region], tracker: WriteTracker | None) -> StoppedCopy:
    """The copy a capture of QEMU `pid` uses: tracked where its writes are tracked."""
    if tracker is None:
        return StoppedCopy(pid, regions)
    return TrackedCopy(pid, regions, tracker)

