"""The unmodified `e2b` SDK (sync classes, version pinned in pyproject.toml) against a real
sandlot server and real VMs: E2B_API_URL and E2B_SANDBOX_URL point at the server's /e2b."""

from __future__ import annotations

import io
import json
import shutil
import threading
import time

import httpx
import pytest
from e2b import (
    CommandExitException,
    FileNotFoundException,
    FileType,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType

import harness as conftest  # tests/conftest.py is not importable by name (tests/unit has one)
from harness import eventually


def e2b_opts(server) -> dict:
    return {"api_url": f"{server.url}/e2b", "sandbox_url": f"{server.url}/e2b/envd",
            "api_key": server.key}


@pytest.fixture(autouse=True)
def e2b_env(server, monkeypatch):
    """What an E2B user sets to use sandlot instead of E2B's cloud (for each test: the
    environment is as it was after it)."""
    for name, value in e2b_opts(server).items():
        monkeypatch.setenv(f"E2B_{name.upper()}", value)


@pytest.fixture(scope="module")
def sbx(server):
    """One sandbox for the module (its options given: it outlives each test's environment;
    the SDK keeps them for its calls)."""
    box = Sandbox.create("base", envs={"GREETING": "hello from create"},
                         metadata={"suite": "e2b-sync", "owner": "tests"}, timeout=600,
                         **e2b_opts(server))
    yield box
    box.kill()


def test_info_list_connect_timeout(sbx):
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.template_id == "base" and info.name == "base"
    assert info.metadata == {"suite": "e2b-sync", "owner": "tests"}
    assert info.state == SandboxState.RUNNING
    assert info.envd_version == "0.6.4" and info.cpu_count >= 1 and info.memory_mb >= 128
    assert sbx.is_running()

    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b-sync"})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
    assert listed[0].state == SandboxState.RUNNING
    assert Sandbox.list(query=SandboxQuery(metadata={"suite": "nope"})).next_items() == []
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in paused]

    sbx.set_timeout(120)
    left = (sbx.get_info().end_at - info.started_at).total_seconds()
    assert left < 600, "set_timeout must move end_at"
    sbx.set_timeout(600)

    again = Sandbox.connect(sbx.sandbox_id)
    assert again.sandbox_id == sbx.sandbox_id
    assert again.commands.run("echo $GREETING").stdout == "hello from create\n"


def test_run_streams_envs_cwd_user(sbx):
    out, err = [], []
    r = sbx.commands.run("echo $GREETING; echo $EXTRA; echo oops >&2; pwd; whoami",
                         envs={"EXTRA": "per-command"}, on_stdout=out.append,
                         on_stderr=err.append)
    assert r.exit_code == 0
    assert r.stdout == "hello from create\nper-command\n/home/user\nuser\n"
    assert "".join(out) == r.stdout and "".join(err) == r.stderr == "oops\n"

    r = sbx.commands.run("pwd; whoami", cwd="/tmp", user="root")
    assert r.stdout == "/tmp\nroot\n"
    sbx.commands.run("mkdir -p work")
    assert sbx.commands.run("pwd", cwd="work").stdout == "/home/user/work\n"


def test_exit_codes_and_timeout(sbx):
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo partial; echo bad >&2; exit 3")
    assert ei.value.exit_code == 3
    assert ei.value.stdout == "partial\n" and ei.value.stderr == "bad\n"

    t = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo never", timeout=1)
    # ended, not left to hang: the host's deadline is timeout + grace (1 + 5 s); 30 s is 5x
    assert time.monotonic() - t < 30
    # the server killed it at its deadline, as envd does
    eventually(lambda: not [p for p in sbx.commands.list() if "sleep 30" in " ".join(p.args)])


