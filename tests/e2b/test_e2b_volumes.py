"""E2B volumes through the unmodified `e2b` SDK against a real server and real VMs: a volume
mounted in sandboxes (`volume_mounts`) is one directory on the host, shared by them, and the
mount lives through what sandlot is for: a pause with memory and its resume, a snapshot and
a sandbox restored from it, a fork (docs/design.md, "Volumes"). Volumes are a tenant's: another
key neither sees nor mounts them. Bad input is a clear 4xx."""

from __future__ import annotations

import secrets

import pytest
from e2b import (
    CommandExitException,
    NotFoundException,
    Sandbox,
    SandboxException,
    Volume,
)
from e2b.exceptions import VolumeException

from harness import tenant_key

MNT = "/mnt/data"



def opts(server, key: str) -> dict:
    return {"api_url": f"{server.url}/e2b", "sandbox_url": f"{server.url}/e2b/envd",
            "api_key": key}


@pytest.fixture(scope="module")
def keys(server) -> dict:
    return {"a": opts(server, tenant_key(server, "vol-a")),
            "b": opts(server, tenant_key(server, "vol-b"))}


@pytest.fixture(scope="module")
def vol(keys):
    v = Volume.create("data-" + secrets.token_hex(3), **keys["a"])
    yield v
    Volume.destroy(v.volume_id, **keys["a"])


def on_host(server, vol, name: str) -> str:
    return (server.data_dir / "volumes" / vol.volume_id / name).read_text()


def sh(box: Sandbox, cmd: str) -> str:
    return box.commands.run(cmd, timeout=120).stdout


def test_volume_records_and_tenancy(keys, vol):
    a, b = keys["a"], keys["b"]
    assert vol.volume_id.startswith("vol-") and vol.token
    assert (vol.volume_id, vol.name) in {(v.volume_id, v.name) for v in Volume.list(**a)}
    again = Volume.connect(vol.volume_id, **a)
    assert (again.volume_id, again.name) == (vol.volume_id, vol.name)
    assert Volume.get_info(vol.name, **a).volume_id == vol.volume_id  # by name too

    with pytest.raises(VolumeException, match="exists already"):
        Volume.create(vol.name, **a)
    for bad in ("", "has space", "-dash-first", "x" * 64, "../up"):
        with pytest.raises(VolumeException, match="400"):
            Volume.create(bad, **a)

    # another tenant: not listed, not found, not deleted, not mounted (and no VM started)
    assert vol.volume_id not in {v.volume_id for v in Volume.list(**b)}
    with pytest.raises(NotFoundException):
        Volume.get_info(vol.volume_id, **b)
    assert Volume.destroy(vol.volume_id, **b) is False
    with pytest.raises(SandboxException, match="404: volume .* not found"):
        Sandbox.create(volume_mounts={MNT: vol.name}, **b)
    # the same name is free in another tenant
    theirs = Volume.create(vol.name, **b)
    assert theirs.volume_id != vol.volume_id
    assert Volume.destroy(theirs.volume_id, **b) is True

    with pytest.raises(SandboxException, match="404: volume 'no-such-volume' not found"):
        Sandbox.create(volume_mounts={MNT: "no-such-volume"}, **a)
    for path in ("relative", "/", "/mnt/../etc", "/proc/x", "/usr"):
        with pytest.raises(SandboxException, match="400: .*(path|system path)"):
            Sandbox.create(volume_mounts={path: vol}, **a)


