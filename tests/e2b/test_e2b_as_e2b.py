"""Behaviour E2B clients rely on, as E2B has it, through the unmodified `e2b` SDK (sync and
async classes) against a real sandlot server and real VMs: listing order and pagination,
removing a missing path, symlink entries as envd gives them, recursive watches, a command
stream cut by a kill, snapshot names, overlapping egress rules, the default pause, the envd
version the SDKs gate on, and what the default template holds."""

from __future__ import annotations

import asyncio
import io
import secrets
import threading
import time
import zipfile

import pytest
from e2b import (
    AsyncSandbox,
    FileType,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
)
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

from harness import eventually, own_internet
from sandlot.testing import unused_subnet

WEB = unused_subnet()  # this run's own "internet" (a benchmarking range: no host route)
WEB_A, WEB_B = str(WEB[2]), str(WEB[3])


@pytest.fixture(autouse=True)
def e2b_env(server, monkeypatch):
    """The SDK pointed at the server, for each test (the environment is as it was after)."""
    monkeypatch.setenv("E2B_API_URL", f"{server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.key)


@pytest.fixture(scope="module")
def sbx(server):
    """One sandbox for the module (its options given: it outlives each test's environment;
    the SDK keeps them for its calls)."""
    box = Sandbox.create("base", timeout=600, api_url=f"{server.url}/e2b",
                         sandbox_url=f"{server.url}/e2b/envd", api_key=server.key)
    yield box
    box.kill()


def _all_pages(query: SandboxQuery, order: str | None = None) -> list[str]:
    """Every page of one item: the ids in the order the pagination walks them."""
    pages = Sandbox.list(query=query, limit=1, order=order)
    seen = []
    while pages.has_next:
        items = pages.next_items()
        assert len(items) <= 1
        seen += [s.sandbox_id for s in items]
    return seen


def test_listing_newest_first_across_states_and_pages():
    tag = {"suite": f"e2b-order-{time.monotonic_ns()}"}
    boxes = []
    try:
        for _ in range(3):
            boxes.append(Sandbox.create("base", metadata=tag, timeout=600))
            time.sleep(0.05)  # distinct start times
        oldest, middle, newest = (b.sandbox_id for b in boxes)
        assert boxes[1].pause() is True

        listed = Sandbox.list(query=SandboxQuery(metadata=tag)).next_items()
        assert [s.sandbox_id for s in listed] == [newest, middle, oldest]
        both = SandboxQuery(metadata=tag, state=[SandboxState.RUNNING, SandboxState.PAUSED])
        assert _all_pages(both) == [newest, middle, oldest]
        assert _all_pages(SandboxQuery(metadata=tag, state=[SandboxState.RUNNING])) == [
            newest, oldest]
        assert _all_pages(SandboxQuery(metadata=tag, state=[SandboxState.PAUSED])) == [middle]
        assert _all_pages(SandboxQuery(metadata=tag), order="asc") == [oldest, middle, newest]
    finally:
        for b in boxes:
            b.kill()


def test_removing_a_missing_path_succeeds(sbx):
    sbx.files.remove("never/was/here")
    sbx.files.write("gone.txt", "x")
    sbx.files.remove("gone.txt")
    sbx.files.remove("gone.txt")  # twice: still a success, as envd's RemoveAll
    assert not sbx.files.exists("gone.txt")


def test_symlink_entries_as_envd_gives_them(sbx):
    sbx.commands.run("mkdir -p ln/dir && echo hello > ln/target.txt && chmod 600 ln/target.txt"
                     " && cd ln && ln -s target.txt rel && ln -s /home/user/ln/dir absdir"
                     " && ln -s rel chain && ln -s nowhere broken")
    rel = sbx.files.get_info("ln/rel")
    assert rel.type == FileType.FILE and rel.symlink_target == "/home/user/ln/target.txt"
    assert rel.mode == 0o600 and rel.permissions.startswith("L")
    absdir = sbx.files.get_info("ln/absdir")
    assert absdir.type == FileType.DIR and absdir.symlink_target == "/home/user/ln/dir"
    chain = sbx.files.get_info("ln/chain")
    assert chain.type == FileType.FILE and chain.symlink_target == "/home/user/ln/target.txt"
    broken = sbx.files.get_info("ln/broken")
    assert broken.type is None and broken.symlink_target == "/home/user/ln/broken"
    listed = {e.name: (e.type, e.symlink_target) for e in sbx.files.list("ln")}
    assert listed["rel"] == (FileType.FILE, "/home/user/ln/target.txt")
    assert listed["absdir"] == (FileType.DIR, "/home/user/ln/dir")
    assert listed["target.txt"] == (FileType.FILE, None)


def test_recursive_watch_sees_new_folders_and_create_then_write(sbx):
    sbx.files.make_dir("rw")
    w = sbx.files.watch_dir("rw", recursive=True)
    sbx.files.make_dir("rw/later/deeper")
    time.sleep(0.5)
    sbx.files.write("rw/later/deeper/f.txt", "content")
    events: list[tuple[str, FilesystemEventType]] = []

    def seen() -> bool:
        events.extend((e.name, e.type) for e in w.get_new_events())
        return ("later/deeper/f.txt", FilesystemEventType.WRITE) in events

    eventually(seen)
    assert ("later", FilesystemEventType.CREATE) in events
    assert ("later/deeper", FilesystemEventType.CREATE) in events
    created = events.index(("later/deeper/f.txt", FilesystemEventType.CREATE))
    assert events.index(("later/deeper/f.txt", FilesystemEventType.WRITE)) > created
    w.stop()
    # envd 0.6.4's option: sandboxes have no network mounts, so it changes nothing
    sbx.files.watch_dir("rw", allow_network_mounts=True).stop()


def test_command_stream_of_a_killed_sandbox_says_it_was_killed():
    box = Sandbox.create("base", timeout=600)
    h = box.commands.run("sleep 600", background=True)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            h.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(1)
    assert Sandbox.kill(box.sandbox_id) is True
    waiter.join(60)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SandboxNotRunningException), errors


