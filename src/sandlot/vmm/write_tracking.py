"""Which guest pages were written since the last look, from the kernel's page tables.

A capture must hold every page the VM changed as it was at the pause. Copying them all with
the VM stopped makes the pause grow with what changed since the restore (100 MiB: ~100 ms
here). With write tracking the copy runs while the VM runs, and the pause copies only the
pages written during that copy.

How (Linux 6.7+): a small library preloaded into QEMU (qemu_preload.c) opens a userfaultfd
with *asynchronous* write-protection in QEMU's address space. Sandlot takes that descriptor
(``pidfd_getfd``) and registers the guest RAM mappings on it. ``PAGEMAP_SCAN`` on
/proc/PID/pagemap then lists the anonymous pages written since the last scan and
write-protects them again in the same walk; the kernel resolves each first write to a
protected page by itself (a minor fault), so QEMU never notices. A page that becomes
anonymous (a copy-on-write of the image's RAM file) starts unprotected: written.

Without the kernel feature, the library or a C compiler, `open_tracker` returns None and
captures copy in the pause as before. SANDLOT_WRITE_TRACKING=off (Settings.write_tracking)
turns it off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

import numpy as np

from sandlot.errors import VmmError
from sandlot.vmm.memory import PAGE, Region

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qemu_preload.c")
# Under /usr: the jail's mount namespace shows /usr (read-only) to every confined QEMU.
LIBRARY_DIR = Path("/usr/local/lib/sandlot")
ENV = "SANDLOT_WRITE_TRACKING"  # set in QEMU's environment: the library acts (qemu_preload.c)
NO_HUGEPAGE_ENV = "SANDLOT_RAM_NO_HUGEPAGE"  # read by the preloaded library (qemu_preload.c)

_SYS_USERFAULTFD = 323  # x86_64
_SYS_PIDFD_GETFD = 438
_UFFD_API = 0xAA
_UFFD_USER_MODE_ONLY = 1
_UFFD_FEATURE_WP_ASYNC = 1 << 15
_UFFDIO_REGISTER_MODE_WP = 1 << 1


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _iowr(0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)
_PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)
_PAGE_IS_WRITTEN = 1 << 1
_PAGE_IS_FILE = 1 << 2
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_SWAPPED = 1 << 4
_PAGE_IS_PFNZERO = 1 << 5
# A collect matches written pages, present or swapped, not of the file (a read-only mapping of
# the RAM file) nor the zero page (a read of untouched anonymous memory): what a guest wrote.
# Holes are never matched, so they get no write-protect markers (pagemap shows those as swap).
_NOT = _PAGE_IS_FILE | _PAGE_IS_PFNZERO
_PM_SCAN_WP_MATCHING = 1 << 0
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_VEC_REGIONS = 16384

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

_lock = threading.Lock()
_library: Path | None | bool = False  # False: not looked for yet


def qemu_env(tracking: bool = True, ram_no_hugepage: bool = False) -> dict[str, str]:
    """What QEMU's environment needs for tracking its writes (if `tracking`:
    Settings.write_tracking, and the kernel can) and, if `ram_no_hugepage` (its guest RAM is
    a file read on demand), for not advising huge pages on that RAM; empty: neither (or the
    preload library cannot be had)."""
    env = {}
    if tracking and kernel_supports():
        env[ENV] = "1"
    if ram_no_hugepage:
        env[NO_HUGEPAGE_ENV] = "1"
    library = _library_path() if env else None
    if library is None:
        return {}
    return {"LD_PRELOAD": str(library), **env}


def _library_path() -> Path | None:
    """The preload library, compiled once per source (None where it cannot be: no
    compiler)."""
    global _library
    with _lock:
        if _library is False:
            _library = _build()
        return _library


def _build() -> Path | None:
    source = SOURCE.read_bytes()
    out = LIBRARY_DIR / f"qemu-preload-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if _trusted(out):
        return out
    try:
        LIBRARY_DIR.mkdir(parents=True, exist_ok=True)
        os.chmod(LIBRARY_DIR, 0o755)  # every VM's uid loads it; whatever the server's umask
        if not _trusted(LIBRARY_DIR):
            raise OSError(f"{LIBRARY_DIR} is not the server's own, or others may write to it")
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)],
                       check=True, capture_output=True, timeout=60)
        os.chmod(tmp, 0o755)
        tmp.replace(out)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("QEMU's preload library cannot be built (no write tracking): %s %s", e,
                    detail.decode(errors="replace").strip())
        return None
    return out


def _trusted(path: Path) -> bool:
    """Whether `path` exists, is the server user's, and no one else may write to it: the
    library is loaded into QEMU and into the privileged commands that start it."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


_supported: bool | None = None


