"""The host's end of volumes: serves the file operations a guest's volume mount forwards
(`vreq` frames, docs/guest-protocol.md "Volumes") from the volume's directory.

A guest names its volume by a token the host gave it at mount time (`<volume id>.<HMAC>`):
the token lives in guest memory, so snapshots, forks and restores keep their mounts without
any state here, and a guest cannot forge one for a volume it was not given. Paths are
resolved one component at a time under the volume's directory with O_NOFOLLOW: `..`, empty
components and symlinks (a guest cannot make one, but the directory may hold one) never lead
out of it. The E2B content API (core/volume_content.py) reads and writes volumes through the
same walk, naming a volume by its id (`root_fd`, `entry`, `list_dir`, ..., `upload`).
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
import time
from collections.abc import Iterator
from pathlib import Path

MAX_IO = 128 << 10  # the agent's FUSE max_write
MAX_LIST = 4096  # entries per `list` answer (the kernel asks again from where it stopped)
MAX_PATH = 4096
_VOLUME_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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

    def __init__(self, root: Path, key: bytes) -> None:
        self.root = root
        self._key = key

    # ---- volumes --------------------------------------------------------------------------

    def create(self, volume_id: str) -> None:
        self.token(volume_id)  # checks the id
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / volume_id).mkdir(mode=0o755)

    def delete(self, volume_id: str) -> None:
        self.token(volume_id)
        shutil.rmtree(self.root / volume_id, ignore_errors=True)

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
            return method(root_fd, path, h, payload)
        finally:
            os.close(root_fd)

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
                return Upload(self, os.dup(root_fd), os.dup(dfd), fd, tmp, name, rel)


class Upload:
    """A file being written into a volume under a temporary name (`VolumeServer.upload`)."""

    def __init__(self, server: VolumeServer, root_fd: int, dir_fd: int, fd: int, tmp: str,
                 name: str, rel: str) -> None:
        self.server, self.root_fd, self.dir_fd, self.fd = server, root_fd, dir_fd, fd
        self.tmp, self.name, self.rel = tmp, name, rel

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self) -> dict:
        """Put the file in place; its entry."""
        try:
            os.close(self.fd)
            self.fd = -1
            os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
            return self.server.entry(self.root_fd, self.rel)
        except BaseException:
            self.abort()
            raise
        finally:
            self._close()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.dir_fd)
        self._close()

    def _close(self) -> None:
        for attr in ("fd", "dir_fd", "root_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)
