"""Lazy restore (issue 25): a server whose cache lacks a snapshot serves it from S3 (a real
SeaweedFS on loopback, this module's own) as the sandbox reads it.

A restored sandbox's memory and files are exactly the snapshot's; two siblings share the pages
they fetched (their QEMUs map one page cache); a corrupt chunk is refused, never cached, and
the sandbox that needed it fails with the reason; with the store stopped, a sandbox that still
needs pages fails with the reason within a bound, while one whose image is all fetched and one
of another image keep answering."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
from collections import Counter

import pytest
import zstandard
from snapkit import ask, hot_dir, start_holder, wait_for

from harness import cleanup, make_server
from sandlot import Sandbox, StorageError
from sandlot.storage.chunks import chunk_key
from sandlot.storage.objects import open_store
from sandlot.storage.store import Store
from sandlot.testing import S3Server, base_only_images

pytestmark = pytest.mark.vm

MiB = 1 << 20
PAGE = 4096
BIG = 32 * MiB  # a file in the guest's tmpfs: guest RAM the test reads back


@pytest.fixture(scope="module")
def s3own(tmp_path_factory):
    srv = S3Server(tmp_path_factory.mktemp("s3lazy"))
    srv.start()
    yield srv
    srv.stop()


def _server(s3: S3Server, tmp_path_factory, name: str, **env: str):
    """A server on the module's store whose images dir knows the base template alone
    (`base_only_images`: the shared index's others are not given to the store meanwhile)."""
    root = tmp_path_factory.mktemp(name)
    srv = make_server(root, name + secrets.token_hex(2))
    srv.extra_env.update({"SANDLOT_STORE": s3.url("lazy"), "SANDLOT_POOL_SIZE": "0", **s3.env,
                          "SANDLOT_IMAGES_DIR": str(base_only_images(root / "images")),
                          **env})
    srv.start()
    return srv


def _store(s3: S3Server) -> Store:
    with s3.environ():
        return Store(open_store(s3.url("lazy")))


def _md5(sbx: Sandbox, path: str) -> str:
    return sbx.commands.run(f"md5sum {path}", check=True, timeout=300).stdout.split()[0]


@pytest.fixture(scope="module")
def snap(s3own, tmp_path_factory):
    """A snapshot in S3 of a sandbox holding a process (its memory) and 32 MiB of random data
    in its tmpfs (guest RAM) and 8 MiB on its disk."""
    a = _server(s3own, tmp_path_factory, "la")
    try:
        wait_for(lambda: asyncio.run(_store(s3own).objects.exists("index/templates/base.json")),
                 300, interval=1, what="the base template in S3")
        sbx = Sandbox.create(timeout=900, **a.client_kwargs())
        big = os.urandom(BIG)
        sbx.files.write("/dev/shm/big", big)
        sbx.commands.run("head -c 8M /dev/urandom > /root/disk.bin && sync", check=True)
        answer = start_holder(sbx)
        sums = {"/dev/shm/big": _md5(sbx, "/dev/shm/big"),
                "/root/disk.bin": _md5(sbx, "/root/disk.bin")}
        assert sums["/dev/shm/big"] == hashlib.md5(big).hexdigest()
        snapshot = sbx.create_snapshot().wait()
        sbx.kill()
        yield snapshot, answer, sums, big
    finally:
        cleanup(a)


def _shared_ram_mib(pid: int) -> float:
    """Guest RAM of QEMU `pid` that it maps shared with another process (the image's pages
    in the page cache), from the RAM file's mapping."""
    shared = 0
    in_ram = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
                in_ram = len(parts) > 5 and parts[5].endswith("/ram")
            elif in_ram and parts[0] in ("Shared_Clean:", "Shared_Dirty:"):
                shared += int(parts[1])
    return shared / 1024


def test_a_lazy_restore_is_exactly_the_snapshot_and_siblings_share_its_pages(
        snap, s3own, tmp_path_factory):
    snapshot, answer, sums, _ = snap
    b = _server(s3own, tmp_path_factory, "lb", SANDLOT_LAZY_PREFETCH="0")  # only what is read
    try:
        one = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900, **b.client_kwargs())
        entry = hot_dir(b.shm_root, snapshot.snapshot_id)
        assert os.path.ismount(entry / "lazy"), "the image was not mounted lazily"
        assert ask(one).memory == answer.memory  # the process, where it was
        two = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900, **b.client_kwargs())
        for sbx in (one, two):
            assert {p: _md5(sbx, p) for p in sums} == sums
        assert not (entry / ".ok").exists()  # nothing fetched but what was read
        for sbx in (one, two):
            shared = _shared_ram_mib(sbx.get_info().pid)
            assert shared > BIG / MiB * 0.8, f"siblings share {shared:.0f} MiB of guest RAM"
        # The children are independent.
        one.files.write("/root/mine.txt", "one")
        assert two.commands.run("cat /root/mine.txt").exit_code != 0
        for sbx in (one, two):
            sbx.kill()
        wait_for(lambda: not os.path.ismount(entry / "lazy"), 30, what="the mount to go")
    finally:
        cleanup(b)


