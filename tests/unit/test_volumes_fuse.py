"""Volumes' two ends without a VM: the host's file server (guest/volserve.py) stays inside
the volume's directory whatever a guest sends (`..`, absolute paths, symlinks someone put in
the directory, forged tokens); and the real agent (the Go binary) mounts a volume with FUSE
on this host and forwards file operations through the real host client to that server."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from guestkit import agent_link

from sandlot.guest.client import AgentClient
from sandlot.guest.volserve import VolumeServer

KEY = b"k" * 32


@pytest.fixture
def server(tmp_path: Path) -> VolumeServer:
    (tmp_path / "vols" / "vol-a").mkdir(parents=True)
    (tmp_path / "vols" / "vol-b").mkdir(parents=True)
    (tmp_path / "vols" / "vol-b" / "secret").write_text("b's")
    (tmp_path / "outside").write_text("host")
    return VolumeServer(tmp_path / "vols", KEY)


async def call(server: VolumeServer, fop: str, token: str, payload: bytes = b"",
               **fields) -> tuple[dict, bytes]:
    return await server.handle({"vreq": 1, "op": "vol", "fop": fop, "token": token,
                                **fields}, payload)


async def test_file_server_round_trip(server: VolumeServer) -> None:
    tok = server.token("vol-a")
    assert (await call(server, "mkdir", tok, path="d", mode=0o755))[0]["attr"]["mode"] & 0o777
    ans, _ = await call(server, "create", tok, path="d/f", mode=0o644)
    assert ans["attr"]["size"] == 0
    assert (await call(server, "write", tok, b"hello", path="d/f", offset=0))[0] == {"size": 5}
    assert (await call(server, "read", tok, path="d/f", offset=1, size=10))[1] == b"ello"
    assert (await call(server, "list", tok, path="d"))[0]["entries"] == [
        {"name": "f", "type": 8}]
    await call(server, "rename", tok, path="d/f", to="g")
    assert (await call(server, "setattr", tok, path="g", size=2))[0]["attr"]["size"] == 2
    assert (server.root / "vol-a" / "g").read_bytes() == b"he"
    assert (await call(server, "unlink", tok, path="g"))[0] == {}
    assert (await call(server, "rmdir", tok, path="d"))[0] == {}


@pytest.mark.parametrize("path", ["..", "../outside", "/etc/passwd", "a//b", "./x", "d/../..",
                                  "x\0y", "../vol-b/secret"])
async def test_paths_never_leave_the_volume(server: VolumeServer, path: str) -> None:
    tok = server.token("vol-a")
    for fop, extra in (("stat", {}), ("read", {"offset": 0, "size": 10}),
                       ("create", {"mode": 0o644}), ("unlink", {})):
        ans, data = await call(server, fop, tok, path=path, **extra)
        assert ans.get("errno") in (errno.EINVAL, errno.ENOENT), (fop, path, ans)
        assert data == b""
    assert (server.root.parent / "outside").read_text() == "host"


async def test_symlinks_in_the_directory_are_not_followed(server: VolumeServer) -> None:
    vol = server.root / "vol-a"
    os.symlink(server.root.parent / "outside", vol / "link")
    os.symlink(server.root.parent, vol / "dirlink")
    tok = server.token("vol-a")
    assert (await call(server, "read", tok, path="link", offset=0, size=10))[0]["errno"] \
        == errno.ELOOP
    assert (await call(server, "write", tok, b"x", path="link", offset=0))[0]["errno"] \
        == errno.ELOOP
    assert (await call(server, "stat", tok, path="dirlink/outside"))[0]["errno"] == errno.ENOTDIR
    assert (await call(server, "create", tok, path="dirlink/new"))[0]["errno"] == errno.ENOTDIR
    assert (await call(server, "setattr", tok, path="link", mode=0o777))[0]["errno"] \
        == errno.ELOOP
    # the link itself is listed and can be removed, never what it points to
    assert (await call(server, "unlink", tok, path="link"))[0] == {}
    assert (server.root.parent / "outside").read_text() == "host"


async def test_tokens_are_checked(server: VolumeServer) -> None:
    good = server.token("vol-a")
    forged = "vol-b." + good.partition(".")[2]
    for tok in (forged, "vol-b", "", "../x.y", 5, VolumeServer(server.root, b"other").token(
            "vol-b")):
        ans, data = await call(server, "read", tok, path="secret", offset=0, size=10)
        assert ans == {"errno": errno.EACCES} and data == b""
    # a deleted volume: its mounts answer ESTALE
    ans, _ = await call(server, "stat", server.token("gone"), path="")
    assert ans == {"errno": errno.ESTALE}


async def test_bad_requests_are_errors(server: VolumeServer) -> None:
    tok = server.token("vol-a")
    assert (await call(server, "nope", tok, path=""))[0] == {"errno": errno.ENOSYS}
    assert (await call(server, "read", tok, path="", offset=-1, size=1))[0]["errno"] \
        == errno.EINVAL
    assert (await call(server, "read", tok, path="x", offset=0, size=1 << 30))[0]["errno"] \
        == errno.EINVAL
    assert (await call(server, "stat", tok, path=7))[0] == {"errno": errno.EINVAL}
    assert (await call(server, "create", tok, path="f", mode="rwx"))[0] == {"errno": errno.EINVAL}
    ans, _ = await call(server, "create", tok, path="f", mode=0o6755)
    assert not ans["attr"]["mode"] & 0o6000  # no setuid files on the host


async def test_a_volume_holds_at_most_its_bound(tmp_path: Path) -> None:
    """Writes past SANDLOT_MAX_VOLUME_MB's bytes get EDQUOT; what a volume held before the
    server started counts; an unlink, a truncate or a rename over a file gives room back."""
    (tmp_path / "vols" / "v").mkdir(parents=True)
    (tmp_path / "vols" / "v" / "old").write_bytes(os.urandom(256 << 10))  # there already
    server = VolumeServer(tmp_path / "vols", KEY, max_bytes=1 << 20)
    tok, chunk = server.token("v"), os.urandom(128 << 10)
    await call(server, "create", tok, path="f", mode=0o644)
    written = 0
    while True:
        ans, _ = await call(server, "write", tok, chunk, path="f", offset=written)
        if "errno" in ans:
            assert ans == {"errno": errno.EDQUOT}
            break
        written += ans["size"]
        assert written <= 1 << 20
    assert 512 << 10 <= written <= (1 << 20) - (256 << 10)  # the old file counted
    assert (await call(server, "unlink", tok, path="old"))[0] == {}
    assert "errno" not in (await call(server, "write", tok, chunk, path="f", offset=written))[0]
    assert (await call(server, "setattr", tok, path="f", size=0))[0]["attr"]["size"] == 0
    for i in range(6):  # room again for what the truncate freed
        assert "errno" not in (await call(server, "write", tok, chunk, path="f",
                                          offset=i * len(chunk)))[0]
    await call(server, "create", tok, path="g", mode=0o644)
    assert (await call(server, "rename", tok, path="g", to="f"))[0] == {}  # f's blocks freed
    assert server.used("v", os.open(tmp_path / "vols" / "v", os.O_RDONLY)) < 64 << 10


async def test_the_hosts_reserve_is_kept(server: VolumeServer) -> None:
    """No write, create or mkdir takes the host's file system below its reserve: ENOSPC."""
    fs = os.statvfs(server.root)
    server.reserve_bytes = fs.f_bavail * fs.f_frsize + (1 << 30)  # more than is free
    tok = server.token("vol-a")
    for fop, fields in (("create", {"path": "f", "mode": 0o644}),
                        ("mkdir", {"path": "d", "mode": 0o755})):
        assert (await call(server, fop, tok, **fields))[0] == {"errno": errno.ENOSPC}
    assert (await call(server, "write", tok, b"x", path="f", offset=0))[0] == {
        "errno": errno.ENOSPC}
    assert "attr" in (await call(server, "stat", tok, path=""))[0]  # the rest goes on


