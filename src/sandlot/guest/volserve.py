"""The host's end of volumes: serves the file operations a guest's volume mount forwards
(`vreq` frames, docs/guest-protocol.md "Volumes") from the volume's directory.

A guest names its volume by a token the host gave it at mount time (`<volume id>.<HMAC>`):
the token lives in guest memory, so snapshots, forks and restores keep their mounts without
any state here, and a guest cannot forge one for a volume it was not given. Paths are
resolved one component at a time under the volume's directory with O_NOFOLLOW: `..`, empty
components and symlinks (a guest cannot make one, but the directory may hold one) never lead
out of it. The E2B content API (core/volume_content.py) reads and writes volumes through the
same walk, naming a volume by its id (`root_fd`, `entry`, `list_dir`, ..., `upload`).

A volume holds at most `max_bytes` (SANDLOT_MAX_VOLUME_MB: the blocks its files take, counted
once per server from the directory and kept up to date by each write, truncate and unlink;
counted again after a content API change), and no request makes the host's file system go
below `reserve_bytes` free (SANDLOT_RESERVE_DISK_MB) or out of inodes: past either, the guest
gets EDQUOT or ENOSPC, the content API 507.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

MAX_IO = 1 << 20  # the agent's FUSE max_write (an older agent's: 128 KiB)
MAX_LIST = 4096  # entries per `list` answer (the kernel asks again from where it stopped)
MAX_PATH = 4096
_VOLUME_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MIN_FREE_INODES = 4096  # what a request leaves the host's file system
_GROWING = frozenset({"write", "create", "mkdir", "setattr"})
# what changes the blocks a volume takes: measured at the path (or a rename's target) before,
# and after for those that leave something there
_CHARGED = frozenset({"write", "setattr", "create", "mkdir", "unlink", "rmdir", "rename"})
_CHARGED_AFTER = frozenset({"write", "setattr", "create", "mkdir"})


class VolumeError(OSError):
    """A request the server refuses: carries the errno the guest gets."""


def _fail(code: int) -> VolumeError:
    return VolumeError(code, os.strerror(code))


def host_key(path: Path) -> bytes:
    """The key of a host's volume tokens: made once, kept in `path` (the server's only)."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.replace(tmp, path)
        return bytes.fromhex(path.read_text().strip())


