"""E2B's volume content API (`Volume.list`, `read_file`, `write_file`, `make_dir`,
`get_info`, `exists`, `update_metadata`, `remove` of an instance) through the unmodified
`e2b` SDK, against a server on loopback on the fake runtime: the API is host-side, so no VM
is needed (tests/e2b/test_e2b_volumes.py reads the same files in a sandbox). Paths stay in
the volume (`..`, symlinks: refused); another tenant's volume is not found; a wrong token is
refused."""

from __future__ import annotations

import io
import json
import os
import time

import httpx
import pytest
from e2b import AsyncVolume, VolumeFileType
from e2b.exceptions import (
    AuthenticationException,
    NotFoundException,
    VolumeException,
    VolumePathNotFoundException,
)
from fastkit import serving

from sandlot.core.db import scoped_name
from sandlot.core.hosts import Hosts
from sandlot.core.models import VolumeInfo, now
from sandlot.guest.volserve import VolumeServer
from sandlot.runtime.fake import FakeRuntime
from sandlot.server.app import create_app
from sandlot.testing import fake_settings, in_process, install_fake_template


@pytest.fixture
async def env(tmp_path):
    runtime = FakeRuntime()
    runtime.volumes = VolumeServer(tmp_path / "vols", b"k" * 32, max_bytes=4 << 20)
    settings = fake_settings(tmp_path)
    install_fake_template(settings, runtime)
    app = create_app(settings, runtime=runtime)
    async with serving(app) as port:
        keys = {"a": "sl_vc_a", "b": "sl_vc_b"}
        for tenant, key in keys.items():
            await app.state.core.db.add_key(key, tenant)
        url = f"http://127.0.0.1:{port}/e2b"
        # E2B_VOLUME_API_URL (or api_url= per call) points the content calls at sandlot
        opts = {t: {"api_url": url, "api_key": k} for t, k in keys.items()}
        yield opts, tmp_path / "vols", url


async def test_files_of_a_volume(env) -> None:
    opts, vols, url = env
    a = opts["a"]
    vol = await AsyncVolume.create("data", **a)
    va = {"api_url": url}
    assert await vol.list("/", **va) == []

    e = await vol.write_file("/hello.txt", "hi there", **va)
    assert (e.name, e.type, e.path, e.size) == ("hello.txt", VolumeFileType.FILE,
                                                 "/hello.txt", 8)
    assert (vols / vol.volume_id / "hello.txt").read_text() == "hi there"
    assert await vol.read_file("/hello.txt", **va) == "hi there"
    blob = bytes(range(256)) * 5000  # over one chunk
    await vol.write_file("deep/er/blob.bin", io.BytesIO(blob), mode=0o600, **va)
    assert await vol.read_file("/deep/er/blob.bin", format="bytes", **va) == blob
    streamed = b"".join([c async for c in await vol.read_file("/deep/er/blob.bin",
                                                             format="stream", **va)])
    assert streamed == blob
    info = await vol.get_info("/deep/er/blob.bin", **va)
    assert info.size == len(blob) and info.mode == 0o600 and info.mtime.tzinfo is not None
    await vol.write_file("/hello.txt", b"replaced", **va)  # a file there is replaced
    assert await vol.read_file("/hello.txt", **va) == "replaced"

    d = await vol.make_dir("/sub", **va)
    assert (d.type, d.path) == (VolumeFileType.DIRECTORY, "/sub")
    with pytest.raises(VolumeException, match="exists already"):
        await vol.make_dir("/sub", **va)
    await vol.make_dir("/sub", force=True, **va)  # there already: fine with force
    with pytest.raises(VolumePathNotFoundException):
        await vol.make_dir("/no/such/parent", **va)
    await vol.make_dir("/a/b/c", force=True, **va)
    assert (vols / vol.volume_id / "a" / "b" / "c").is_dir()

    top = await vol.list("/", **va)
    assert [(x.name, x.type) for x in top] == [
        ("a", VolumeFileType.DIRECTORY), ("deep", VolumeFileType.DIRECTORY),
        ("hello.txt", VolumeFileType.FILE), ("sub", VolumeFileType.DIRECTORY)]
    deep = await vol.list("/", depth=3, **va)
    assert "/deep/er/blob.bin" in {x.path for x in deep} and "/a/b/c" in {x.path for x in deep}
    assert [x.path for x in await vol.list("/deep/er", **va)] == ["/deep/er/blob.bin"]

    e = await vol.update_metadata("/hello.txt", mode=0o640, **va)
    assert e.mode == 0o640
    assert await vol.exists("/hello.txt", **va) and not await vol.exists("/nope", **va)

    # missing paths: 404, the SDK's VolumePathNotFoundException
    for call in (vol.read_file("/nope", **va), vol.get_info("/nope", **va),
                 vol.list("/nope", **va), vol.remove("/nope", **va)):
        with pytest.raises(VolumePathNotFoundException):
            await call
    with pytest.raises(VolumeException, match="is a directory"):
        await vol.read_file("/sub", **va)
    with pytest.raises(VolumeException, match="not a directory"):
        await vol.list("/hello.txt", **va)

    await vol.remove("/hello.txt", **va)
    await vol.remove("/a", **va)  # a directory, with what it holds
    assert [x.name for x in await vol.list("/", **va)] == ["deep", "sub"]
    with pytest.raises(VolumeException, match="root"):
        await vol.remove("/", **va)


