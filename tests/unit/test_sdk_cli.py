"""The ``sandlot`` CLI, driven through click's runner against the real app and core on the fake
machine layer, in process; the server and template-build entry points are replaced by stubs
(they have their own tests)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastkit import Fast

from sandlot import Sandlot, cli


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, fast: Fast) -> Fast:
    calls: list[tuple[str | None, str | None]] = []

    def client(url: str | None, api_key: str | None) -> Sandlot:
        calls.append((url, api_key))
        return Sandlot(url or fast.url, api_key, transport=fast.transport)

    monkeypatch.setattr(cli, "_client", client)
    monkeypatch.setenv("SANDLOT_API_KEY", fast.key)
    fast.client_calls = calls  # type: ignore[attr-defined]
    return fast


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli.cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_sandbox_create_list_kill(fake: Fast) -> None:
    code, out, _ = run("sandbox", "create", "--memory", "1024", "--env", "A=1",
                       "--metadata", "team=x", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["memory_mb"] == 1024 and info["metadata"] == {"team": "x"}
    sid = info["sandbox_id"]
    code, out, _ = run("sandbox", "list", "--metadata", "team=x", "--json")
    assert [s["sandbox_id"] for s in json.loads(out)] == [sid]
    code, out, _ = run("sandbox", "list")
    assert code == 0 and sid in out and "SANDBOX" in out
    assert run("sandbox", "kill", sid)[:2] == (0, f"killed {sid}\n")
    code, _, err = run("sandbox", "kill", sid)
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err


def test_client_options_reach_the_client(fake: Fast) -> None:
    run("sandbox", "list", "--url", "http://other:1", "--api-key", "k2")
    assert fake.client_calls[-1] == ("http://other:1", "k2")  # type: ignore[attr-defined]


def test_exec_streams_and_exits_with_code(fake: Fast) -> None:
    sid = json.loads(run("sandbox", "create", "--json")[1])["sandbox_id"]
    code, out, err = run("sandbox", "exec", sid, "--", "echo", "hi there")
    assert (code, out) == (0, "hi there\n")
    assert json.loads(fake.requests[-1].content)["cmd"] == "echo 'hi there'"
    code, out, err = run("sandbox", "exec", sid, "--", "echo -n partial; echo boom >&2; exit 3")
    assert (code, out, err) == (3, "partial", "boom\n")
    code, _, err = run("sandbox", "exec", sid, "--timeout", "1", "--", "sleep", "30")
    assert code == 1 and err.startswith("error: command timed out after 1")
    code, _, err = run("sandbox", "exec", "sb-nope", "--", "true")
    assert code == 1 and err == "error: sandbox 'sb-nope' not found\n"


def test_fork_and_rollback(fake: Fast) -> None:
    sid = json.loads(run("sandbox", "create", "--json")[1])["sandbox_id"]
    code, out, _ = run("sandbox", "fork", sid, "--count", "2", "--json")
    assert code == 0 and len(json.loads(out)) == 2
    fake.runtime.fail_restores = 1
    code, out, err = run("sandbox", "fork", sid, "--count", "2", "--json")
    assert code == 1 and len(json.loads(out)) == 1 and "child" in err
    run("snapshot", "create", sid, "--name", "s1", "--wait")
    code, out, _ = run("sandbox", "rollback", sid, "s1", "--json")
    assert code == 0 and json.loads(out)["sandbox_id"] == sid


def test_pause_resume(fake: Fast) -> None:
    sid = json.loads(run("sandbox", "create", "--json")[1])["sandbox_id"]
    code, out, _ = run("sandbox", "pause", sid, "--json")
    assert code == 0 and json.loads(out)["state"] == "paused"
    code, out, _ = run("sandbox", "resume", sid, "--timeout", "9", "--json")
    assert code == 0 and (json.loads(out)["state"], json.loads(out)["timeout"]) == ("running", 9)
    code, _, err = run("sandbox", "resume", sid)
    assert code == 1 and "running" in err
    code, out, _ = run("sandbox", "pause", sid, "--filesystem-only", "--json")
    assert code == 0 and json.loads(out)["state"] == "paused"
    code, out, _ = run("sandbox", "resume", sid, "--reboot", "--json")
    assert code == 0 and json.loads(out)["state"] == "running"
    code, out, _ = run("snapshot", "create", sid, "--filesystem-only", "--wait", "--json")
    assert code == 0 and json.loads(out)["memory"] is False


def test_snapshot_commands(fake: Fast) -> None:
    sid = json.loads(run("sandbox", "create", "--json")[1])["sandbox_id"]
    code, out, _ = run("snapshot", "create", sid, "--name", "n", "--wait", "--json")
    assert code == 0 and json.loads(out)["state"] == "ready"
    code, out, _ = run("snapshot", "list", "--json")
    assert [s["name"] for s in json.loads(out)] == ["n"]
    code, out, _ = run("snapshot", "get", "n")
    assert code == 0 and "ready" in out
    code, out, _ = run("snapshot", "restore", "n", "--memory", "2048", "--env", "B=2", "--json")
    assert code == 0 and json.loads(out)["memory_mb"] == 2048
    run("sandbox", "kill", sid)  # a snapshot forks with no running parent
    code, out, _ = run("snapshot", "fork", "n", "-n", "3", "--env", "B=2", "--metadata",
                       "m=1", "--timeout", "90", "--json")
    kids = json.loads(out)
    assert code == 0 and len(kids) == 3 and len({k["sandbox_id"] for k in kids}) == 3
    assert {(k["env"]["B"], k["metadata"]["m"], k["timeout"]) for k in kids} == {("2", "1", 90)}
    fake.runtime.fail_restores = 1  # a child that fails: the others are shown, exit 1
    code, out, err = run("snapshot", "fork", "n", "--count", "2", "--json")
    assert code == 1 and len(json.loads(out)) == 1 and "fork child" in err
    code, _, err = run("snapshot", "fork", "nope", "-n", "2")
    assert code == 1 and "not found" in err
    assert run("snapshot", "rm", "n")[0] == 0
    code, _, err = run("snapshot", "rm", "n")
    assert code == 1 and err.startswith("error: snapshot n not found")


def test_bad_key_value(fake: Fast) -> None:
    result = CliRunner().invoke(cli.cli, ["sandbox", "create", "--env", "novalue"])
    assert result.exit_code == 2 and "KEY=VALUE" in result.stderr


def test_local_commands_call_core(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple] = []
    info = types.SimpleNamespace(name="py", hash="h123", memory_mb=512, cpus=1,
                                 built_at=None)
    pipeline = types.ModuleType("sandlot.images.pipeline")
    pipeline.build_template = lambda spec, data_dir, force: calls.append(  # type: ignore
        ("build", spec, data_dir, force)) or info
    templates = types.ModuleType("sandlot.core.templates")
    templates.list_templates = lambda data_dir: [info]  # type: ignore[attr-defined]
    templates.remove_template = lambda name, data_dir: calls.append(  # type: ignore
        ("rm", name, data_dir))
    keys = types.ModuleType("sandlot.core.keys")
    keys.create_key = lambda data_dir, **kw: ("sk-new", "t-1")  # type: ignore[attr-defined]
    server = types.ModuleType("sandlot.server")
    server.run = lambda **kw: calls.append(("serve", kw))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandlot.images.pipeline", pipeline)
    monkeypatch.setitem(sys.modules, "sandlot.core.templates", templates)
    monkeypatch.setitem(sys.modules, "sandlot.core.keys", keys)
    monkeypatch.setitem(sys.modules, "sandlot.server", server)
    monkeypatch.setenv("SANDLOT_DATA_DIR", str(tmp_path))

    assert run("template", "build", "spec.toml", "--force") == (0, "template py ready (h123)\n",
                                                               "")
    assert calls[-1] == ("build", "spec.toml", tmp_path, True)
    code, out, _ = run("template", "list", "--json")
    assert json.loads(out) == [{"name": "py", "hash": "h123", "memory_mb": 512, "cpus": 1,
                                "built_at": None}]
    assert run("template", "rm", "py", "--data-dir", "/x")[0] == 0
    assert calls[-1] == ("rm", "py", Path("/x"))
    pipeline.pull_image_template = lambda ref, name, **kw: calls.append(  # type: ignore
        ("image", ref, name, sorted(kw["access"].insecure))) or info
    pipeline.dockerfile_template = lambda df, ctx, name, **kw: calls.append(  # type: ignore
        ("dockerfile", df, ctx, name, kw["build_args"])) or info
    assert run("template", "build", "--image", "reg:5000/a/b:1", "py",
               "--insecure-registry", "reg:5000")[0] == 0
    assert calls[-1] == ("image", "reg:5000/a/b:1", "py", ["reg:5000"])
    assert run("template", "build", "-f", "Dockerfile", "ctx", "py", "--build-arg", "A=1")[0] == 0
    assert calls[-1] == ("dockerfile", Path("Dockerfile"), Path("ctx"), "py", {"A": "1"})
    assert run("template", "build", "--image", "x")[0] == 2  # no NAME
    assert run("keys", "create") == (0, "sk-new\n", "tenant: t-1\n")
    assert run("serve", "--port", "8080")[0] == 0
    assert calls[-1] == ("serve", {"host": "127.0.0.1", "port": 8080, "data_dir": tmp_path,
                                   "port_file": None})
    assert run("serve", "--port", "0", "--port-file", "p")[0] == 0
    assert calls[-1][1]["port"] == 0 and calls[-1][1]["port_file"] == Path("p")
    code, _, err = run("serve", "--port", "70000")
    assert code == 2 and "70000" in err


def test_serve_listens_on_the_port_the_kernel_picks(tmp_path: Path) -> None:
    """`serve --port 0` binds a free port itself and writes which one; a port another
    process holds is a clear error."""
    import socket

    from sandlot.server.app import listen, write_port

    with listen("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens
        write_port(tmp_path / "port", port)
        assert int((tmp_path / "port").read_text()) == port
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1 port {port}: Address"):
            listen("127.0.0.1", port)


def test_data_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    server = types.ModuleType("sandlot.server")
    seen: dict = {}
    server.run = lambda **kw: seen.update(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandlot.server", server)
    monkeypatch.delenv("SANDLOT_DATA_DIR", raising=False)
    assert run("serve")[0] == 0
    assert seen["data_dir"] == Path("/var/lib/sandlot")


def test_core_errors_print_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandlot.errors import BuildError

    pipeline = types.ModuleType("sandlot.images.pipeline")

    def build(spec, data_dir, force):
        raise BuildError("apt-get failed")

    pipeline.build_template = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sandlot.images.pipeline", pipeline)
    assert run("template", "build", "x") == (1, "", "error: apt-get failed\n")
