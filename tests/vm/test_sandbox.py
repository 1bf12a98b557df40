"""Sandboxes through the SDK against a real server and real VMs: lifecycle, commands, errors."""

from __future__ import annotations

import time

import httpx
import pytest

from sandlot import (
    AsyncSandbox,
    AuthenticationError,
    CommandExitError,
    CommandTimeoutError,
    InvalidArgumentError,
    NotFoundError,
    Sandbox,
)


@pytest.fixture(scope="module")
def sbx(server):
    """One sandbox shared by the command tests of this module (they don't change its state)."""
    box = Sandbox.create(env={"SANDBOX_VAR": "from-create"}, timeout=900,
                         metadata={"suite": "test_sandbox"})
    yield box
    box.kill()


def test_create_info_list_and_kill(server, sandbox_factory):
    box = sandbox_factory(metadata={"owner": "alice", "job": "1"})
    assert box.is_running()
    info = box.get_info()
    assert info.sandbox_id == box.sandbox_id
    assert info.template == "base" and info.state == "running"
    assert info.memory_mb == 512 and info.cpus == 1
    assert info.metadata == {"owner": "alice", "job": "1"}

    listed = [s.sandbox_id for s in Sandbox.list(metadata={"owner": "alice"})]
    assert box.sandbox_id in listed
    assert box.sandbox_id not in [s.sandbox_id for s in Sandbox.list(metadata={"owner": "bob"})]

    again = Sandbox.connect(box.sandbox_id)
    assert again.commands.run("echo connected").stdout == "connected\n"

    assert box.kill() is True
    assert not box.is_running()
    assert box.kill() is False
    with pytest.raises(NotFoundError):
        Sandbox.connect(box.sandbox_id).commands.run("true")


def test_context_manager_kills(server):
    with Sandbox.create() as box:
        assert box.commands.run("true").ok
    assert not box.is_running()


def test_env_and_cwd(sbx):
    r = sbx.commands.run("echo $SANDBOX_VAR $CMD_VAR; pwd", env={"CMD_VAR": "per-cmd"}, cwd="/tmp")
    assert r.stdout.split() == ["from-create", "per-cmd", "/tmp"]
    # Defaults: root's home, and the per-command variable is gone.
    r = sbx.commands.run("echo [$CMD_VAR]; pwd")
    assert r.stdout.split() == ["[]", "/root"]


def test_user_runs_unprivileged(sbx):
    r = sbx.commands.run("id -un; id -u; echo $HOME; pwd", user="user")
    assert r.stdout.split() == ["user", "1000", "/home/user", "/home/user"]
    denied = sbx.commands.run("touch /root/nope", user="user")
    assert denied.exit_code != 0 and "Permission denied" in denied.stderr
    assert sbx.commands.run("id -u").stdout.strip() == "0"


def test_guest_agent_and_init_need_nothing_from_the_image(sbx):
    """sandlot's side of the guest is two static binaries: no interpreter, no shared library
    (an image without python3, libc or iproute2 can be a sandbox)."""
    script = ("for pid in 1 $(cat /proc/[0-9]*/stat 2>/dev/null | awk '$2 == \"(sandlot-agent)\""
              " {print $1}'); do readlink /proc/$pid/exe; grep -c '\\.so' /proc/$pid/maps; done")
    lines = sbx.commands.run(script).stdout.split()
    assert lines[0].endswith("/sbin/sandlot-init") and lines[1] == "0", lines
    assert lines[2] == "/opt/sandlot/sandlot-agent" and lines[3] == "0", lines
    # The network init configured over rtnetlink (no `ip` involved).
    addr = sbx.commands.run("cat /proc/net/fib_trie | grep -c 10.0.2.15; cat /proc/net/route")
    assert int(addr.stdout.split()[0]) >= 1 and "00000000\t0202000A" in addr.stdout


def test_init_restarts_an_agent_that_died(sandbox_factory):
    """The guest's init starts the agent again if it dies; the host's session goes on with the
    new one (its commands run; the old one's process table is gone) and nothing is left as a
    zombie."""
    box = sandbox_factory()
    find = "awk '$2 == \"(sandlot-agent)\" {print $1}' /proc/[0-9]*/stat"
    agent = box.commands.run(find).stdout.strip()
    box.commands.run(f"sleep 0.5; kill -9 {agent}", background=True)
    deadline = time.monotonic() + 30
    while True:
        time.sleep(1)
        try:
            again = box.commands.run(find, timeout=10).stdout.strip()
            break
        except Exception:  # noqa: BLE001 - the old agent may take the request down with it
            if time.monotonic() > deadline:
                raise
    assert again and again != agent
    zombies = box.commands.run("grep -l '^State:.Z' /proc/[0-9]*/status || true").stdout
    assert zombies.strip() == ""


