"""The unmodified `e2b` SDK's async classes against a real sandlot server and real VMs: a
representative subset of what test_e2b_sync.py covers for the sync classes."""

from __future__ import annotations

import asyncio

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType


@pytest.fixture(autouse=True)
def e2b_env(server, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", f"{server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.key)


async def test_commands_and_files():
    sbx = await AsyncSandbox.create(envs={"WHO": "async"}, metadata={"suite": "e2b-async"},
                                    timeout=600)
    try:
        info = await sbx.get_info()
        assert info.metadata == {"suite": "e2b-async"} and info.state == SandboxState.RUNNING
        assert await sbx.is_running()
        listed = await AsyncSandbox.list(
            query=SandboxQuery(metadata={"suite": "e2b-async"})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]

        out = []
        r = await sbx.commands.run("echo hi $WHO; pwd", on_stdout=out.append,
                                   envs={"X": "1"})
        assert r.stdout == "hi async\n/home/user\n" and "".join(out) == r.stdout
        assert (await sbx.commands.run("whoami", user="root", cwd="/")).stdout == "root\n"
        with pytest.raises(CommandExitException) as ei:
            await sbx.commands.run("echo no >&2; exit 7")
        assert ei.value.exit_code == 7 and ei.value.stderr == "no\n"

        seen = []
        h = await sbx.commands.run("read line; echo got $line; sleep 300", background=True,
                                   stdin=True, on_stdout=seen.append)
        await sbx.commands.send_stdin(h.pid, "ping\n")
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.1)
        assert seen == ["got ping\n"] and h.stdout == "got ping\n"
        assert h.pid in [p.pid for p in await sbx.commands.list()]
        assert await sbx.commands.kill(h.pid)
        with pytest.raises(CommandExitException) as ei:
            await h.wait()
        assert ei.value.stdout == "got ping\n"

        await sbx.files.write_files([WriteEntry(path="a/one.txt", data="1"),
                                     WriteEntry(path="/tmp/two.bin", data=b"\x02")])
        assert await sbx.files.read("a/one.txt") == "1"
        assert await sbx.files.read("/tmp/two.bin", format="bytes") == b"\x02"
        assert [e.name for e in await sbx.files.list("a")] == ["one.txt"]
        assert await sbx.files.exists("a/one.txt")
        await sbx.files.rename("a/one.txt", "a/uno.txt")
        assert (await sbx.files.get_info("a/uno.txt")).size == 1
        await sbx.files.remove("a")
        with pytest.raises(FileNotFoundException):
            await sbx.files.read("a/uno.txt")

        events = []
        await sbx.files.make_dir("w")
        watch = await sbx.files.watch_dir("w", on_event=events.append)
        await sbx.files.write("w/new.txt", "x")
        for _ in range(50):
            if len(events) >= 2:
                break
            await asyncio.sleep(0.1)
        await watch.stop()
        # created, then written: two events, as envd reports them on inotify
        assert [(e.name, e.type) for e in events] == [("new.txt", FilesystemEventType.CREATE),
                                                      ("new.txt", FilesystemEventType.WRITE)]
    finally:
        await sbx.kill()
    assert not await sbx.is_running()
    with pytest.raises(SandboxNotRunningException):
        await sbx.commands.run("true")


async def test_filesystem_only_pause_boots_on_connect():
    sbx = await AsyncSandbox.create(timeout=600)
    try:
        await sbx.files.write("/root/state.txt", "on disk")
        bg = await sbx.commands.run("sleep 600", background=True)
        assert await sbx.pause(mode="filesystem")
        resumed = await AsyncSandbox.connect(sbx.sandbox_id, timeout=600)
        assert await resumed.files.read("/root/state.txt") == "on disk"
        assert bg.pid not in {p.pid for p in await resumed.commands.list()}
    finally:
        await sbx.kill()


async def test_pause_snapshot_fork():
    sbx = await AsyncSandbox.create(timeout=600)
    made = [sbx]
    try:
        await sbx.files.write("state.txt", "v1")
        assert await sbx.pause()
        assert (await sbx.get_info()).state == SandboxState.PAUSED
        resumed = await AsyncSandbox.connect(sbx.sandbox_id)
        assert resumed.sandbox_id == sbx.sandbox_id
        assert await resumed.files.read("state.txt") == "v1"

        snap = await resumed.create_snapshot()
        await resumed.files.write("state.txt", "v2")
        ids = [s.snapshot_id for s in await AsyncSandbox.list_snapshots().next_items()]
        assert snap.snapshot_id in ids
        restored = await AsyncSandbox.create(snap.snapshot_id, timeout=600)
        made.append(restored)
        assert await restored.files.read("state.txt") == "v1"

        forks = await resumed.fork(count=1)
        made += [f for f in forks if isinstance(f, AsyncSandbox)]
        assert await forks[0].files.read("state.txt") == "v2"
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id)
    finally:
        for box in made:
            await box.kill()


async def test_pty():
    from e2b import PtySize

    sbx = await AsyncSandbox.create(metadata={"suite": "e2b-async-pty"}, timeout=600)
    try:
        drawn = bytearray()
        term = await sbx.pty.create(PtySize(rows=20, cols=70), on_data=drawn.extend)
        for _ in range(600):  # the prompt: a shell starting up drops what was typed ahead
            if drawn.rstrip().endswith((b"$", b"#")):
                break
            await asyncio.sleep(0.1)
        await sbx.pty.send_stdin(term.pid, b"stty size; echo $((3*4))z; exit 0\r")
        result = await term.wait()
        assert result.exit_code == 0
        text = drawn.decode(errors="replace")
        assert "20 70" in text and "12z" in text
    finally:
        await sbx.kill()
