"""The lazy image filesystem: one process per image being fetched, serving the image's files
read-only through FUSE while `storage.lazy.LazyFiles` fills them in from the store.

VMs map the served RAM file copy-on-write and read the served disk layer: a page they touch
is read through FUSE once (the chunk fetched if it is not local yet), then lives in the page
cache that every VM of the image on this host shares. The process runs in a session of its
own, so a server restart does not take it (and the VMs it serves) down; it ends when its
mount is unmounted (`runtime/lazy.py` does that when the last VM that maps it is gone).

Run as ``python -m sandlot.storage.lazyfs CONFIG``, or with ``--wait SERVER_PID`` to start
ahead and read CONFIG's path from stdin when it is needed (its imports take ~0.5 s; EOF, or its
server gone: exit), where CONFIG is a JSON file::

    {"store": URL, "key": KEY, "dir": DIR, "mount": MOUNT, "files": {NAME: FILENAME},
     "prefetch": 8, "gid": GID}

DIR holds ``manifest.json`` (the image's manifest), receives the files under their FILENAMEs
and these markers: ``lazy.ready`` (mounted), ``lazy.complete`` (every chunk local and
verified), ``lazy.failed`` (why a chunk could not be had), ``lazy.stats`` (chunks fetched and
missing, bytes fetched).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import select
import stat
import sys
import threading
import time
from pathlib import Path

from sandlot.errors import NotFoundError, SandlotError
from sandlot.storage.lazy import ORDER_WINDOW, LazyFiles, Order, order_key, pack_key
from sandlot.storage.manifest import Manifest
from sandlot.storage.objects import ObjectStore, open_store

READY, COMPLETE, FAILED, MANIFEST = "lazy.ready", "lazy.complete", "lazy.failed", "manifest.json"
STATS = "lazy.stats"  # what it fetched so far (JSON), rewritten as it changes
STATS_INTERVAL = 0.1
# after the order's chunks, the rest waits until nothing was read through the mount for this
# long (the restores' first steps are done), or this long at most
QUIET, QUIET_AT_MOST = 3.0, 30.0
log = logging.getLogger("sandlot.lazyfs")


def _record_failure(dir_: Path, reason: str) -> None:
    """Why the image failed (`lazy.failed`), the first reason only: the server reads it as
    the error of a sandbox whose VM died of it, so it is there before a VM can die."""
    with contextlib.suppress(OSError):
        if not (dir_ / FAILED).exists():
            (dir_ / FAILED).write_text(reason)


def _operations(files: LazyFiles, names: dict[str, str], gid: int | None, dir_: Path):
    import mfusepy

    by_path = {f"/{filename}": name for name, filename in names.items()}
    now = time.time()
    owner = {"st_uid": 0, "st_gid": gid if gid is not None else 0,
             "st_atime": now, "st_mtime": now, "st_ctime": now}

    class ImageFS(mfusepy.Operations):
        use_ns = False

        def init(self, path: str) -> None:
            (dir_ / READY).touch()
            log.info("mounted %s", dir_.name)

        def getattr(self, path: str, fh=None) -> dict:
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o750, "st_nlink": 2, **owner}
            name = by_path.get(path)
            if name is None:
                raise mfusepy.FuseOSError(errno.ENOENT)
            # RAM is opened read-write to be mapped copy-on-write (QEMU 7.2); never written.
            mode = 0o660 if name.startswith(("ram", "dimm")) else 0o640
            return {"st_mode": stat.S_IFREG | mode, "st_nlink": 1,
                    "st_size": files.size(name), **owner}

        def readdir(self, path: str, fh) -> list[str]:
            return [".", "..", *(p[1:] for p in by_path)]

        def open(self, path: str, flags: int) -> int:
            if path not in by_path:
                raise mfusepy.FuseOSError(errno.ENOENT)
            return 0

        def read(self, path: str, size: int, offset: int, fh) -> bytes:
            name = by_path.get(path)
            if name is None:
                raise mfusepy.FuseOSError(errno.ENOENT)
            try:
                return files.read(name, offset, size)
            except SandlotError as e:
                log.error("%s", e)
                _record_failure(dir_, str(e))
                raise mfusepy.FuseOSError(errno.EIO) from None

        def write(self, path: str, data, offset: int, fh) -> int:
            raise mfusepy.FuseOSError(errno.EROFS)

        def truncate(self, path: str, length: int, fh=None) -> None:
            if name := by_path.get(path):
                if length == files.size(name):
                    return
            raise mfusepy.FuseOSError(errno.EROFS)

        def statfs(self, path: str) -> dict:
            return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}

    return ImageFS()


async def _fetch_order(objects: ObjectStore, key: str) -> Order | None:
    try:
        return Order.loads(await objects.get(order_key(key)))
    except NotFoundError:
        return None
    except SandlotError as e:
        log.warning("no prefetch order for %s: %s", key, e)
        return Order([])


async def _save_order(objects: ObjectStore, key: str, files: LazyFiles) -> None:
    """The order this mount's first minute of reads took, and its pack (pack first: the
    order is what names it)."""
    order, blob = await asyncio.to_thread(files.pack)
    if not order.chunks or await objects.exists(order_key(key)):
        return
    await objects.put(pack_key(key), blob)
    await objects.put(order_key(key), order.dumps())
    log.info("recorded the order of %d chunks of %s (pack %.1f MiB)", len(order.chunks), key,
             len(blob) / 2**20)


def serve(config: dict) -> None:
    import mfusepy

    key, dir_ = config["key"], Path(config["dir"])
    objects = open_store(config["store"])
    manifest = Manifest.loads((dir_ / MANIFEST).read_bytes(), key)
    names: dict[str, str] = config["files"]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="fetch", daemon=True).start()

    def run(coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def make() -> LazyFiles:
        return LazyFiles(objects, {n: (manifest.files[n], dir_ / f) for n, f in names.items()},
                         f"image {key}", loop)

    files = run(make())
    started = time.monotonic()
    saved = threading.Event()
    orders: list[Order | None] = []  # the image's recorded order, once asked (None: none)
    known = asyncio.Event()

    async def fill() -> None:
        parallel = int(config.get("prefetch", 8))  # 0: only what is read is fetched
        first = asyncio.ensure_future(files.prefetch(files.first()) if parallel
                                      else asyncio.sleep(0))  # while the mount comes up
        order = await _fetch_order(objects, key)
        orders.append(order)
        known.set()
        await first
        if parallel:
            if order is not None:
                await files.load_pack(key, order)
                log.info("%s: first files and pack in (%d chunks)", key, files.fetched_chunks)
                # the order's chunks the pack did not bring, at full speed; then the rest
                # slower, leaving the CPU to the VMs that run meanwhile
                await files.prefetch(order.chunks, parallel)
                await files.quiet(QUIET, QUIET_AT_MOST)
            await files.prefetch(files.everything(), max(1, parallel // 4))
        await files.complete.wait()
        (dir_ / COMPLETE).write_text(json.dumps({"fetched_bytes": files.fetched_bytes}))
        log.info("%s: every chunk local (%.1f MiB fetched)", key, files.fetched_bytes / 2**20)

    async def record() -> None:  # what the first window of reads touched, once per image
        await known.wait()
        if orders[0] is None:
            await asyncio.sleep(max(0.0, ORDER_WINDOW - (time.monotonic() - started)))
            await _save_order(objects, key, files)
            saved.set()

    async def report() -> None:
        last = None
        while True:
            stats = files.stats()
            if stats != last:
                if files.failed is not None:  # a prefetch's failure
                    _record_failure(dir_, files.failed)
                tmp = dir_ / (STATS + ".tmp")
                tmp.write_text(json.dumps(stats))
                tmp.replace(dir_ / STATS)
                last = stats
            await asyncio.sleep(STATS_INTERVAL)

    tasks = [asyncio.run_coroutine_threadsafe(job(), loop) for job in (fill, record, report)]
    mount = Path(config["mount"])
    try:
        mfusepy.FUSE(_operations(files, names, config.get("gid"), dir_), str(mount),
                     foreground=True, allow_other=True, default_permissions=True,
                     kernel_cache=True, fsname=f"sandlot-lazy-{key}", subtype="sandlot")
    finally:
        for task in tasks:
            task.cancel()
        if orders and orders[0] is None and not saved.is_set():
            with contextlib.suppress(Exception):
                run(_save_order(objects, key, files), 10)
        if files.failed is not None:
            _record_failure(dir_, files.failed)
        files.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--wait":
        import mfusepy  # noqa: F401 - imported ahead, while nothing waits for it

        # Its server's pid is given: a server killed while this one started (before it could
        # ask for its parent) is gone all the same; a child of it may hold stdin open.
        parent = int(argv[1]) if len(argv) > 1 else os.getppid()
        while not select.select([sys.stdin], [], [], 1.0)[0]:
            if os.getppid() != parent:
                return 0
        path = sys.stdin.readline().strip()
        if not path:
            return 0
        log_fd = os.open(Path(path).with_name("lazy.log"), os.O_WRONLY | os.O_CREAT
                         | os.O_APPEND, 0o640)
        os.dup2(log_fd, 2)
        os.dup2(log_fd, 1)
        argv = [path]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mfusepy").setLevel(logging.WARNING)
    config = json.loads(Path(argv[0]).read_text())
    os.umask(0o027)
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