def test_snapshot_names_starting_with_snap_and_their_filters(sbx):
    snap = sbx.create_snapshot(name="snap-daily:v1")
    other = sbx.create_snapshot(name="team/snap-daily:v2")
    try:
        assert snap.names == ["snap-daily:v1"] and snap.snapshot_id.startswith("snap-")
        assert snap.snapshot_id != "snap-daily"

        def ids(name: str) -> set[str]:
            return {s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()}

        assert ids("snap-daily") == {snap.snapshot_id, other.snapshot_id}
        assert ids("snap-daily:v2") == {other.snapshot_id}
        assert ids("my-team/snap-daily:v1") == {snap.snapshot_id}
        assert ids(snap.snapshot_id) == {snap.snapshot_id}
        restored = Sandbox.create("snap-daily:v1", timeout=300)
        restored.kill()
        newest_first = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
        assert newest_first.index(other.snapshot_id) < newest_first.index(snap.snapshot_id)
        with pytest.raises(SandboxException):  # the shape of an id stays an id's
            sbx.create_snapshot(name="snap-0123456789")
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)
        Sandbox.delete_snapshot(other.snapshot_id)


@pytest.fixture
def two_sites(tmp_path):
    """Two web servers, WEB_A and WEB_B, in a namespace of this test's, routed from the host:
    nothing here leaves the machine."""
    sfx = secrets.token_hex(3)
    with own_internet(tmp_path, f"slt-e2bw-{sfx}", f"slte2b{sfx}", WEB):
        yield


def test_allow_out_wins_over_an_overlapping_deny_out(two_sites):
    box = Sandbox.create("base", timeout=600, network={
        "deny_out": ["0.0.0.0/0"], "allow_out": [f"{WEB_A}/32"]})
    try:
        def fetch(addr: str) -> str:
            return box.commands.run(f"curl -s -m 5 http://{addr}/ || echo blocked").stdout

        assert fetch(WEB_A) == "site-A\n"
        assert fetch(WEB_B) == "blocked\n"
        box.update_network({"allow_out": [WEB_A, WEB_B], "deny_out": [f"{WEB_B}/32"]})
        assert fetch(WEB_B) == "site-B\n"  # the very address in both: allowed
    finally:
        box.kill()


