"""The sync SDK against the real app and core on the fake machine layer, in process (no VM)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest
from fastkit import Fast

import sandlot
from sandlot import (
    AuthenticationError,
    CommandExitError,
    CommandResult,
    CommandTimeoutError,
    ConflictError,
    GuestError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    Sandbox,
    SandboxError,
    SandboxInfo,
    Sandlot,
    SandlotError,
    Snapshot,
    SnapshotFailedError,
    VmmError,
    WaitTimeoutError,
)

URL = "http://sandlot.test"
FAIL = "echo -n partial; echo boom >&2; exit 3"


@pytest.fixture
def client(fast: Fast) -> Iterator[Sandlot]:
    with Sandlot(URL, fast.key, transport=fast.transport) as c:
        yield c


@pytest.fixture
def sbx(client: Sandlot) -> Sandbox:
    return client.sandboxes.create(metadata={"team": "a"})


# -- sandboxes -----------------------------------------------------------------------------


def test_create_and_lifecycle(client: Sandlot, fast: Fast) -> None:
    sbx = client.sandboxes.create("base", memory_mb=1024, env={"A": 1}, timeout=60)
    body = json.loads(fast.requests[-1].content)
    assert body == {"template": "base", "snapshot_id": None, "memory_mb": 1024, "cpus": None,
                    "env": {"A": "1"}, "timeout": 60, "metadata": {}, "internet": True,
                    "network": None, "on_timeout": "kill", "auto_resume": False,
                    "pause_memory": True}
    assert sbx.sandbox_id.startswith("sb-")
    info = sbx.get_info()
    assert isinstance(info, SandboxInfo) and isinstance(info.created_at, datetime)
    assert info.memory_mb == 1024 and info.env == {"A": "1"}
    assert sbx.commands.run("printenv A").stdout == "1\n"
    assert sbx.is_running()
    sbx.set_timeout(30)
    assert sbx.info.timeout == 30
    assert sbx.kill() is True
    assert sbx.kill() is False
    assert sbx.destroy() is False
    assert sbx.is_running() is False


def test_create_from_snapshot_sends_no_template(client: Sandlot, sbx: Sandbox,
                                                fast: Fast) -> None:
    snap = sbx.create_snapshot().wait()
    assert client.sandboxes.create(snapshot_id=snap.snapshot_id).info.template == "base"
    assert json.loads(fast.requests[-1].content)["template"] is None
    with pytest.raises(NotFoundError):
        client.sandboxes.create(snapshot_id="snap-1")


def test_a_snapshot_forks_into_sandboxes(client: Sandlot, sbx: Sandbox, fast: Fast) -> None:
    sbx.files.write("/tmp/s", "kept")
    snap = sbx.create_snapshot().wait()
    sbx.kill()
    kids = snap.fork(2, env={"K": "v"}, timeout=60)
    assert len(kids) == 2 and kids.errors == []
    assert json.loads(fast.requests[-1].content) == {"count": 2, "env": {"K": "v"},
                                                      "timeout": 60}
    assert {k.files.read("/tmp/s") for k in kids} == {"kept"}
    assert {k.info.env.get("K") for k in kids} == {"v"}
    fast.runtime.fail_restores = 1  # one child fails: the others are there, its error typed
    kids = snap.fork(3)
    assert len(kids) == 2 and [type(e) for e in kids.errors] == [InvalidStateError]
    assert kids.errors[0].message.startswith("fork child ")
    fast.runtime.fail_restores = 2  # every child fails: the first error is raised
    with pytest.raises(InvalidStateError):
        snap.fork(2)
    with pytest.raises(InvalidArgumentError):
        snap.fork(0)
    snap.remove()
    with pytest.raises(NotFoundError):
        snap.fork(1)


def test_context_manager_kills(client: Sandlot, fast: Fast) -> None:
    with client.sandboxes.create() as sbx:
        assert sbx.is_running()
    assert client.sandboxes.get_info(sbx.sandbox_id).state == "stopped"


def test_classmethods_use_env_config(default_api: None, fast: Fast) -> None:
    with Sandbox.create(metadata={"k": "v"}) as sbx:
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.get_info().metadata == {"k": "v"}
        assert [s.sandbox_id for s in Sandbox.list(metadata={"k": "v"})] == [sbx.sandbox_id]
        assert Sandbox.list(metadata={"k": "other"}) == []
    assert not again.is_running()
    assert fast.requests[0].headers["authorization"] == f"Bearer {fast.key}"
    assert str(fast.requests[0].url).startswith(URL + "/v1/sandboxes")


def test_list_filters_metadata(client: Sandlot, fast: Fast) -> None:
    a = client.sandboxes.create(metadata={"team": "a", "x": "1"})
    client.sandboxes.create(metadata={"team": "b"})
    found = client.sandboxes.list({"team": "a"})
    assert [s.sandbox_id for s in found] == [a.sandbox_id]
    assert json.loads(fast.requests[-1].url.params["metadata"]) == {"team": "a"}
    a.kill()
    assert client.sandboxes.list({"team": "a"}) == []
    assert len(client.sandboxes.list({"team": "a"}, include_stopped=True)) == 1


# -- errors --------------------------------------------------------------------------------


def test_error_type_status_and_message(client: Sandlot) -> None:
    with pytest.raises(NotFoundError) as err:
        client.sandboxes.connect("sb-missing")
    assert err.value.status == 404
    assert err.value.message == "sandbox 'sb-missing' not found"
    with pytest.raises(NotFoundError):
        client.sandboxes.create("nope")


def test_missing_key_is_authentication_error(fast: Fast, monkeypatch) -> None:
    monkeypatch.delenv("SANDLOT_API_KEY", raising=False)
    with Sandlot(URL, transport=fast.transport) as c, pytest.raises(AuthenticationError) as e:
        c.sandboxes.list()
    assert e.value.status == 401 and "SANDLOT_API_KEY" in e.value.message


@pytest.mark.parametrize(("status", "body", "cls"), [
    (502, b"Bad Gateway", SandboxError),
    (500, b"{}", SandlotError),
    (409, b'{"error": {"type": "NoSuchClass", "message": "x"}}', SandlotError),
    (409, b'{"error": {"type": "ConflictError", "message": "taken"}}', ConflictError),
    (502, b'{"error": {"type": "VmmError", "message": "qemu"}}', VmmError),
])
def test_error_mapping(status: int, body: bytes, cls: type) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body)

    with Sandlot(URL, "k", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SandlotError) as err:
            c.sandboxes.list()
    assert type(err.value) is cls and err.value.status == status


def test_connection_refused_is_sandlot_error() -> None:
    with pytest.raises(SandlotError) as err:
        Sandbox.create(api_url="http://127.0.0.1:1", api_key="k")
    assert type(err.value) is SandlotError
    assert "cannot connect" in err.value.message and "127.0.0.1:1" in err.value.message
    assert isinstance(err.value.__cause__, httpx.ConnectError)


def test_timeouts_are_sandlot_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with Sandlot(URL, "k", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SandlotError, match="timed out") as err:
            c.templates.list()
    assert isinstance(err.value.__cause__, httpx.ReadTimeout)


def test_bad_arguments_fail_before_sending(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgumentError):
        sbx.files.read("relative/path")
    with pytest.raises(InvalidArgumentError):
        sbx.files.read("/a", format="yaml")  # type: ignore[call-overload]
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("")
    with pytest.raises(InvalidArgumentError):
        sbx.fork(0)


# -- commands ------------------------------------------------------------------------------


def test_run_collects_output_and_calls_callbacks(sbx: Sandbox, fast: Fast) -> None:
    out: list[str] = []
    result = sbx.commands.run("echo hi $X; pwd; whoami", on_stdout=out.append, env={"X": "1"},
                              cwd="/tmp", user="user", stdin="in")
    assert result == CommandResult("hi 1\n/tmp\nuser\n", "", 0)
    assert result.ok and "".join(out) == result.stdout
    body = json.loads(fast.requests[-1].content)
    assert body == {"cmd": "echo hi $X; pwd; whoami", "env": {"X": "1"}, "cwd": "/tmp",
                    "user": "user", "timeout": 60, "stdin": "in", "background": False}


def test_run_nonzero_and_check(sbx: Sandbox) -> None:
    err: list[str] = []
    result = sbx.commands.run(FAIL, on_stderr=err.append)
    assert (result.exit_code, result.ok, result.stdout, result.stderr) == (3, False, "partial",
                                                                           "boom\n")
    assert err == ["boom\n"]
    with pytest.raises(CommandExitError) as exc:
        sbx.commands.run(FAIL, check=True)
    assert exc.value.result == result and exc.value.exit_code == 3
    assert "boom" in exc.value.message
    assert isinstance(exc.value, SandlotError)


def test_run_stream_errors(sbx: Sandbox) -> None:
    with pytest.raises(CommandTimeoutError, match="timed out"):
        sbx.commands.run("sleep 30", timeout=0.2)
    with pytest.raises(GuestError):
        sbx.commands.run("crash")
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("true", cwd="/nope")


def test_run_http_read_timeout_outlives_command(sbx: Sandbox, fast: Fast) -> None:
    sbx.commands.run("true", timeout=10)
    assert fast.requests[-1].extensions["timeout"]["read"] == 40
    sbx.commands.run("true", timeout=None)
    assert fast.requests[-1].extensions["timeout"]["read"] is None
    assert json.loads(fast.requests[-1].content)["timeout"] is None


def test_callbacks_fire_while_streaming() -> None:
    seen: list[str] = []

    def body() -> Iterator[bytes]:
        yield b'{"type": "start", "pid": 5}\n{"type": "stdout", "data": "one"}\n'
        assert seen == ["one"], "callback must run before the stream ends"
        yield b'{"type": "stdout", "data": "two"}\n{"type": "exit", "exit_code": 0}\n'

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(200, content=body())
        return httpx.Response(200, json={"sandbox_id": "sb-1"})

    with Sandlot(URL, "k", transport=httpx.MockTransport(handler)) as c:
        result = c.sandboxes.connect("sb-1").commands.run("x", on_stdout=seen.append)
    assert result.stdout == "onetwo" and seen == ["one", "two"]


def test_stream_without_exit_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(200, content=b'{"type": "start", "pid": 5}\n')
        return httpx.Response(200, json={"sandbox_id": "sb-1"})

    with Sandlot(URL, "k", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(SandboxError, match="without an exit code"):
            c.sandboxes.connect("sb-1").commands.run("x")


def test_background_commands(sbx: Sandbox, fast: Fast) -> None:
    handle = sbx.commands.start("cat")
    assert json.loads(fast.requests[-1].content)["background"] is True
    assert json.loads(fast.requests[-1].content)["timeout"] is None
    assert [p.pid for p in sbx.commands.list()] == [handle.pid]
    handle.send_stdin("ab")
    handle.send_stdin(b"c", eof=True)
    out: list[str] = []
    result = handle.wait(on_stdout=out.append)
    assert result.stdout == "abc" and out == ["abc"]
    assert fast.requests[-1].url.path.endswith(f"/commands/{handle.pid}/stream")
    assert handle.kill() is False

    other = sbx.commands.run("sleep 100", background=True)
    assert other.pid != handle.pid
    assert sbx.commands.kill(other.pid, signal=15) is True
    assert json.loads(fast.requests[-1].content) == {"signal": 15}
    assert sbx.commands.kill(99999) is False
    assert sbx.commands.list() == []


def test_terminals_request_a_pty_and_resize(sbx: Sandbox, fast: Fast) -> None:
    term = sbx.pty.create(cols=100, rows=30, cmd="cat")
    body = json.loads(fast.requests[-1].content)
    assert body["pty"] == {"cols": 100, "rows": 30} and body["background"] is True
    assert body["timeout"] is None  # a terminal lives until it exits or is killed
    assert [p.pty for p in sbx.commands.list()] == [True]
    term.resize(120, 40)
    assert fast.requests[-1].url.path.endswith(f"/commands/{term.pid}/resize")
    assert json.loads(fast.requests[-1].content) == {"cols": 120, "rows": 40}
    with pytest.raises(InvalidArgumentError, match="cols"):
        sbx.pty.create(cols=0, rows=24)  # refused before anything is sent
    plain = sbx.commands.start("sleep 100")
    with pytest.raises(InvalidArgumentError, match="no terminal"):
        sbx.pty.resize(plain.pid, 80, 24)
    with httpx.Client(base_url=URL, transport=fast.transport,
                      headers={"Authorization": f"Bearer {fast.key}"}) as raw:
        answer = raw.post(f"/v1/sandboxes/{sbx.sandbox_id}/commands",
                          json={"cmd": "sh", "pty": {"cols": 80, "rows": 24}})
    assert answer.status_code == 400 and "background" in answer.json()["error"]["message"]
    term.kill()
    plain.kill()


def test_files_carry_metadata(sbx: Sandbox, fast: Fast) -> None:
    entry = sbx.files.write("/tmp/m.txt", "m", metadata={"Stage": "raw"})
    assert fast.requests[-1].headers["x-metadata-stage"] == "raw"
    assert entry.metadata == {"stage": "raw"}
    assert sbx.files.stat("/tmp/m.txt").metadata == {"stage": "raw"}
    assert sbx.files.write("/tmp/m.txt", "n").metadata is None
    with pytest.raises(InvalidArgumentError):
        sbx.files.write("/tmp/m.txt", "n", metadata={"bad key": "v"})


# -- files ---------------------------------------------------------------------------------


def test_files_roundtrip(sbx: Sandbox, fast: Fast) -> None:
    entry = sbx.files.write("/tmp/a.txt", "héllo")
    assert entry.path == "/tmp/a.txt" and entry.size == len("héllo".encode())
    assert fast.requests[-1].url.params["user"] == "root"
    assert sbx.files.read("/tmp/a.txt") == "héllo"
    assert sbx.files.read("/tmp/a.txt", format="bytes") == "héllo".encode()
    assert sbx.files.exists("/tmp/a.txt") and not sbx.files.exists("/tmp/b.txt")
    assert sbx.files.stat("/tmp/a.txt").name == "a.txt"
    assert [e.path for e in sbx.files.list("/tmp")] == ["/tmp/a.txt"]
    assert fast.requests[-1].url.params["depth"] == "1"
    assert sbx.files.rename("/tmp/a.txt", "/tmp/b.txt").path == "/tmp/b.txt"
    assert sbx.files.make_dir("/tmp/d") is True and sbx.files.make_dir("/tmp/d") is False
    sbx.files.remove("/tmp/b.txt")
    with pytest.raises(NotFoundError):
        sbx.files.read("/tmp/b.txt")
    with pytest.raises(NotFoundError):
        sbx.files.remove("/tmp/b.txt")


def test_files_upload_streams_file_objects_and_iterators(sbx: Sandbox, fast: Fast) -> None:
    blob = bytes(range(256)) * 10000  # 2.5 MB: more than one upload chunk
    sbx.files.write("/big", io.BytesIO(blob))
    request = fast.requests[-1]
    assert request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in request.headers
    assert sbx.files.read("/big", format="bytes") == blob
    sbx.files.write("/parts", iter([b"ab", b"cd"]))
    assert sbx.files.read("/parts", format="bytes") == b"abcd"
    with pytest.raises(InvalidArgumentError):
        sbx.files.write("/x", 12)  # type: ignore[arg-type]


def test_files_stream_read_and_local_helpers(sbx: Sandbox, tmp_path) -> None:
    blob = b"x" * 300_000 + b"end"
    local = tmp_path / "in.bin"
    local.write_bytes(blob)
    sbx.files.write_from("/data.bin", local)
    stream = sbx.files.read("/data.bin", format="stream")
    assert b"".join(stream) == blob
    with sbx.files.read("/data.bin", format="stream") as chunks:
        assert next(iter(chunks))
    out = tmp_path / "out.bin"
    assert sbx.files.read_to("/data.bin", out) == len(blob)
    assert out.read_bytes() == blob
    with pytest.raises(NotFoundError):
        sbx.files.read("/missing", format="stream")


# -- snapshots, fork, rollback -------------------------------------------------------------


def test_snapshot_create_wait_restore(sbx: Sandbox, client: Sandlot, fast: Fast) -> None:
    snap = sbx.create_snapshot("first")
    assert snap.state == "creating" and snap.name == "first" and snap.error is None
    assert snap.wait(timeout=5) is snap
    assert snap.state == "ready" and snap.info.sandbox_id == sbx.sandbox_id
    child = snap.restore()
    assert child.sandbox_id != sbx.sandbox_id and child.get_info().snapshot_id == snap.snapshot_id
    tuned = snap.restore_with(memory_mb=2048, env={"B": "2"}, timeout=99)
    body = json.loads(fast.requests[-1].content)
    assert body["memory_mb"] == 2048 and body["env"] == {"B": "2"} and body["timeout"] == 99
    assert tuned.info.memory_mb == 2048
    assert sbx.snapshot().snapshot_id != snap.snapshot_id
    assert [s.snapshot_id for s in client.snapshots.list(sbx.sandbox_id)][0] == snap.snapshot_id


def test_snapshot_wait_failure_and_timeout(sbx: Sandbox, fast: Fast) -> None:
    fast.runtime.persist_delay = 2.0
    with pytest.raises(WaitTimeoutError):
        sbx.create_snapshot().wait(timeout=0.3)
    fast.runtime.persist_delay = 0
    fast.runtime.fail_persist = "disk full"
    snap = sbx.create_snapshot()
    with pytest.raises(SnapshotFailedError, match="disk full") as err:
        snap.wait()
    assert isinstance(err.value, SandboxError) and err.value.snapshot_id == snap.snapshot_id
    assert snap.state == "failed" and snap.error == "disk full"


def test_snapshot_names_and_deletion(sbx: Sandbox, client: Sandlot) -> None:
    a = sbx.create_snapshot("a")
    b = sbx.create_snapshot()
    assert b.save_named("b") is b and b.name == "b"
    with pytest.raises(ConflictError):
        b.save_named("a")
    assert client.snapshots.get("b").snapshot_id == b.snapshot_id
    assert b.remove() is True and b.remove() is False
    assert client.snapshots.delete("a") is True and client.snapshots.delete("a") is False
    assert client.snapshots.get(a.snapshot_id).state == "deleted"
    with pytest.raises(NotFoundError):
        client.snapshots.get("a")


def test_snapshot_classmethods(default_api: None, sbx: Sandbox) -> None:
    snap = sbx.create_snapshot("named")
    got = Snapshot.get("named")
    assert got.snapshot_id == snap.snapshot_id
    assert [s.name for s in Snapshot.list()] == ["named"]
    assert Snapshot.delete("named") is True
    assert Snapshot.delete("named") is False
    assert Snapshot.list() == []


def test_client_restore_checks_source(sbx: Sandbox, client: Sandlot) -> None:
    snap = sbx.create_snapshot("s")
    restored = client.snapshots.restore(sbx.sandbox_id, "s", cpus=2)
    assert restored.sandbox_id != sbx.sandbox_id
    assert client.snapshots.restore(None, snap.snapshot_id).info.snapshot_id == snap.snapshot_id
    with pytest.raises(InvalidArgumentError, match="taken from"):
        client.snapshots.restore("sb-other", "s")


def test_fork_reports_each_child(sbx: Sandbox, fast: Fast) -> None:
    sbx.files.write("/tmp/state", "parent")
    kids = sbx.fork(3)
    assert len(kids) == 3 and kids.errors == []
    assert all(isinstance(k, Sandbox) and k.is_running() for k in kids)
    assert {k.files.read("/tmp/state") for k in kids} == {"parent"}
    assert {k.get_info().forked_from for k in kids} == {sbx.sandbox_id}
    fast.runtime.fail_restores = 1
    kids = sbx.fork(3)
    assert len(kids) == 2 and len(kids.errors) == 1
    assert isinstance(kids.errors[0], SandlotError) and "child" in kids.errors[0].message
    fast.runtime.fail_restores = 2
    with pytest.raises(SandlotError, match="child 0"):
        sbx.fork(2)


def test_rollback_keeps_sandbox_id(sbx: Sandbox, fast: Fast) -> None:
    sbx.files.write("/tmp/f", "before")
    snap = sbx.create_snapshot("r").wait()
    sbx.files.write("/tmp/f", "after")
    generation = sbx.info.generation
    assert sbx.rollback(snap) is sbx
    assert sbx.info.generation != generation and sbx.info.snapshot_id == snap.snapshot_id
    assert sbx.files.read("/tmp/f") == "before" and sbx.info.metadata == {"team": "a"}
    posted = [r for r in fast.requests if r.url.path.endswith("/rollback")]
    assert json.loads(posted[-1].content) == {"snapshot_id": snap.snapshot_id}
    sbx.rollback("r")
    with pytest.raises(NotFoundError):
        sbx.rollback("nope")


def test_templates_and_health(client: Sandlot) -> None:
    assert [t.name for t in client.templates.list()] == ["base"]
    assert client.templates.get("base").hash == "fakebase"
    assert client.health()["status"] == "ok"
    deadline = time.monotonic() + 10  # the start-up upload of templates to the store ends
    while not client.health()["templates_stored"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_client_reopens_after_close(client: Sandlot) -> None:
    client.close()
    assert client.templates.list()


def test_public_names() -> None:
    assert sandlot.CommandExitError is CommandExitError


def test_pause_and_resume(sbx: Sandbox, client: Sandlot) -> None:
    sbx.files.write("/tmp/p", "state")
    sbx.pause()
    assert sbx.info.state == "paused" and not sbx.is_running()
    assert [s.sandbox_id for s in client.sandboxes.list()] == [sbx.sandbox_id]
    again = client.sandboxes.resume(sbx.sandbox_id, timeout=50)
    assert again.info.state == "running" and again.info.timeout == 50
    assert sbx.resume is not None and again.files.read("/tmp/p") == "state"
    with pytest.raises(SandlotError, match="running"):
        sbx.resume()