def kernel_supports() -> bool:
    """Asynchronous write-protection and PAGEMAP_SCAN (Linux 6.7+), tried on this process.
    x86-64 only: the system call numbers above are that architecture's."""
    global _supported
    if _supported is None:
        _supported = platform.machine() == "x86_64" and _try_kernel()
    return _supported


def _try_kernel() -> bool:
    fd = _libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | _UFFD_USER_MODE_ONLY)
    if fd < 0:
        return False
    try:
        api = (ctypes.c_uint64 * 3)(_UFFD_API, _UFFD_FEATURE_WP_ASYNC, 0)
        if _libc.ioctl(fd, _UFFDIO_API, api) != 0:
            return False
    finally:
        os.close(fd)
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        arg = (ctypes.c_uint64 * 12)(96, 0, 0, PAGE, 0, 0, 0, 0, 0, 0, 0, 0)
        return _libc.ioctl(pagemap, _PAGEMAP_SCAN, arg) >= 0
    finally:
        os.close(pagemap)


class WriteTracker:
    """The written pages of one QEMU's guest RAM (its regions), through the userfaultfd the
    preloaded library opened in it. `collect` is the only read; it re-arms what it returns."""

    def __init__(self, pid: int, uffd: int) -> None:
        self.pid = pid
        self._uffd = uffd
        self._pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
        self._registered: set[int] = set()
        self._vec = (ctypes.c_uint64 * (3 * _VEC_REGIONS))()
        # One call at a time: a capture cancelled mid-scan leaves its thread running, and a
        # close must not free the descriptors under it (or the next scan share its vector).
        self._busy = threading.Lock()

    def register(self, regions: list[Region]) -> None:
        with self._busy:
            self._register(regions)

    def _register(self, regions: list[Region]) -> None:
        if self._uffd < 0:
            raise VmmError(f"QEMU {self.pid}: its write tracking is closed")
        for region in regions:
            if region.start in self._registered:
                continue
            reg = (ctypes.c_uint64 * 4)(region.start, region.size, _UFFDIO_REGISTER_MODE_WP, 0)
            if _libc.ioctl(self._uffd, _UFFDIO_REGISTER, reg) != 0:
                err = ctypes.get_errno()
                raise VmmError(f"QEMU {self.pid}: cannot track writes to its {region.name}: "
                               f"{os.strerror(err)}")
            self._registered.add(region.start)

    def collect(self, region: Region) -> np.ndarray:
        """Indices of the region's anonymous pages written since the last `collect`, sorted;
        they are write-protected again. The first `collect` of a region arms it: it lists
        every page not yet protected, written or not."""
        with self._busy:
            return self._collect(region)

    def _collect(self, region: Region) -> np.ndarray:
        self._register([region])
        end = region.start + region.size
        start = region.start
        found: list[np.ndarray] = []
        while start < end:
            arg = (ctypes.c_uint64 * 12)(
                96, _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC, start, end, 0,
                ctypes.addressof(self._vec), _VEC_REGIONS, 0,
                _NOT, _PAGE_IS_WRITTEN | _NOT, _PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
                _PAGE_IS_WRITTEN)
            n = _libc.ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            if n < 0:
                err = ctypes.get_errno()
                raise VmmError(f"QEMU {self.pid}: scanning written pages: {os.strerror(err)}")
            if n:
                ranges = np.ctypeslib.as_array(self._vec)[: 3 * n].reshape(n, 3)
                firsts = (ranges[:, 0] - region.start) // PAGE
                counts = (ranges[:, 1] - ranges[:, 0]) // PAGE
                found.append(_expand(firsts.astype(np.int64), counts.astype(np.int64)))
            walked = int(arg[4])
            if walked <= start:
                raise VmmError(f"QEMU {self.pid}: page scan made no progress")
            start = walked
        if not found:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(found)

    def close(self) -> None:
        with self._busy:
            for fd in (self._uffd, self._pagemap):
                if fd >= 0:
                    os.close(fd)
            self._uffd = self._pagemap = -1


def _expand(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Runs (first, count) as the page indices they cover."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(firsts, counts) + (np.arange(total, dtype=np.int64) - offsets)


def open_tracker(pid: int) -> WriteTracker | None:
    """A tracker of QEMU `pid`'s writes, if it runs with the preloaded library's userfaultfd
    (else None)."""
    uffd_number = _find_uffd(pid)
    if uffd_number is None:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        uffd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, uffd_number, 0)
    finally:
        os.close(pidfd)
    if uffd < 0:
        log.warning("QEMU %d: cannot take its userfaultfd: %s", pid,
                    os.strerror(ctypes.get_errno()))
        return None
    try:
        return WriteTracker(pid, uffd)
    except OSError:
        os.close(uffd)
        return None


def _find_uffd(pid: int) -> int | None:
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            if os.readlink(entry) == "anon_inode:[userfaultfd]":
                return int(entry.name)
        except (OSError, ValueError):
            continue
    return None