class VolumeServer:
    """Volumes' directories under `root` (one per volume id), tokens signed with `key`."""

    def __init__(self, root: Path, key: bytes, max_bytes: int = 0,
                 reserve_bytes: int = 0) -> None:
        self.root = root
        self._key = key
        self.max_bytes = max_bytes  # per volume (0: no bound of its own)
        self.reserve_bytes = reserve_bytes  # the host's file system keeps this much free
        self._used: dict[str, int] = {}  # volume id -> bytes its files take (counted once)
        self._used_lock = threading.Lock()

    # ---- volumes --------------------------------------------------------------------------

    def create(self, volume_id: str) -> None:
        self.token(volume_id)  # checks the id
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / volume_id).mkdir(mode=0o755)

    def delete(self, volume_id: str) -> None:
        self.token(volume_id)
        shutil.rmtree(self.root / volume_id, ignore_errors=True)
        with self._used_lock:
            self._used.pop(volume_id, None)

    # ---- room -----------------------------------------------------------------------------

    def used(self, volume_id: str, root_fd: int) -> int:
        """The bytes volume `volume_id`'s files take on the host (its blocks), counted from
        its directory the first time, then kept by `_charge`."""
        with self._used_lock:
            if volume_id in self._used:
                return self._used[volume_id]
        total = _blocks_under(root_fd)
        with self._used_lock:
            return self._used.setdefault(volume_id, total)

    def forget_usage(self, volume_id: str) -> None:
        """Count the volume's blocks again at its next growing request (after a change made
        outside the requests that keep the count: the content API's removes and mkdirs)."""
        with self._used_lock:
            self._used.pop(volume_id, None)

    def _charge(self, volume_id: str, delta: int) -> None:
        with self._used_lock:
            if volume_id in self._used:
                self._used[volume_id] = max(0, self._used[volume_id] + delta)

    def _check_room(self, volume_id: str, root_fd: int, fop: str, growth: int) -> None:
        """EDQUOT past the volume's bound, ENOSPC past the host's reserve or inodes."""
        fs = os.statvfs(root_fd)
        if fs.f_bavail * fs.f_frsize - growth < self.reserve_bytes or (
                fop in ("create", "mkdir") and fs.f_files and fs.f_favail < MIN_FREE_INODES):
            raise _fail(errno.ENOSPC)
        if self.max_bytes and growth and self.used(volume_id, root_fd) + growth > self.max_bytes:
            raise _fail(errno.EDQUOT)

    # ---- tokens ---------------------------------------------------------------------------

    def token(self, volume_id: str) -> str:
        if not _VOLUME_ID.match(volume_id):
            raise ValueError(f"bad volume id {volume_id!r}")
        return f"{volume_id}.{self._sign(volume_id)}"

    def _sign(self, volume_id: str) -> str:
        return hmac.new(self._key, b"volume:" + volume_id.encode(), hashlib.sha256).hexdigest()

    def volume_dir(self, token: object) -> Path:
        if not isinstance(token, str) or "." not in token:
            raise _fail(errno.EACCES)
        volume_id, _, sig = token.partition(".")
        if not _VOLUME_ID.match(volume_id) or not hmac.compare_digest(
                sig.encode(), self._sign(volume_id).encode()):
            raise _fail(errno.EACCES)
        return self.root / volume_id

    # ---- requests -------------------------------------------------------------------------

    async def handle(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        """One request: the answer's fields and payload (`errno` on failure)."""
        try:
            return await asyncio.to_thread(self._handle, header, payload)
        except OSError as e:
            return {"errno": e.errno if isinstance(e.errno, int) and e.errno > 0
                    else errno.EIO}, b""
        except (ValueError, TypeError, OverflowError):
            return {"errno": errno.EINVAL}, b""

    def _handle(self, h: dict, payload: bytes) -> tuple[dict, bytes]:
        fop = h.get("fop")
        method = getattr(self, f"_op_{fop}", None) if isinstance(fop, str) else None
        if method is None:
            raise _fail(errno.ENOSYS)
        root = self.volume_dir(h.get("token"))
        path = h.get("path")
        if not isinstance(path, str) or len(path) > MAX_PATH:
            raise _fail(errno.EINVAL)
        try:
            root_fd = os.open(root, _DIR_FLAGS)
        except FileNotFoundError:
            raise _fail(errno.ESTALE) from None  # the volume was deleted
        try:
            if fop in _GROWING:
                self._check_room(root.name, root_fd, fop, len(payload) if fop == "write" else 0)
            if not self.max_bytes or fop not in _CHARGED:
                return method(root_fd, path, h, payload)
            self.used(root.name, root_fd)  # counted before the change, not after
            target = h.get("to") if fop == "rename" else path
            before = self._blocks_at(root_fd, target)
            answer = method(root_fd, path, h, payload)
            after = self._blocks_at(root_fd, path) if fop in _CHARGED_AFTER else 0
            self._charge(root.name, after - before)
            return answer
        finally:
            os.close(root_fd)

    def _blocks_at(self, root_fd: int, path: object) -> int:
        """The bytes the file or directory at `path` takes (0 if there is none)."""
        if not isinstance(path, str) or not path:
            return 0
        try:
            return self._stat(root_fd, path).st_blocks * 512
        except (OSError, ValueError):
            return 0

    # ---- path resolution ------------------------------------------------------------------

    @staticmethod
    def _parts(path: str) -> list[str]:
        if path == "":
            return []
        parts = path.split("/")
        for p in parts:
            if p in ("", ".", "..") or "\0" in p or len(p.encode()) > 255:
                raise _fail(errno.EINVAL)
        return parts

    @contextlib.contextmanager
    def _parent(self, root_fd: int, path: str) -> Iterator[tuple[int, str]]:
        """The directory holding `path` (an fd, walked without following symlinks) and the
        last component; the root itself has no parent (EINVAL)."""
        parts = self._parts(path)
        if not parts:
            raise _fail(errno.EINVAL)
        fd = os.dup(root_fd)
        try:
            for p in parts[:-1]:
                try:
                    nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise _fail(errno.ENOTDIR) from None
                    raise
                os.close(fd)
                fd = nfd
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _open(self, root_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
        if not self._parts(path):
            return os.open(".", _DIR_FLAGS, dir_fd=root_fd)
        with self._parent(root_fd, path) as (dfd, name):
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode,
                         dir_fd=dfd)
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            os.close(fd)
            raise _fail(errno.EPERM)  # a device or fifo someone put there: not served
        return fd

    def _stat(self, root_fd: int, path: str) -> os.stat_result:
        if not self._parts(path):
            return os.stat(root_fd)
        with self._parent(root_fd, path) as (dfd, name):
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    @staticmethod
    def _attr(st: os.stat_result) -> dict:
        return {"mode": st.st_mode, "size": st.st_size, "nlink": st.st_nlink,
                "mtime_ns": st.st_mtime_ns, "atime_ns": st.st_atime_ns,
                "ctime_ns": st.st_ctime_ns}

    # ---- operations -----------------------------------------------------------------------

    def _op_stat(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        return {"attr": self._attr(self._stat(root_fd, path))}, b""

    def _op_list(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        offset = h.get("offset", 0)
        if not isinstance(offset, int) or offset < 0:
            raise _fail(errno.EINVAL)
        fd = self._open(root_fd, path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:
                names = sorted(e.name for e in it)
            entries = []
            for name in names[offset:offset + MAX_LIST]:
                try:
                    mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                entries.append({"name": name, "type": stat.S_IFMT(mode) >> 12})
        finally:
            os.close(fd)
        return {"entries": entries}, b""

    def _op_read(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        offset, size = h.get("offset"), h.get("size")
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 \
                or not 0 <= size <= MAX_IO:
            raise _fail(errno.EINVAL)
        fd = self._open(root_fd, path, os.O_RDONLY)
        try:
            return {}, os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def _op_write(self, root_fd: int, path: str, h: dict, data: bytes) -> tuple[dict, bytes]:
        offset = h.get("offset")
        if not isinstance(offset, int) or offset < 0 or len(data) > MAX_IO:
            raise _fail(errno.EINVAL)
        fd = self._open(root_fd, path, os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        finally:
            os.close(fd)
        return {"size": done}, b""

    def _mode(self, h: dict) -> int:
        mode = h.get("mode", 0o644)
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise _fail(errno.EINVAL)
        return mode & 0o1777  # no setuid/setgid files on the host

    def _op_create(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if h.get("excl") else 0)
        fd = self._open(root_fd, path, flags, self._mode(h))
        try:
            return {"attr": self._attr(os.fstat(fd))}, b""
        finally:
            os.close(fd)

    def _op_mkdir(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        with self._parent(root_fd, path) as (dfd, name):
            os.mkdir(name, self._mode(h), dir_fd=dfd)
            return {"attr": self._attr(os.stat(name, dir_fd=dfd, follow_symlinks=False))}, b""

    def _op_unlink(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        with self._parent(root_fd, path) as (dfd, name):
            os.unlink(name, dir_fd=dfd)
        return {}, b""

    def _op_rmdir(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        with self._parent(root_fd, path) as (dfd, name):
            os.rmdir(name, dir_fd=dfd)
        return {}, b""

    def _op_rename(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        to = h.get("to")
        if not isinstance(to, str) or len(to) > MAX_PATH:
            raise _fail(errno.EINVAL)
        with self._parent(root_fd, path) as (sfd, sname), \
                self._parent(root_fd, to) as (dfd, dname):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        return {}, b""

    def _op_setattr(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        size = h.get("size")
        st = self._stat(root_fd, path)
        flags = os.O_WRONLY if size is not None else os.O_RDONLY
        if stat.S_ISDIR(st.st_mode):
            if size is not None:
                raise _fail(errno.EISDIR)
            flags = os.O_RDONLY | os.O_DIRECTORY
        fd = self._open(root_fd, path, flags)
        try:
            if "mode" in h:
                os.fchmod(fd, self._mode(h))
            if size is not None:
                if not isinstance(size, int) or size < 0:
                    raise _fail(errno.EINVAL)
                os.ftruncate(fd, size)
            if "atime_ns" in h or "mtime_ns" in h:
                now = os.fstat(fd)
                times = [now.st_atime_ns, now.st_mtime_ns]
                for i, key in enumerate(("atime_ns", "mtime_ns")):
                    v = h.get(key)
                    if v == "now":
                        times[i] = time.time_ns()
                    elif isinstance(v, int) and v >= 0:
                        times[i] = v
                    elif v is not None:
                        raise _fail(errno.EINVAL)
                os.utime(fd, ns=(times[0], times[1]))
            return {"attr": self._attr(os.fstat(fd))}, b""
        finally:
            os.close(fd)

    def _op_statfs(self, root_fd: int, path: str, h: dict, _: bytes) -> tuple[dict, bytes]:
        s = os.statvfs(root_fd)
        scale = s.f_frsize // 4096 if s.f_frsize >= 4096 else 1
        return {"blocks": s.f_blocks * scale, "bfree": s.f_bfree * scale,
                "bavail": s.f_bavail * scale, "files": s.f_files, "ffree": s.f_ffree}, b""

    # ---- the E2B content API (core/volume_content.py): the same confinement, by volume id ---

    @staticmethod
    def content_path(path: str) -> str:
        """An E2B volume path (`/a/b`, from the volume's root; `a/b` too) as the requests
        above name it (`a/b`; the root: an empty string). Refused (EINVAL): `..`, `.`, empty
        components, NUL, over MAX_PATH."""
        if not isinstance(path, str) or len(path) > MAX_PATH:
            raise _fail(errno.EINVAL)
        rel = path.strip("/")
        VolumeServer._parts(rel)
        return rel

    @contextlib.contextmanager
    def root_fd(self, volume_id: str) -> Iterator[int]:
        """The volume's directory, opened (ESTALE: it is not on this host)."""
        self.token(volume_id)  # checks the id
        try:
            fd = os.open(self.root / volume_id, _DIR_FLAGS)
        except FileNotFoundError:
            raise _fail(errno.ESTALE) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def entry(self, root_fd: int, rel: str) -> dict:
        """E2B's VolumeEntryStat of `rel` (a symlink: its own, with its text as `target`)."""
        st = self._stat(root_fd, rel)
        kind = {stat.S_IFDIR: "directory", stat.S_IFREG: "file",
                stat.S_IFLNK: "symlink"}.get(stat.S_IFMT(st.st_mode), "unknown")
        out = {"name": rel.rsplit("/", 1)[-1], "type": kind, "path": "/" + rel,
               "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
               "gid": st.st_gid, "atime": st.st_atime_ns, "mtime": st.st_mtime_ns,
               "ctime": st.st_ctime_ns}
        if kind == "symlink":
            with self._parent(root_fd, rel) as (dfd, name):
                out["target"] = os.readlink(name, dir_fd=dfd)
        return out

    def list_dir(self, root_fd: int, rel: str, depth: int, limit: int) -> list[dict]:
        """The entries under directory `rel`, `depth` levels down (at most `limit`: E2BIG)."""
        out: list[dict] = []
        level = [rel]
        for _ in range(depth):
            below = []
            for d in level:
                fd = self._open(root_fd, d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    if not stat.S_ISDIR(os.fstat(fd).st_mode):
                        raise _fail(errno.ENOTDIR)
                    with os.scandir(fd) as it:
                        names = sorted(e.name for e in it)
                finally:
                    os.close(fd)
                for name in names:
                    child = f"{d}/{name}" if d else name
                    try:
                        e = self.entry(root_fd, child)
                    except FileNotFoundError:
                        continue
                    out.append(e)
                    if len(out) > limit:
                        raise _fail(errno.E2BIG)
                    if e["type"] == "directory":
                        below.append(child)
            level = below
        return out

    def make_dir(self, root_fd: int, rel: str, mode: int, parents: bool) -> dict:
        """A new directory (`parents`: and its missing parents; one there already is fine)."""
        if not rel:
            raise _fail(errno.EEXIST)
        parts = rel.split("/")
        if parents:
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                with self._parent(root_fd, sub) as (dfd, name):
                    try:
                        os.mkdir(name, self._mode({"mode": mode}), dir_fd=dfd)
                    except FileExistsError:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        if not stat.S_ISDIR(st.st_mode):  # a file, or a symlink: not followed
                            raise _fail(errno.EEXIST if i == len(parts)
                                        else errno.ENOTDIR) from None
        else:
            with self._parent(root_fd, rel) as (dfd, name):
                os.mkdir(name, self._mode({"mode": mode}), dir_fd=dfd)
        return self.entry(root_fd, rel)

    def remove(self, root_fd: int, rel: str) -> None:
        """Remove a file, a symlink (not what it names) or a directory with all it holds."""
        with self._parent(root_fd, rel) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dfd)  # fd-based: never follows a symlink out
            else:
                os.unlink(name, dir_fd=dfd)

    def chmod(self, root_fd: int, rel: str, mode: int) -> dict:
        fd = self._open(root_fd, rel, os.O_RDONLY)
        try:
            os.fchmod(fd, self._mode({"mode": mode}))
        finally:
            os.close(fd)
        return self.entry(root_fd, rel)

    def open_read(self, volume_id: str, rel: str) -> int:
        """A regular file of the volume, open for reading (EISDIR for a directory)."""
        with self.root_fd(volume_id) as root_fd:
            fd = self._open(root_fd, rel, os.O_RDONLY)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _fail(errno.EISDIR)
        os.set_blocking(fd, True)
        return fd

    def upload(self, volume_id: str, rel: str, mode: int) -> Upload:
        """A file to write whole, put at `rel` by `Upload.finish` (missing parents made; a
        file there is replaced only once the body is all in)."""
        with self.root_fd(volume_id) as root_fd:
            parts = self._parts(rel)
            if not parts:
                raise _fail(errno.EISDIR)
            if len(parts) > 1:
                try:
                    self.make_dir(root_fd, "/".join(parts[:-1]), 0o755, parents=True)
                except OSError as e:
                    if e.errno == errno.EEXIST:  # the parent is a file or a symlink
                        raise _fail(errno.ENOTDIR) from None
                    raise
            with self._parent(root_fd, rel) as (dfd, name):
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                        raise _fail(errno.EISDIR)
                tmp = f".{name[:200]}.upload-{secrets.token_hex(6)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, self._mode({"mode": mode}), dir_fd=dfd)
                return Upload(self, volume_id, os.dup(root_fd), os.dup(dfd), fd, tmp, name, rel)


class Upload:
    """A file being written into a volume under a temporary name (`VolumeServer.upload`)."""

    def __init__(self, server: VolumeServer, volume_id: str, root_fd: int, dir_fd: int,
                 fd: int, tmp: str, name: str, rel: str) -> None:
        self.server, self.volume_id = server, volume_id
        self.root_fd, self.dir_fd, self.fd = root_fd, dir_fd, fd
        self.tmp, self.name, self.rel = tmp, name, rel

    def write(self, data: bytes) -> None:
        """Append `data` (EDQUOT past the volume's bound, ENOSPC past the host's reserve)."""
        self.server._check_room(self.volume_id, self.root_fd, "write", len(data))
        before = os.fstat(self.fd).st_blocks
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        finally:
            self._charge(os.fstat(self.fd).st_blocks - before)

    def _charge(self, blocks: int) -> None:
        self.server.used(self.volume_id, self.root_fd)
        self.server._charge(self.volume_id, blocks * 512)

    def _blocks(self, name: str) -> int:
        try:
            return os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False).st_blocks
        except OSError:
            return 0

    def finish(self) -> dict:
        """Put the file in place (the one it replaces gives its room back); its entry."""
        try:
            os.close(self.fd)
            self.fd = -1
            replaced = self._blocks(self.name)
            os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            self._charge(-replaced)
            return self.server.entry(self.root_fd, self.rel)
        except BaseException:
            self.abort()
            raise
        finally:
            self._close()

    def abort(self) -> None:
        if self.dir_fd >= 0:
            written = self._blocks(self.tmp)
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir_fd)
                self._charge(-written)
        self._close()

    def _close(self) -> None:
        for attr in ("fd", "dir_fd", "root_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)

def _blocks_under(root_fd: int) -> int:
    """The bytes the files and directories under `root_fd` take (symlinks not followed)."""
    total = 0
    for _, dirs, files, dfd in os.fwalk(".", dir_fd=root_fd):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                total += os.stat(name, dir_fd=dfd, follow_symlinks=False).st_blocks * 512
    return total