def test_mounted_volume_survives_pause_snapshot_restore_and_fork(server, keys, vol):
    a = keys["a"]
    made: list[Sandbox] = []
    try:
        one = Sandbox.create(volume_mounts={MNT: vol}, timeout=600, **a)
        made.append(one)
        sh(one, f"echo first > {MNT}/one.txt && mkdir -p {MNT}/sub")
        assert sh(one, f"stat -c %U {MNT}/one.txt").strip() == "user"  # the sandbox's user
        assert on_host(server, vol, "one.txt") == "first\n"
        # the SDK's file calls (the agent's own file operations) work in the volume too
        one.files.write(f"{MNT}/sub/sdk.txt", "through files.write")
        assert one.files.read(f"{MNT}/sub/sdk.txt") == "through files.write"
        assert on_host(server, vol, "sub/sdk.txt") == "through files.write"
        assert {e.name for e in one.files.list(f"{MNT}/sub")} == {"sdk.txt"}
        one.files.remove(f"{MNT}/sub/sdk.txt")

        two = Sandbox.create(volume_mounts={"/home/user/shared": vol.name}, timeout=600, **a)
        made.append(two)
        assert sh(two, "cat /home/user/shared/one.txt") == "first\n"
        sh(two, "echo second > /home/user/shared/sub/two.txt")
        assert sh(one, f"cat {MNT}/sub/two.txt") == "second\n"

        # paused with its memory, resumed: the mount is the guest's, and still served
        bg = one.commands.run(f"sleep 1; cat {MNT}/one.txt; sleep 600", background=True)
        assert one.pause() is True
        one = Sandbox.connect(one.sandbox_id, timeout=600, **a)
        assert bg.pid in {p.pid for p in one.commands.list()}
        sh(one, f"echo resumed > {MNT}/resumed.txt")
        assert on_host(server, vol, "resumed.txt") == "resumed\n"
        assert sh(two, "cat /home/user/shared/resumed.txt") == "resumed\n"

        # a snapshot, a sandbox restored from it, and a fork: each writes into the volume
        snap = one.create_snapshot()
        restored = Sandbox.create(snap.snapshot_id, timeout=600, **a)
        made.append(restored)
        sh(restored, f"echo restored > {MNT}/restored.txt")
        forks = one.fork(count=1)
        made += [f for f in forks if isinstance(f, Sandbox)]
        assert all(isinstance(f, Sandbox) for f in forks), forks
        sh(forks[0], f"echo forked > {MNT}/forked.txt && rm {MNT}/one.txt")
        assert on_host(server, vol, "restored.txt") == "restored\n"
        assert on_host(server, vol, "forked.txt") == "forked\n"
        listing = sh(two, "ls /home/user/shared").split()
        assert listing == ["forked.txt", "restored.txt", "resumed.txt", "sub"]
        assert sh(one, f"ls {MNT}").split() == listing

        # a deleted volume: its mounts stay, their operations fail
        gone = Volume.create("short-" + secrets.token_hex(3), **a)
        three = Sandbox.create(volume_mounts={"/data": gone}, timeout=600, **a)
        made.append(three)
        sh(three, "echo x > /data/x")
        assert Volume.destroy(gone.volume_id, **a) is True
        with pytest.raises(CommandExitException):
            three.commands.run("cat /data/x", timeout=60)
    finally:
        for box in made:
            box.kill()


def test_content_api_and_a_mounted_sandbox_see_the_same_files(server, keys):
    """The volume content API (`vol.write_file`, `read_file`, `list`, ...; E2B_VOLUME_API_URL
    or `api_url=` points it at sandlot) and a sandbox that mounts the volume share its files:
    each reads what the other wrote."""
    a = keys["a"]
    va = {"api_url": a["api_url"]}  # what E2B_VOLUME_API_URL sets
    vol = Volume.create("content-" + secrets.token_hex(3), **a)
    try:
        vol.write_file("/from-api/hello.txt", "written by the API\n", **va)
        vol.write_file("/blob.bin", bytes(range(256)) * 1024, **va)
        box = Sandbox.create(volume_mounts={MNT: vol}, timeout=600, **a)
        try:
            assert sh(box, f"cat {MNT}/from-api/hello.txt") == "written by the API\n"
            assert sh(box, f"stat -c %s {MNT}/blob.bin").strip() == str(256 * 1024)
            sh(box, f"mkdir -p {MNT}/from-box && echo made in the sandbox > "
                    f"{MNT}/from-box/note.txt && rm {MNT}/from-api/hello.txt")
            assert vol.read_file("/from-box/note.txt", **va) == "made in the sandbox\n"
            assert {e.path for e in vol.list("/", depth=2, **va)} == {
                "/from-api", "/from-box", "/from-box/note.txt", "/blob.bin"}
            assert not vol.exists("/from-api/hello.txt", **va)
            vol.remove("/from-box", **va)
            assert sh(box, f"ls {MNT}") == "blob.bin\nfrom-api\n"
        finally:
            box.kill()
        # another tenant's key, as the token: not found, as a missing volume
        with pytest.raises(NotFoundException):
            Volume(vol.volume_id, vol.name, token=keys["b"]["api_key"]).read_file(
                "/blob.bin", **va)
    finally:
        Volume.destroy(vol.volume_id, **a)