def _chunks_of(big: bytes, store: Store, key: str) -> list[str]:
    """Digests of the snapshot's RAM chunks that hold nothing but pages of `big`, whose two
    neighbours on each side do too (the kernel reads 128 KiB around a fault: a restore must
    not read them for other pages), and that hold nothing else of the image."""
    pages = {hashlib.sha256(big[o:o + PAGE]).digest() for o in range(0, len(big), PAGE)}
    manifest = asyncio.run(store.manifest(key))
    chunks = manifest.files["ram"].chunks
    only_big: set[int] = set()

    async def scan() -> None:
        for index, digest in chunks.items():
            data = zstandard.ZstdDecompressor().decompress(
                await store.objects.get(chunk_key(digest)))
            if all(hashlib.sha256(data[o:o + PAGE]).digest() in pages
                   for o in range(0, len(data), PAGE)):
                only_big.add(index)

    asyncio.run(scan())
    uses = Counter(d for f in manifest.files.values() for d in f.chunks.values())
    return [chunks[i] for i in sorted(only_big)
            if all(i + d in only_big for d in (-2, -1, 1, 2)) and uses[chunks[i]] == 1]


def test_a_corrupt_chunk_is_refused_and_never_cached(snap, s3own, tmp_path_factory):
    snapshot, _, sums, big = snap
    store = _store(s3own)
    victims = _chunks_of(big, store, snapshot.snapshot_id)[:4]
    assert victims, "no chunk of the snapshot holds only the file's pages"
    good = {d: asyncio.run(store.objects.get(chunk_key(d))) for d in victims}
    bad = zstandard.ZstdCompressor().compress(b"not what the digest says" * 100)
    for digest in victims:
        asyncio.run(store.objects.put(chunk_key(digest), bad))
    c = _server(s3own, tmp_path_factory, "lc", SANDLOT_LAZY_PREFETCH="0")
    try:
        # The guest's kernel may touch the file's pages on its own as it resumes (it
        # compacts memory), so the restore itself may be what reads a corrupt chunk; else
        # the command that reads the file is. Either way the sandbox fails with the reason.
        try:
            sbx = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900,
                                 **c.client_kwargs())
        except StorageError as e:
            error = str(e)
        else:
            with pytest.raises(Exception):  # noqa: B017 - the VM dies under the command
                sbx.commands.run("md5sum /dev/shm/big", timeout=300)
            info = wait_for(lambda: (i := sbx.get_info()).state == "failed" and i, 120,
                            interval=1, what="the sandbox to fail")
            error = info.error or ""
        assert "corrupt" in error, error
        entry = hot_dir(c.shm_root, snapshot.snapshot_id)
        assert not (entry / ".ok").exists()
        for digest, data in good.items():  # repaired: a new restore reads the true bytes
            asyncio.run(store.objects.put(chunk_key(digest), data))
        again = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900,
                               **c.client_kwargs())
        assert {p: _md5(again, p) for p in sums} == sums
        again.kill()
    finally:
        for digest, data in good.items():
            asyncio.run(store.objects.put(chunk_key(digest), data))
        cleanup(c)


def test_a_lazy_sandbox_and_its_mount_outlive_a_server_crash(snap, s3own, tmp_path_factory):
    """The mount's process runs in a session of its own: a server killed and started again
    finds the sandbox running, its pages never read before still come through the mount,
    and the mount goes with the sandbox."""
    snapshot, answer, sums, _ = snap
    srv = _server(s3own, tmp_path_factory, "lr", SANDLOT_LAZY_PREFETCH="0")
    try:
        kw = srv.client_kwargs()
        sbx = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900, **kw)
        entry = hot_dir(srv.shm_root, snapshot.snapshot_id)
        assert os.path.ismount(entry / "lazy")
        srv.stop(signal.SIGKILL)
        assert os.path.ismount(entry / "lazy")
        srv.start()
        again = Sandbox.connect(sbx.sandbox_id, **kw)
        assert {p: _md5(again, p) for p in sums} == sums
        assert ask(again).memory == answer.memory
        assert not (entry / ".ok").exists()  # still served by the mount
        again.kill()
        wait_for(lambda: not os.path.ismount(entry / "lazy"), 30, what="the mount to go")
    finally:
        cleanup(srv)


def test_with_the_store_stopped_a_sandbox_that_needs_pages_fails_and_others_answer(
        snap, s3own, tmp_path_factory):
    """Last in the module: it stops the module's S3 server."""
    snapshot, _, sums, _ = snap
    lazy = _server(s3own, tmp_path_factory, "ld", SANDLOT_LAZY_PREFETCH="0")
    whole = _server(s3own, tmp_path_factory, "le")  # prefetches everything
    try:
        needy = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900,
                               **lazy.client_kwargs())
        assert needy.commands.run("echo up").stdout == "up\n"
        other = Sandbox.create("base", timeout=900, **lazy.client_kwargs())  # not lazy
        fetched = Sandbox.create(snapshot_id=snapshot.snapshot_id, timeout=900,
                                 **whole.client_kwargs())
        wait_for(lambda: (hot_dir(whole.shm_root, snapshot.snapshot_id) / ".ok").exists()
                 or hot_dir(whole.shm_root, snapshot.snapshot_id).joinpath(
                     "lazy.complete").exists(), 300, interval=0.5,
                 what="the whole image on the second server")
        s3own.stop()
        with pytest.raises(Exception):  # noqa: B017 - the VM dies under the command
            needy.commands.run("md5sum /dev/shm/big", timeout=300)
        info = wait_for(lambda: (i := needy.get_info()).state == "failed" and i, 180,
                        interval=1, what="the sandbox to fail")
        assert "could not be fetched" in (info.error or ""), info.error
        assert other.commands.run("echo alive").stdout == "alive\n"
        assert {p: _md5(fetched, p) for p in sums} == sums  # needs the store no more
        for sbx in (other, fetched):
            sbx.kill()
    finally:
        cleanup(lazy)
        cleanup(whole)