def test_background_list_kill_stdin(sbx):
    h = sbx.commands.run("sleep 1; echo done", background=True)
    assert h.wait().stdout == "done\n"

    h = sbx.commands.run("sleep 300", background=True)
    procs = {p.pid: p for p in sbx.commands.list()}
    assert h.pid in procs
    assert procs[h.pid].cmd == "/bin/bash" and procs[h.pid].args == ["-l", "-c", "sleep 300"]
    assert h.kill()
    with pytest.raises(CommandExitException):
        h.wait()
    assert sbx.commands.kill(h.pid) is False

    h2 = sbx.commands.run("sleep 300", background=True)
    assert sbx.commands.kill(h2.pid) is True
    eventually(lambda: h2.pid not in [p.pid for p in sbx.commands.list()])

    h3 = sbx.commands.run("read a; read b; echo got $a $b", background=True, stdin=True)
    sbx.commands.send_stdin(h3.pid, "one\n")
    h3.send_stdin(b"two\n")
    assert h3.wait().stdout == "got one two\n"

    h4 = sbx.commands.run("wc -c", background=True, stdin=True)
    sbx.commands.send_stdin(h4.pid, "12345")
    sbx.commands.close_stdin(h4.pid)
    assert h4.wait().stdout.strip() == "5"
    assert sbx.commands.run("cat").stdout == ""  # no stdin asked for: it is closed


def test_files_write_read(sbx):
    info = sbx.files.write("notes/hello.txt", "hello e2b")
    assert info.path == "/home/user/notes/hello.txt" and info.type == FileType.FILE
    assert sbx.files.read("notes/hello.txt") == "hello e2b"
    assert sbx.files.read("/home/user/notes/hello.txt") == "hello e2b"
    assert sbx.files.read("~/notes/hello.txt") == "hello e2b"

    blob = bytes(range(256)) * 1000
    sbx.files.write("/tmp/blob.bin", blob)
    assert sbx.files.read("/tmp/blob.bin", format="bytes") == blob
    assert b"".join(sbx.files.read("/tmp/blob.bin", format="stream")) == blob

    infos = sbx.files.write_files([  # one multipart request
        WriteEntry(path="multi/a.txt", data="A"),
        WriteEntry(path="/tmp/multi-b.bin", data=b"\r\n--\x00B\xff"),
        WriteEntry(path="multi/c.bin", data=blob),
    ])
    assert [i.path for i in infos] == ["/home/user/multi/a.txt", "/tmp/multi-b.bin",
                                       "/home/user/multi/c.bin"]
    assert sbx.files.read("multi/a.txt") == "A"
    assert sbx.files.read("/tmp/multi-b.bin", format="bytes") == b"\r\n--\x00B\xff"
    assert sbx.files.read("multi/c.bin", format="bytes") == blob
    streamed = sbx.files.write("stream.bin", io.BytesIO(b"C" * 3_000_000))  # octet-stream
    assert streamed.path == "/home/user/stream.bin"
    assert sbx.files.read("stream.bin", format="bytes") == b"C" * 3_000_000
    sbx.files.write("gz.txt", "squeezed " * 1000, gzip=True)
    assert sbx.files.read("gz.txt", gzip=True) == "squeezed " * 1000

    owners = sbx.commands.run("stat -c %U notes notes/hello.txt /tmp/blob.bin").stdout.split()
    assert owners == ["user", "user", "user"]
    sbx.files.write("/root/secret.txt", "r", user="root")
    assert sbx.commands.run("stat -c %U /root/secret.txt", user="root").stdout == "root\n"

    with pytest.raises(FileNotFoundException):
        sbx.files.read("does/not/exist")

    url = sbx.upload_url("signed/up.txt")
    assert httpx.post(url, files={"file": ("up.txt", b"via url")}).status_code == 200
    assert httpx.get(sbx.download_url("signed/up.txt")).content == b"via url"
    forged = httpx.get(url.replace("signature=v1_", "signature=v1_x"))
    assert forged.status_code == 401 and forged.json()["message"] == "invalid signature"
    expired = httpx.get(sbx.download_url("signed/up.txt", use_signature_expiration=-10))
    assert expired.status_code == 401  # envd's words, which user code matches on
    assert expired.json() == {"code": 401, "message": "signature is already expired"}


