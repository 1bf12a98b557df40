"""A snapshot's RAM files while they are still being written, as a restore source.

A snapshot is ready once stored; its RAM files (the source's RAM file with the pages the
capture copied written over it) are written afterwards, taking 0.2-1 s under load. A restore
in that window does not wait for them: its QEMU maps the file the capture was taken over (a
hard link of it in the snapshot's cache entry, ``ram.base``, so it stays whatever becomes of
the source's entry) and gets the captured pages written into its memory before its devices
load. Those pages are the restored VM's own (copy-on-write copies), where a VM restored from
the written file shares them: the window trades memory for time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.vmm import memory

# the links' names in the entry (RAM files by their names: confined VMs may open them)
LINKS = {"ram": "ram.base", "dimm": "ram.dimm.base"}
# Private copies of the captured pages that restores from one capture may make in all (a
# fork of 32 children of a snapshot with 256 MiB changed would make 8 GiB): past it, a
# restore waits for the file, whose pages its VMs share.
PRIVATE_BUDGET = 512 << 20


@dataclass
class UnwrittenRam:
    """The captured pages (`deltas`, per region) and the links of the files they were taken
    over (`files`, per region, in the snapshot's cache entry)."""

    files: dict[str, Path]
    deltas: dict[str, memory.Delta]
    used: bool = False  # a VM maps the links: they stay with the entry
    _users: int = 0
    _taken: int = 0  # restores that took it in all
    _retire: Callable[[], None] | None = field(default=None, repr=False)

    @classmethod
    def link(cls, entry: Path, deltas: dict[str, memory.Delta]) -> UnwrittenRam | None:
        """Link each delta's base file into `entry`; None where one has no file (a booted
        VM's RAM) or cannot be linked (another filesystem: a lazily served image)."""
        files: dict[str, Path] = {}
        try:
            for name, delta in deltas.items():
                if delta.region.base is None:
                    raise OSError(f"{name} has no base file")
                files[name] = entry / LINKS[name]
                files[name].unlink(missing_ok=True)
                os.link(delta.region.base, files[name])
        except OSError:
            for path in files.values():
                path.unlink(missing_ok=True)
            return None
        return cls(files, deltas)

    @property
    def nbytes(self) -> int:
        return sum(delta.nbytes for delta in self.deltas.values())

    def take(self) -> bool:
        """A restore starts from it (False: it would pass `PRIVATE_BUDGET`; wait for the
        file): the links stay with the entry, the pages until `leave`."""
        if self._taken and (self._taken + 1) * self.nbytes > PRIVATE_BUDGET:
            return False
        self.used = True
        self._users += 1
        self._taken += 1
        return True

    def leave(self) -> None:
        self._users -= 1
        if not self._users and self._retire is not None:
            retire, self._retire = self._retire, None
            retire()

    async def write_into(self, pid: int) -> None:
        """Make QEMU `pid`, started over `files` and not yet running, hold the snapshot's
        memory: the captured pages written into its mappings of them (between `take` and
        `leave`)."""
        regions = memory.regions(
            pid, *[(self.files[n], self.deltas[n].region.size) if n in self.files else None
                   for n in ("ram", "dimm")])
        for region in regions:
            await asyncio.to_thread(memory.write_delta, pid, region, self.deltas[region.name])

    def retire(self, close: Callable[[], None]) -> None:
        """The RAM files are written (or failed): `close` (frees the pages) runs once no
        restore has them; the links go unless a VM maps them."""
        if not self.used:
            for path in self.files.values():
                with contextlib.suppress(OSError):
                    path.unlink()
        if self._users:
            self._retire = close
        else:
            close()