def _fuse_usable() -> bool:
    return os.geteuid() == 0 and Path("/dev/fuse").exists()


@pytest.fixture
async def linked(tmp_path: Path, server: VolumeServer
                 ) -> AsyncIterator[tuple[Path, AgentClient]]:
    """The agent run here, with the volume vol-a mounted under tmp_path, and its client."""
    if not _fuse_usable():
        pytest.skip("needs root and /dev/fuse")
    mnt = tmp_path / "mnt"
    async with agent_link(volumes=server) as client:
        try:
            assert client.has_cap("volumes")
            await client.mount(str(mnt), server.token("vol-a"))
            yield mnt, client
        finally:
            await asyncio.to_thread(subprocess.run, ["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def mounted(linked) -> Path:
    return linked[0]


async def test_agent_mounts_a_volume_with_fuse(mounted: Path, server: VolumeServer) -> None:
    vol = server.root / "vol-a"

    def work() -> None:
        (mounted / "dir" / "sub").mkdir(parents=True)
        (mounted / "dir" / "sub" / "f.txt").write_text("from the guest")
        big = os.urandom(3 << 20)
        (mounted / "big").write_bytes(big)
        assert (vol / "big").read_bytes() == big
        assert (mounted / "big").read_bytes() == big
        (vol / "host.txt").write_text("from the host")
        assert (mounted / "host.txt").read_text() == "from the host"
        assert sorted(p.name for p in mounted.iterdir()) == ["big", "dir", "host.txt"]
        os.rename(mounted / "dir", mounted / "moved")
        assert (mounted / "moved" / "sub" / "f.txt").read_text() == "from the guest"
        with open(mounted / "moved" / "sub" / "f.txt", "a") as f:
            f.write("!")
        os.truncate(mounted / "big", 10)
        assert (mounted / "big").stat().st_size == 10
        os.unlink(mounted / "big")
        with pytest.raises(FileNotFoundError):
            (mounted / "nothere").read_text()
        with pytest.raises(OSError):
            os.symlink("/etc/passwd", mounted / "link")
        os.statvfs(mounted)

    await asyncio.to_thread(work)
    assert (vol / "moved" / "sub" / "f.txt").read_text() == "from the guest!"
    assert not (vol / "big").exists() and not (vol / "link").exists()


async def test_mount_refuses_bad_paths(tmp_path: Path, server: VolumeServer) -> None:
    if not _fuse_usable():
        pytest.skip("needs root and /dev/fuse")
    from sandlot.errors import InvalidArgumentError

    async with agent_link() as client:
        for bad in ("/", "relative", "/a/../b", ""):
            with pytest.raises(InvalidArgumentError):
                await client.mount(bad, server.token("vol-a"))


async def test_uploads_into_a_volume_do_not_wait_on_the_main_loop(linked,
                                                                  server: VolumeServer) -> None:
    """The agent writes an upload in a goroutine of its own, with the host's window: an
    upload into the volume (each of its writes a request the main loop must answer) ends."""
    mounted, client = linked
    assert client.has_cap("write_credit")
    data = os.urandom(20 << 20)

    async def chunks():
        for i in range(0, len(data), 3 << 20):
            yield data[i:i + (3 << 20)]

    entry = await asyncio.wait_for(client.write(str(mounted / "up" / "big.bin"), chunks()), 120)
    assert entry.size == len(data)
    assert (server.root / "vol-a" / "up" / "big.bin").read_bytes() == data


async def test_an_upload_past_a_volumes_bound_fails_with_the_reason(linked,
                                                                    server: VolumeServer) -> None:
    """An upload that the volume's bound cuts short fails with EDQUOT's reason, every time:
    the host's further chunks (sent ahead, within the window) never answer first; the
    half-written file goes, and its room with it."""
    mounted, client = linked
    server.max_bytes = 1 << 20

    async def chunks():
        for _ in range(16):
            yield os.urandom(256 << 10)

    for i in range(8):
        with pytest.raises(Exception, match="(?i)quota exceeded") as ei:
            await asyncio.wait_for(client.write(str(mounted / f"big{i}.bin"), chunks()), 60)
        assert "unknown op" not in str(ei.value)
    assert not list((server.root / "vol-a").iterdir())
    assert server.used("vol-a", os.open(server.root / "vol-a", os.O_RDONLY)) < 64 << 10


async def test_a_failed_upload_answers_its_reason_first(linked, tmp_path: Path) -> None:
    """An upload that fails at once (its parent is a file) answers with the reason, never
    with the "unknown op 'chunk'" the main loop gives the chunks that follow once the upload
    is forgotten: the upload's goroutine answers before it is forgotten (the old order lost
    the race 4 times in 300 here, and a disk-full write in a VM got the wrong error)."""
    _, client = linked
    (tmp_path / "afile").write_text("x")

    async def chunks():
        for _ in range(16):
            yield b"y" * (64 << 10)

    for i in range(300):
        with pytest.raises(Exception) as ei:
            await asyncio.wait_for(client.write(str(tmp_path / "afile" / f"x{i}"), chunks()), 30)
        assert "unknown op" not in str(ei.value) and "afile" in str(ei.value), str(ei.value)


class _LosesFirst(VolumeServer):
    """Never answers its first request (a host that went away with it unanswered)."""

    lost = 0

    async def handle(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        if header.get("fop") == "read" and not self.lost:
            self.lost += 1
            await asyncio.Event().wait()
        return await super().handle(header, payload)


async def test_unanswered_requests_are_sent_again_to_a_new_session(linked, server) -> None:
    """What a restore relies on: a request the old host never answered is sent again after
    the next hello, and the guest's caller gets its answer."""
    mounted, client = linked
    (server.root / "vol-a" / "f").write_text("kept")
    client.volumes = losing = _LosesFirst(server.root, KEY)
    reading = asyncio.ensure_future(asyncio.to_thread((mounted / "f").read_text))
    while not losing.lost:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert not reading.done()
    await client._handshake(5.0, None)  # a new session, as after a restore
    assert await asyncio.wait_for(reading, 30) == "kept"


async def test_big_files_move_a_mebibyte_per_request(mounted: Path, server: VolumeServer,
                                                     monkeypatch) -> None:
    """Each read or write is a round trip to the host: the mount asks the kernel for 1 MiB
    requests (FUSE_MAX_PAGES), not its default 128 KiB."""
    sizes: list[tuple[str, int]] = []
    handle = server.handle

    async def recording(header: dict, payload: bytes) -> tuple[dict, bytes]:
        ans, data = await handle(header, payload)
        if header.get("fop") in ("read", "write"):
            sizes.append((header["fop"], len(payload) or len(data)))
        return ans, data

    monkeypatch.setattr(server, "handle", recording)
    big = os.urandom(4 << 20)

    def work() -> None:
        with open(mounted / "big", "wb") as f:
            f.write(big)
        with open(mounted / "big", "rb") as f:
            assert f.read() == big

    await asyncio.to_thread(work)
    assert max(n for fop, n in sizes if fop == "write") == 1 << 20, sizes
    assert max(n for fop, n in sizes if fop == "read") == 1 << 20, sizes