def test_files_list_stat_rename_mkdir_remove(sbx):
    sbx.files.write("tree/a.txt", "a")
    sbx.files.write("tree/sub/b.txt", "bb")
    assert sbx.files.make_dir("tree/empty") is True
    assert sbx.files.make_dir("tree/empty") is False

    top = {e.name: e for e in sbx.files.list("tree")}
    assert set(top) == {"a.txt", "sub", "empty"}
    assert top["sub"].type == FileType.DIR and top["a.txt"].type == FileType.FILE
    deep = {e.path for e in sbx.files.list("tree", depth=2)}
    assert "/home/user/tree/sub/b.txt" in deep and len(deep) == 4

    st = sbx.files.get_info("tree/sub/b.txt")
    assert (st.name, st.size, st.owner, st.path) == ("b.txt", 2, "user",
                                                      "/home/user/tree/sub/b.txt")
    assert st.permissions == "-rw-r--r--" and st.mode == 0o644
    assert sbx.files.exists("tree/a.txt") and not sbx.files.exists("tree/nope")

    moved = sbx.files.rename("tree/a.txt", "tree/moved/a2.txt")
    assert moved.path == "/home/user/tree/moved/a2.txt"
    assert not sbx.files.exists("tree/a.txt") and sbx.files.read("tree/moved/a2.txt") == "a"

    sbx.files.remove("tree/sub")
    assert not sbx.files.exists("tree/sub/b.txt")
    sbx.files.remove("tree/sub")  # not there: a success, as envd's RemoveAll
    with pytest.raises(FileNotFoundException):
        sbx.files.list("tree/sub")


def test_watch_dir(sbx):
    sbx.files.make_dir("watched")
    w = sbx.files.watch_dir("watched", recursive=True)
    sbx.files.write("watched/new.txt", "1")
    sbx.files.make_dir("watched/d")
    sbx.files.write("watched/d/inner.txt", "2")
    events = {(e.name, e.type) for e in w.get_new_events()}
    assert {("new.txt", FilesystemEventType.CREATE), ("d", FilesystemEventType.CREATE),
            ("d/inner.txt", FilesystemEventType.CREATE)} <= events
    sbx.files.remove("watched/new.txt")
    assert ("new.txt", FilesystemEventType.REMOVE) in {(e.name, e.type)
                                                       for e in w.get_new_events()}
    w.stop()

    with_entries = sbx.files.watch_dir("watched", include_entry=True)
    sbx.files.write("watched/entry.txt", "12345")
    created = [e for e in with_entries.get_new_events() if e.name == "entry.txt"]
    assert created and created[0].entry is not None
    assert created[0].entry.size == 5 and created[0].entry.type == FileType.FILE
    with_entries.stop()


def test_file_metadata_as_e2b_keeps_it(sbx):
    """files.write(metadata=...): kept as user.e2b.* xattrs, shown by get_info and list,
    keys lowercased, replaced by an overwrite, kept by a rename, visible when set in the
    guest out of band."""
    info = sbx.files.write("meta/a.txt", "a", metadata={"Owner": "alice", "stage": "raw"})
    assert info.metadata == {"owner": "alice", "stage": "raw"}
    assert sbx.files.get_info("meta/a.txt").metadata == {"owner": "alice", "stage": "raw"}
    listed = {e.name: e.metadata for e in sbx.files.list("meta")}
    assert listed == {"a.txt": {"owner": "alice", "stage": "raw"}}
    moved = sbx.files.rename("meta/a.txt", "meta/b.txt")
    assert moved.metadata == {"owner": "alice", "stage": "raw"}
    sbx.files.write("meta/b.txt", "b", metadata={"stage": "clean"})
    assert sbx.files.get_info("meta/b.txt").metadata == {"stage": "clean"}
    sbx.files.write("meta/b.txt", "c")
    assert sbx.files.get_info("meta/b.txt").metadata is None
    sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/meta/b.txt', "
                     "'user.e2b.by', b'guest')\"")
    assert sbx.files.get_info("meta/b.txt").metadata == {"by": "guest"}
    from e2b import InvalidArgumentException

    with pytest.raises(InvalidArgumentException):
        sbx.files.write("meta/c.txt", "c", metadata={"bad key": "x"})