async def test_a_volume_holds_at_most_its_bound(env) -> None:
    """The content API's uploads count against the volume's bound (4 MiB here) as the
    guests' writes do: past it, a clear error and nothing half-written; a remove gives the
    room back."""
    opts, vols, url = env
    vol = await AsyncVolume.create("full", **opts["a"])
    va = {"api_url": url}
    await vol.write_file("/a.bin", os.urandom(3 << 20), **va)
    with pytest.raises(VolumeException, match="is full"):
        await vol.write_file("/b.bin", os.urandom(2 << 20), **va)
    assert [p.name for p in (vols / vol.volume_id).iterdir()] == ["a.bin"]
    await vol.remove("/a.bin", **va)
    await vol.write_file("/b.bin", os.urandom(2 << 20), **va)  # its room back
    await vol.write_file("/b.bin", os.urandom(1 << 20), **va)
    await vol.write_file("/c.bin", os.urandom(5 << 19), **va)  # the replaced 2 MiB: freed


async def test_paths_stay_in_the_volume(env, tmp_path) -> None:
    opts, vols, url = env
    vol = await AsyncVolume.create("data", **opts["a"])
    va = {"api_url": url}
    root = vols / vol.volume_id
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    (root / "d").mkdir()
    os.symlink(secret, root / "link")  # a symlink put in the directory (not by the API)
    os.symlink(tmp_path, root / "dirlink")

    for bad in ("/../secret.txt", "../secret.txt", "/d/../../secret.txt", "/./x", "a//b"):
        with pytest.raises(VolumeException, match="400: bad volume path"):
            await vol.read_file(bad, **va)
    with pytest.raises(VolumeException, match="400"):
        await vol.write_file("/../escaped.txt", "x", **va)
    assert not (vols / "escaped.txt").exists()
    # an absolute path is the volume's: /etc/passwd is not the host's
    with pytest.raises(VolumePathNotFoundException):
        await vol.read_file(str(secret), **va)
    with pytest.raises(VolumePathNotFoundException):
        await vol.read_file("/etc/passwd", **va)

    # symlinks are never followed: not to read, write, list through, or remove through
    with pytest.raises(VolumeException, match="symlink"):
        await vol.read_file("/link", **va)
    with pytest.raises(VolumeException, match="400"):
        await vol.read_file("/dirlink/secret.txt", **va)
    with pytest.raises(VolumeException, match="400"):
        await vol.list("/dirlink", **va)
    with pytest.raises(VolumeException, match="400"):
        await vol.write_file("/dirlink/planted.txt", "x", **va)
    with pytest.raises(VolumeException, match="400"):
        await vol.make_dir("/dirlink/sub", force=True, **va)
    with pytest.raises(VolumeException, match="400"):
        await vol.update_metadata("/link", mode=0o777, **va)
    assert not (tmp_path / "planted.txt").exists() and not (tmp_path / "sub").exists()
    assert oct(secret.stat().st_mode & 0o777) != oct(0o777)
    link = await vol.get_info("/link", **va)
    assert link.type == VolumeFileType.SYMLINK and link.target == str(secret)
    await vol.write_file("/link", "over", **va)  # replaces the link itself, not its target
    assert secret.read_text() == "host secret" and (root / "link").read_text() == "over"
    await vol.remove("/dirlink", **va)  # the link, not what it names
    assert tmp_path.is_dir() and secret.read_text() == "host secret"
    # setuid is not kept
    e = await vol.write_file("/s", "x", mode=0o4755, **va)
    assert e.mode == 0o755


async def test_tenants_and_tokens(env) -> None:
    opts, vols, url = env
    vol = await AsyncVolume.create("data", **opts["a"])
    theirs = await AsyncVolume.create("data", **opts["b"])
    va = {"api_url": url}
    await vol.write_file("/f", "mine", **va)

    # a's volume with b's token, b's key, or a made-up token: refused, nothing leaks
    stolen = AsyncVolume(vol.volume_id, "data", token=theirs.token)
    with pytest.raises(AuthenticationException):
        await stolen.read_file("/f", **va)
    with pytest.raises(AuthenticationException):
        await AsyncVolume(vol.volume_id, "data", token="0" * 40).list("/", **va)
    as_b = AsyncVolume(vol.volume_id, "data", token=opts["b"]["api_key"])
    missing = AsyncVolume("vol-000000000000", "data", token=opts["b"]["api_key"])
    with pytest.raises(NotFoundException) as got:
        await as_b.read_file("/f", **va)
    with pytest.raises(NotFoundException) as none:
        await missing.read_file("/f", **va)
    assert str(got.value).replace(vol.volume_id, "<id>") == \
        str(none.value).replace("vol-000000000000", "<id>")  # as a missing volume

    # a's key works as the token too (for a's volumes)
    as_a = AsyncVolume(vol.volume_id, "data", token=opts["a"]["api_key"])
    assert await as_a.read_file("/f", **va) == "mine"
    # the token of a volume reaches that volume only, even of the same tenant
    other = await AsyncVolume.create("other", **opts["a"])
    with pytest.raises(AuthenticationException):
        await AsyncVolume(other.volume_id, "other", token=vol.token).list("/", **va)
    # connect gives the same token
    again = await AsyncVolume.connect(vol.volume_id, **opts["a"])
    assert again.token == vol.token and await again.read_file("/f", **va) == "mine"
    # a deleted volume's files are gone: its token finds nothing
    assert await AsyncVolume.destroy(vol.volume_id, **opts["a"])
    with pytest.raises(NotFoundException):
        await vol.read_file("/f", **va)


