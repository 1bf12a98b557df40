"""Lazy restore: an image this host lacks is mounted from the store (`storage/lazyfs.py`, one
process per image) instead of being fetched whole before its first restore.

`LazyImages.start` writes the image's manifest into its hot cache entry, starts the process,
and waits for its mount (``<entry>/lazy/``); VMs restored meanwhile map the mount's files
(`HotCache` hands them out). The process fills the entry's own files behind; once they are
complete (``lazy.complete``) the entry is ready like any hydrated one and later restores map
it directly, while the mount lives on until the last VM that maps it is gone (`LazyMount.
unmount`). A mount whose process failed (``lazy.failed``: a chunk could not be had) is never
made ready; its reason is what a VM that dies on it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sandlot.errors import StorageError
from sandlot.storage.lazyfs import COMPLETE, FAILED, MANIFEST, READY
from sandlot.storage.manifest import Manifest

MOUNT = "lazy"
CONFIG = "lazy.json"
LOG = "lazy.log"
START_TIMEOUT = 20.0


def available() -> bool:
    """Whether this host can mount lazy images (FUSE, its mount helper, the bindings)."""
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return False
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@dataclass
class LazyMount:
    """A lazy image's mount in the hot cache entry `dir`, serving `names` (name -> file)."""

    dir: Path
    names: dict[str, str]
    prefetch: int = 0  # background fetches (0: it fetches only what is read)

    @classmethod
    def existing(cls, dir: Path) -> LazyMount:
        """The mount a server before this one started in `dir`."""
        try:
            config = json.loads((dir / CONFIG).read_text())
            return cls(dir, dict(config["files"]), int(config.get("prefetch", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            return cls(dir, {})

    @property
    def path(self) -> Path:
        return self.dir / MOUNT

    def files(self, names: dict[str, str]) -> dict[str, Path]:
        return {name: self.path / filename for name, filename in names.items()}

    def complete(self) -> bool:
        return (self.dir / COMPLETE).exists()

    def failed(self) -> str | None:
        try:
            return (self.dir / FAILED).read_text().strip() or "the image could not be fetched"
        except OSError:
            return None

    def mounted(self) -> bool:
        try:
            return os.path.ismount(self.path) and self.path.stat() is not None
        except OSError:  # its process is gone: the mount answers nothing
            return False

    def unmount(self) -> None:
        """Let the mount go (lazily: a VM still dying on it keeps it until it is gone); its
        process ends with it. (Also a mount whose process died: not a mount point to
        `ismount` any more, it is one until unmounted.)"""
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def log_tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.dir / LOG).read_text().splitlines()[-lines:])
        return ""


class LazyImages:
    """Starts lazy mounts for one host: `store_url` (credentials from the environment),
    `gid` the VMs' group (None: unconfined), `prefetch` background fetches per image."""

    def __init__(self, store_url: str, gid: int | None, prefetch: int) -> None:
        self.store_url = store_url
        self.gid = gid
        self.prefetch = prefetch
        self._spare: subprocess.Popen | None = _spawn()  # the first lazy restore's

    def _process(self) -> subprocess.Popen:
        """A mount process, started ahead where one is waiting (its imports are done), and
        the next one started to wait."""
        spare, self._spare = self._spare, None
        if spare is None or spare.poll() is not None:
            spare = _spawn()
        self._spare = _spawn()
        return spare

    def close(self) -> None:
        """The waiting process ends (it reads EOF)."""
        if self._spare is not None and self._spare.stdin is not None:
            self._spare.stdin.close()
            self._spare.wait()
        self._spare = None

    async def start(self, dir: Path, manifest: Manifest, names: dict[str, str]) -> LazyMount:
        """Mount `manifest`'s files (`names`: file name in the manifest -> served name) from
        the store; the entry `dir` exists and is empty."""
        mount = LazyMount(dir, names, self.prefetch)
        mount.path.mkdir(parents=True, exist_ok=True)
        (dir / MANIFEST).write_bytes(manifest.dumps())
        (dir / CONFIG).write_text(json.dumps({
            "store": self.store_url, "key": manifest.key, "dir": str(dir),
            "mount": str(mount.path), "files": names, "prefetch": self.prefetch,
            "gid": self.gid}))
        proc = self._process()
        assert proc.stdin is not None
        proc.stdin.write(f"{dir / CONFIG}\n".encode())
        proc.stdin.close()
        deadline = time.monotonic() + START_TIMEOUT
        while not (dir / READY).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                mount.unmount()
                raise StorageError(f"image {manifest.key}: its lazy mount did not start "
                                   f"({mount.log_tail() or 'no output'})")
            await asyncio.sleep(0.01)
        _reap_later(proc)
        return mount


def _spawn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sandlot.storage.lazyfs", "--wait",
                             str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env=os.environ.copy())


def _reap_later(proc: subprocess.Popen) -> None:
    """The process outlives this call: collect its exit status whenever it comes, so it
    never lingers as a zombie of the server."""
    import threading

    threading.Thread(target=proc.wait, name="lazyfs-reaper", daemon=True).start()