def test_pause_and_resume_keep_state():
    box = Sandbox.create(metadata={"suite": "e2b-pause"}, timeout=600)
    box.files.write("state.txt", "before pause")
    bg = box.commands.run("sleep 600", background=True)

    assert box.pause() is True
    assert not box.is_running()
    assert box.get_info().state == SandboxState.PAUSED
    listed = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b-pause"})).next_items()
    assert [(s.sandbox_id, s.state) for s in listed] == [(box.sandbox_id, SandboxState.PAUSED)]
    assert box.pause() is False  # already paused
    with pytest.raises(SandboxNotRunningException):
        box.commands.run("true")

    resumed = Sandbox.connect(box.sandbox_id, timeout=600)
    assert resumed.sandbox_id == box.sandbox_id
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.get_info().metadata == {"suite": "e2b-pause"}
    assert resumed.files.read("state.txt") == "before pause"
    assert bg.pid in {p.pid for p in resumed.commands.list()}, "memory state: processes live on"
    assert bg.kill()
    assert box.is_running()  # the old handle names the same sandbox

    assert resumed.kill() is True
    assert not box.is_running()
    assert Sandbox.kill(box.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(box.sandbox_id)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(box.sandbox_id)


def test_snapshots_and_fork():
    src = Sandbox.create(metadata={"suite": "e2b-snap"}, timeout=600)
    made = [src]
    try:
        src.files.write("gen.txt", "one")
        snap = src.create_snapshot()
        src.files.write("gen.txt", "two")
        assert snap.snapshot_id.startswith("snap-")
        assert snap.snapshot_id in [s.snapshot_id for s in src.list_snapshots().next_items()]
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]

        from_snap = Sandbox.create(snap.snapshot_id, timeout=600)
        made.append(from_snap)
        assert from_snap.files.read("gen.txt") == "one"
        assert from_snap.get_info().template_id == "base"  # the template it descends from

        forks = src.fork(count=2)
        made += [f for f in forks if isinstance(f, Sandbox)]
        assert all(isinstance(f, Sandbox) for f in forks), forks
        assert len({f.sandbox_id for f in forks} | {src.sandbox_id}) == 3
        for f in forks:
            assert f.files.read("gen.txt") == "two"
            assert f.get_info().metadata == {"suite": "e2b-snap"}
        forks[0].files.write("gen.txt", "three")
        assert forks[1].files.read("gen.txt") == "two" and src.files.read("gen.txt") == "two"

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert snap.snapshot_id not in [s.snapshot_id
                                        for s in Sandbox.list_snapshots().next_items()]
        with pytest.raises(SandboxException):
            Sandbox.create(snap.snapshot_id)
    finally:
        for box in made:
            box.kill()


def test_snapshot_names_as_e2b_takes_them(sbx):
    """Names E2B accepts: tag-qualified (`name:v1`), with a namespace (`project/name`); the
    list filter takes them all, and a name without a tag matches each of its tags."""
    v1 = sbx.create_snapshot(name="e2b-named:v1")
    v2 = sbx.create_snapshot(name="my-project/e2b-named:v2")
    try:
        assert v1.names == ["e2b-named:v1"] and v2.names == ["e2b-named:v2"]
        ids = lambda name: {s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()}  # noqa: E731
        assert ids("e2b-named:v1") == {v1.snapshot_id}
        assert ids("my-project/e2b-named:v2") == {v2.snapshot_id}
        assert ids("e2b-named") == {v1.snapshot_id, v2.snapshot_id}
        assert ids("no-such-name") == set()
        restored = Sandbox.create("e2b-named:v1", timeout=300)
        restored.kill()
        with pytest.raises(SandboxException):
            sbx.create_snapshot(name="Bad Name!")
    finally:
        Sandbox.delete_snapshot(v1.snapshot_id)
        Sandbox.delete_snapshot(v2.snapshot_id)