def test_pause_without_keep_memory_is_a_full_pause():
    box = Sandbox.create("base", timeout=600)
    try:
        h = box.commands.run("sleep 600", background=True)
        box.files.write("/tmp/in-memory.txt", "tmpfs")
        assert box.pause() is True
        assert not box.is_running()
        assert Sandbox.get_info(box.sandbox_id).state == SandboxState.PAUSED
        back = Sandbox.connect(box.sandbox_id, timeout=600)
        assert h.pid in {p.pid for p in back.commands.list()}
    finally:
        box.kill()


def test_envd_version_lets_the_sdk_use_what_sandlot_serves(sbx):
    assert sbx.get_info().envd_version == "0.6.4"
    sbx.files.write("meta.txt", "m", metadata={"k": "v"})
    assert sbx.files.get_info("meta.txt").metadata == {"k": "v"}


def _wheel() -> bytes:
    """A minimal pure-Python wheel (no index needed to install it)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("e2bprobe/__init__.py", "VALUE = 42\n")
        info = "e2bprobe-1.0.dist-info/"
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: e2bprobe\nVersion: 1.0\n")
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                   "Tag: py3-none-any\n")
        z.writestr(info + "RECORD", "")
    return buf.getvalue()


def test_default_template_has_what_an_agent_expects(sbx):
    r = sbx.commands.run("python --version && pip --version && git --version && node --version"
                         " && npm --version && gcc --version && make --version && jq --version"
                         " && unzip -v && wget --version && zip -v", timeout=300)
    assert r.stdout.startswith("Python 3"), r.stdout
    sbx.files.write("/tmp/e2bprobe-1.0-py3-none-any.whl", _wheel())
    sbx.commands.run("pip install --user /tmp/e2bprobe-1.0-py3-none-any.whl", timeout=300)
    assert sbx.commands.run("python -c 'import e2bprobe; print(e2bprobe.VALUE)'").stdout == "42\n"
    sbx.commands.run("sudo pip install /tmp/e2bprobe-1.0-py3-none-any.whl", timeout=300)
    sbx.commands.run("echo 'int main(){return 7;}' > /tmp/m.c && gcc -o /tmp/m /tmp/m.c",
                     timeout=300)
    assert sbx.commands.run("/tmp/m; echo $?").stdout == "7\n"


async def test_async_sdk_sees_the_same():
    box = await AsyncSandbox.create("base", metadata={"suite": "e2b-as-e2b-async"}, timeout=600)
    try:
        assert (await box.get_info()).envd_version == "0.6.4"
        await box.files.remove("not/there")
        await box.commands.run("mkdir -p /tmp/al && ln -s /etc /tmp/al/etc")
        etc = await box.files.get_info("/tmp/al/etc")
        assert etc.type == FileType.DIR and etc.symlink_target == "/etc"

        events: list = []
        w = await box.files.watch_dir("/tmp/al", on_event=events.append, recursive=True)
        await box.files.make_dir("/tmp/al/new/sub")
        await asyncio.sleep(0.5)
        await box.files.write("/tmp/al/new/sub/x.txt", "x")
        for _ in range(100):
            if ("new/sub/x.txt", FilesystemEventType.WRITE) in {(e.name, e.type) for e in events}:
                break
            await asyncio.sleep(0.1)
        kinds = [(e.name, e.type) for e in events]
        assert ("new", FilesystemEventType.CREATE) in kinds
        assert ("new/sub/x.txt", FilesystemEventType.CREATE) in kinds
        assert ("new/sub/x.txt", FilesystemEventType.WRITE) in kinds
        await w.stop()

        h = await box.commands.run("sleep 600", background=True)
        assert await box.pause() is True
        assert not await box.is_running()
        with pytest.raises(SandboxNotRunningException):
            await h.wait()
        back = await AsyncSandbox.connect(box.sandbox_id, timeout=600)
        assert h.pid in {p.pid for p in await back.commands.list()}

        h = await back.commands.run("sleep 600", background=True)
        waiting = asyncio.create_task(h.wait())
        await asyncio.sleep(1)
        assert await AsyncSandbox.kill(box.sandbox_id) is True
        with pytest.raises(SandboxNotRunningException):
            await asyncio.wait_for(waiting, 60)
    finally:
        await AsyncSandbox.kill(box.sandbox_id)