async def test_raw_answers(env) -> None:
    opts, vols, url = env
    vol = await AsyncVolume.create("data", **opts["a"])
    auth = {"Authorization": f"Bearer {vol.token}"}
    async with httpx.AsyncClient(base_url=f"{url}/volumecontent/{vol.volume_id}",
                                 headers=auth) as c:
        r = await c.get("/dir")  # no path
        assert r.status_code == 400 and set(r.json()) == {"code", "message"}
        r = await c.get("/dir", params={"path": "/", "depth": 0})
        assert r.status_code == 400 and "depth" in r.json()["message"]
        r = await c.patch("/path", params={"path": "/"}, json={"mode": "x"})
        assert r.status_code == 400
        r = await c.get("/dir", params={"path": "/"}, headers={"Authorization": ""})
        assert r.status_code == 401 and "token" in r.json()["message"]
        r = await c.post("/file", params={"path": "/x"})
        assert r.status_code == 405 and "GET or PUT" in r.json()["message"]
        r = await c.get("/other", params={"path": "/x"})
        assert r.status_code == 501 and "/file" in r.json()["message"]
        r = await c.put("/file", params={"path": "/x"}, content=b"abc")
        assert r.status_code == 201 and r.json()["size"] == 3
        r = await c.get("/file", params={"path": "/x"})
        assert r.status_code == 200 and r.content == b"abc"


async def test_another_hosts_volume_is_forwarded_there(tmp_path, monkeypatch) -> None:
    """In a deployment, a content call reaching a host that does not hold the volume is
    relayed to the one that does; if that host is gone, a clear 409 names it."""
    async with in_process(tmp_path) as srv:
        core = srv.core
        monkeypatch.setattr(Hosts, "shared", property(lambda self: True))
        live = {"p1": "http://p1"}

        async def url_of(host_id: str) -> str | None:
            return live.get(host_id)

        monkeypatch.setattr(core.hosts, "url_of", url_of)
        relayed = []

        async def relay(scope, receive, send, url, body=None, fallback=None) -> None:
            relayed.append((url, scope["path"], scope["method"]))
            data = json.dumps({"answered by": url}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})

        monkeypatch.setattr(srv.app.state.peers, "relay", relay)
        for vid, host in (("vol-0000000000a1", "p1"), ("vol-0000000000a2", "p9")):
            info = VolumeInfo(volume_id=vid, name=vid, owner="test", host=host,
                              created_at=now())
            await core.db.add_volume(vid, scoped_name("test", vid) or "", host,
                                     info.model_dump(mode="json"), time.time())
        async with httpx.AsyncClient(transport=srv.async_transport(),
                                     base_url=f"{srv.url}/e2b/volumecontent",
                                     headers={"authorization": f"Bearer {srv.key}"}) as c:
            r = await c.put("/vol-0000000000a1/file", params={"path": "/x"}, content=b"x")
            assert r.json() == {"answered by": "http://p1"}
            assert relayed == [("http://p1", "/e2b/volumecontent/vol-0000000000a1/file",
                                "PUT")]
            r = await c.get("/vol-0000000000a2/dir", params={"path": "/"})
            assert r.status_code == 409 and "host p9" in r.json()["message"]



async def test_a_cut_upload_puts_nothing_in_place(tmp_path) -> None:
    """An upload whose body fails (its client went away) leaves the old file, and no part of
    the new one, in the volume."""
    runtime = FakeRuntime()
    runtime.volumes = VolumeServer(tmp_path / "vols", b"k" * 32)
    async with in_process(tmp_path, runtime=runtime) as srv:
        who = await srv.core.authenticate(srv.key)
        vol = await srv.core.volumes.create("data", who)
        content = srv.core.volumes.content

        async def body(parts: list[bytes], fail: bool):
            for p in parts:
                yield p
            if fail:
                raise ConnectionError("gone")

        await content.write(vol.volume_id, "/f", body([b"old"], False), None, who)
        with pytest.raises(ConnectionError):
            await content.write(vol.volume_id, "/f", body([b"new", b"x" * (2 << 20)], True),
                                None, who)
        assert os.listdir(tmp_path / "vols" / vol.volume_id) == ["f"]
        size, chunks = await content.read(vol.volume_id, "/f", who)
        assert size == 3 and b"".join([c async for c in chunks]) == b"old"