def test_metrics_are_sampled_by_the_host(sbx):
    sbx.commands.run("timeout 3 sh -c 'while :; do :; done'; true", timeout=60)
    time.sleep(1.5)  # the test servers sample every second
    metrics = sbx.get_metrics()
    assert len(metrics) >= 2
    assert max(m.cpu_used_pct for m in metrics) > 20  # the busy loop shows
    last = metrics[-1]
    assert last.cpu_count == sbx.get_info().cpu_count and last.mem_total == 512 << 20
    assert 0 < last.mem_used < last.mem_total and 0 < last.disk_used <= last.disk_total
    from datetime import UTC, datetime, timedelta

    assert sbx.get_metrics(start=datetime.now(UTC) + timedelta(hours=1)) == []


def test_paused_at_its_timeout_and_resumed_by_the_next_call():
    box = Sandbox.create("base", timeout=10,
                         lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        box.files.write("/tmp/kept.txt", "kept")
        assert box.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        eventually(lambda: box.get_info().state == SandboxState.PAUSED, timeout=90)
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert box.sandbox_id in {i.sandbox_id for i in paused}
        assert box.commands.run("cat /tmp/kept.txt").stdout == "kept"  # it came back
        assert box.get_info().state == SandboxState.RUNNING
    finally:
        box.kill()


def test_filesystem_only_pause_snapshot_and_reboot():
    """E2B's filesystem-only modes: `pause(mode="filesystem")` keeps the files and the resume
    cold-boots; `create_snapshot(mode="filesystem")` makes sandboxes that boot from it;
    `connect(on_resume="reboot")` boots a memory pause from its disk; a timeout pause with
    `mode: "filesystem"` likewise."""
    box = Sandbox.create("base", timeout=600)
    made = [box]
    try:
        box.files.write("/root/disk.txt", "on disk")
        box.files.write("/tmp/mem.txt", "in memory")
        bg = box.commands.run("sleep 600", background=True)
        assert box.pause(mode="filesystem") is True
        assert box.get_info().state == SandboxState.PAUSED
        again = Sandbox.connect(box.sandbox_id, timeout=600)
        assert again.files.read("/root/disk.txt") == "on disk"
        assert not again.files.exists("/tmp/mem.txt")
        assert bg.pid not in {p.pid for p in again.commands.list()}

        snap = again.create_snapshot(mode="filesystem")
        again.files.write("/root/disk.txt", "after the snapshot")
        booted = Sandbox.create(snap.snapshot_id, timeout=600)
        made.append(booted)
        assert booted.files.read("/root/disk.txt") == "on disk"

        bg = again.commands.run("sleep 600", background=True)
        assert again.pause() is True  # with memory
        rebooted = Sandbox.connect(box.sandbox_id, timeout=600, on_resume="reboot")
        assert rebooted.files.read("/root/disk.txt") == "after the snapshot"
        assert bg.pid not in {p.pid for p in rebooted.commands.list()}
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        for s in made:
            s.kill()

    timed = Sandbox.create("base", timeout=10, lifecycle={
        "on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        timed.files.write("/root/kept.txt", "kept")
        timed.commands.run("sync")
        eventually(lambda: timed.get_info().state == SandboxState.PAUSED, timeout=90)
        back = Sandbox.connect(timed.sandbox_id, timeout=600)
        assert back.files.read("/root/kept.txt") == "kept"
    finally:
        timed.kill()


def test_pty_shell_input_resize_and_kill(sbx):
    """sandbox.pty as E2B's terminal users drive it: a login shell on a PTY of a size, input,
    a resize its programs see, the exit status; kill."""
    from e2b import PtySize

    term = sbx.pty.create(PtySize(rows=24, cols=80), envs={"MARK": "e2b"})
    drawn = bytearray()
    drawn_result: list = []
    follower = threading.Thread(target=lambda: drawn_result.append(
        term.wait(on_pty=drawn.extend)), daemon=True)
    follower.start()

    def expect(text: str) -> None:
        eventually(lambda: text in drawn.decode(errors="replace"), timeout=60)

    eventually(lambda: drawn.rstrip().endswith((b"$", b"#")), timeout=60)  # the prompt
    sbx.pty.send_stdin(term.pid, b"echo $((6*7))-$MARK-$TERM; stty size\r")
    expect("42-e2b-xterm-256color")
    expect("24 80")
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(term.pid, b"stty size; exit 0\r")
    follower.join(60)
    assert drawn_result and drawn_result[0].exit_code == 0
    assert "40 100" in drawn.decode(errors="replace")
    assert sbx.pty.kill(term.pid) is False  # it has exited

    other = sbx.pty.create(PtySize(rows=10, cols=40))
    assert sbx.pty.kill(other.pid) is True
    with pytest.raises(CommandExitException):
        other.wait()


def test_unsupported_calls_say_what_instead(sbx):
    # builds, tags, listings and updates are served (test_e2b_templates.py,
    # test_e2b_template_tags.py, tests/unit/test_e2b_listings.py, test_e2b_public_templates.py);
    # an update of the operator's template is refused as its delete is
    auth = {"X-API-KEY": sbx.connection_config.api_key}
    listing = httpx.get(f"{sbx.connection_config.api_url}/templates", headers=auth)
    assert listing.status_code == 200
    assert "base" in {t["templateID"] for t in listing.json()}
    update = httpx.patch(f"{sbx.connection_config.api_url}/templates/base",
                         json={"public": False}, headers=auth)
    assert update.status_code == 403 and "operator" in update.json()["message"]
    with pytest.raises(SandboxException) as ei:
        Sandbox.create("no-such-template")
    assert ei.value.status_code == 404 and "no-such-template" in str(ei.value)
    assert "base" not in str(ei.value)  # the server's templates are not listed
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999999)
    raw = httpx.get(f"{sbx.connection_config.api_url}/secrets",
                    headers={"X-API-KEY": sbx.connection_config.api_key})  # not served
    assert raw.status_code == 501 and set(raw.json()) == {"code", "message"}
    assert "secrets store" in raw.json()["message"]


def test_other_template_by_name_and_pause_across_restart(tmp_path, monkeypatch):
    """A second template (the base build under another name) in a private images dir, and a
    paused sandbox that outlives a server restart."""
    images = tmp_path / "images"
    (images / "templates").mkdir(parents=True)
    for sub in ("builds", "kernel"):
        (images / sub).symlink_to(conftest.IMAGES_DIR / sub)
    base = json.loads((conftest.IMAGES_DIR / "templates" / "base.json").read_text())
    shutil.copy(conftest.IMAGES_DIR / "templates" / "base.json", images / "templates")
    (images / "templates" / "e2b-other.json").write_text(json.dumps(base | {"name": "e2b-other"}))
    srv = conftest.make_server(tmp_path, "e2b")
    srv.extra_env["SANDLOT_IMAGES_DIR"] = str(images)
    srv.start()
    try:
        opts = e2b_opts(srv)
        box = Sandbox.create("e2b-other", timeout=600, **opts)
        assert box.get_info().template_id == "e2b-other"
        box.files.write("kept.txt", "across restarts")
        assert box.pause()
        srv.stop()
        srv.start()
        again = Sandbox.connect(box.sandbox_id, **opts)
        assert again.get_info().template_id == "e2b-other"
        assert again.files.read("kept.txt") == "across restarts"
        again.kill()
    finally:
        conftest.cleanup(srv)
