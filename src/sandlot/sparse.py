"""Sparse files: where their data is (SEEK_DATA/SEEK_HOLE), for the RAM files vmm writes and
the files storage chunks."""

from __future__ import annotations

import os


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of each data extent of a sparse file of `size` bytes."""
    out = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:
            break  # ENXIO: no data after offset
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        out.append((start, end))
        offset = end
    return out