def test_exit_code_and_check(sbx):
    r = sbx.commands.run("echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("out\n", "err\n", 7, False)
    with pytest.raises(CommandExitError) as exc:
        sbx.commands.run("exit 3", check=True)
    assert exc.value.result.exit_code == 3


def test_stdin(sbx):
    assert sbx.commands.run("tr a-z A-Z", stdin="hello sandbox").stdout == "HELLO SANDBOX"


def test_streaming_callbacks_interleave(sbx):
    """Each line waits until the host has seen the one before, so the output streams while
    the command runs, in the order it was written (output held to the end would never come:
    the command would time out)."""
    expected = [(kind, f"{kind}{i}") for i in (1, 2, 3) for kind in ("out", "err")]
    seen: list[tuple[str, str]] = []

    def got(kind: str):
        def callback(data: str) -> None:
            seen.append((kind, data.strip()))
            sbx.files.write(f"/tmp/stream/{len(seen)}", "")
        return callback

    script = "rm -rf /tmp/stream && mkdir /tmp/stream"
    for n, (kind, text) in enumerate(expected, 1):
        script += (f"; echo {text}{' >&2' if kind == 'err' else ''}"
                   f"; until [ -e /tmp/stream/{n} ]; do sleep 0.05; done")
    sbx.commands.run(script, timeout=120, on_stdout=got("out"), on_stderr=got("err"))
    assert seen == expected


def test_timeout_kills_the_process_group(sbx):
    start = time.monotonic()
    with pytest.raises(CommandTimeoutError):
        sbx.commands.run("sleep 300 & sleep 301 & echo started; sleep 302", timeout=2)
    # ended, not left to hang: the host's deadline is timeout + grace (2 + 5 s); 30 s is 4x
    assert time.monotonic() - start < 30
    left = sbx.commands.run("pgrep -f 'sleep 30[012]' || true").stdout.strip()
    assert left == ""


def test_background_process(sbx):
    handle = sbx.commands.run("echo begin; touch /tmp/bg-started; sleep 120; echo never",
                              background=True)
    assert handle.pid > 0
    deadline = time.monotonic() + 20
    while not sbx.files.exists("/tmp/bg-started") and time.monotonic() < deadline:
        time.sleep(0.1)
    running = [p.pid for p in sbx.commands.list()]
    assert handle.pid in running
    assert sbx.commands.kill(handle.pid) is True
    result = handle.wait()
    assert result.stdout == "begin\n"
    assert result.exit_code == 137  # SIGKILL
    assert handle.pid not in [p.pid for p in sbx.commands.list()]


def test_background_wait_and_stdin(sbx):
    handle = sbx.commands.start("read line; echo got:$line")
    handle.send_stdin("ping\n")
    result = handle.wait()
    assert result.stdout == "got:ping\n" and result.exit_code == 0


def test_set_timeout_and_ttl(server, sandbox_factory):
    box = sandbox_factory(timeout=3)
    box.set_timeout(600)
    time.sleep(4)
    assert box.is_running()
    box.set_timeout(1)
    deadline = time.monotonic() + 20
    while box.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not box.is_running()
    with pytest.raises(NotFoundError):
        box.commands.run("true")


def test_typed_errors(server, sbx):
    with pytest.raises(NotFoundError, match="template"):
        Sandbox.create(template="no-such-template")
    with pytest.raises(NotFoundError):
        Sandbox.connect("sb-0000000000").get_info()
    with pytest.raises(InvalidArgumentError):
        sbx.files.read("relative/path")
    with pytest.raises(NotFoundError):
        sbx.files.read("/no/such/file")
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("ls", cwd="/no/such/dir")
    with pytest.raises(InvalidArgumentError):
        sbx.commands.run("true", user="nobody-here")
    with pytest.raises(InvalidArgumentError):
        Sandbox.create(memory_mb=64)
    with pytest.raises(AuthenticationError):
        Sandbox.create(api_key="wrong-key")


def test_bad_key_is_401_json(server):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.get(f"{server.url}/v1/sandboxes", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "AuthenticationError"


def test_bad_input_is_400_json(server):
    headers = {"Authorization": f"Bearer {server.key}"}
    r = httpx.post(f"{server.url}/v1/sandboxes", headers=headers, json={"cpus": "many"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgumentError"
    r = httpx.post(f"{server.url}/v1/sandboxes", headers=headers, content=b"{not json")
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/v1/sandboxes/sb-0000000000/commands", headers=headers,
                   json={"cmd": "true"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


async def test_async_sandbox(server):
    box = await AsyncSandbox.create()
    try:
        chunks: list[str] = []
        r = await box.commands.run("echo a; echo b", on_stdout=chunks.append)
        assert r.stdout == "a\nb\n" and "".join(chunks) == "a\nb\n"
        await box.files.write("/tmp/async.txt", "async data")
        assert await box.files.read("/tmp/async.txt") == "async data"
        assert await box.is_running()
    finally:
        await box.kill()
    assert not await box.is_running()
