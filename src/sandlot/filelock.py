"""An exclusive lock on a file, shared by every process on the host (flock)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(path: Path | str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created, with its directory, if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
