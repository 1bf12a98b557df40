"""A terminal over a WebSocket (server/routes_pty.py) on the fake runtime, under uvicorn on
loopback with a real WebSocket client: the key in the first message, output and input as
binary frames, resize and exit as text frames, refusals as close codes, tenants kept apart,
a socket to another host's sandbox relayed there."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest
from fastkit import serving
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from sandlot.core.hosts import HostInfo, Hosts, HostState
from sandlot.core.models import SandboxRecord
from sandlot.errors import CapacityError
from sandlot.runtime.fake import FakeRuntime
from sandlot.server.app import create_app
from sandlot.testing import fake_settings, install_fake_template, loopback_socket


class Env:
    def __init__(self, app, runtime: FakeRuntime, port: int, keys: dict[str, str]) -> None:
        self.app, self.runtime, self.port, self.keys = app, runtime, port, keys
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)

    async def create(self, tenant: str = "a") -> str:
        r = await self.http.post("/v1/sandboxes", json={"template": "base"},
                                 headers={"authorization": f"Bearer {self.keys[tenant]}"})
        assert r.status_code == 201, r.text
        return r.json()["sandbox_id"]

    def ws(self, sid: str):
        return connect(f"ws://127.0.0.1:{self.port}/v1/sandboxes/{sid}/pty")

    def terminal(self, pid: int, sid: str):
        return self.runtime.vms[sid].agent.procs[pid].terminal


async def new_env(tmp_path, **settings) -> tuple:
    runtime = FakeRuntime()
    s = fake_settings(tmp_path, **settings)
    install_fake_template(s, runtime)
    return create_app(s, runtime=runtime), runtime


@pytest.fixture
async def env(tmp_path):
    app, runtime = await new_env(tmp_path)
    async with serving(app) as port:
        keys = {"a": "sl_pty_a", "b": "sl_pty_b"}
        for tenant, key in keys.items():
            await app.state.core.db.add_key(key, tenant)
        e = Env(app, runtime, port, keys)
        yield e
        await e.http.aclose()


async def opened(ws, key: str, **first) -> int:
    """Send the first message; the pid of the terminal the server answers with."""
    await ws.send(json.dumps({"api_key": key, **first}))
    start = json.loads(await ws.recv())
    assert start["type"] == "start", start
    return start["pid"]


async def refused(ws) -> tuple[int, dict]:
    """The close code and the error said before it."""
    said = json.loads(await ws.recv())
    with pytest.raises(ConnectionClosed):
        await ws.recv()
    assert said["type"] == "error"
    return ws.close_code, said["error"]


async def test_output_then_exit_then_close(env):
    sid = await env.create()
    async with env.ws(sid) as ws:
        pid = await opened(ws, env.keys["a"], cmd="echo hi; exit 3", cols=100, rows=30)
        assert await ws.recv() == b"hi\n"
        assert json.loads(await ws.recv()) == {"type": "exit", "exit_code": 3}
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1000
    assert env.terminal(pid, sid).cols == 100  # started on a terminal of that size


async def test_input_resize_and_reattach(env):
    sid = await env.create()
    async with env.ws(sid) as ws:
        pid = await opened(ws, env.keys["a"], cmd="cat")
        assert env.terminal(pid, sid).cols == 80
        await ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 40}))
        await ws.send(b"typed ")
        await ws.send(b"in")
    # the socket closed, the process runs on: another socket attaches to it by pid
    auth = {"authorization": f"Bearer {env.keys['a']}"}
    listed = (await env.http.get(f"/v1/sandboxes/{sid}/commands", headers=auth)).json()
    assert [(p["pid"], p["running"], p["pty"]) for p in listed["processes"]] == [
        (pid, True, True)]
    size = env.terminal(pid, sid)
    assert (size.cols, size.rows) == (120, 40)
    async with env.ws(sid) as ws:
        assert await opened(ws, env.keys["a"], pid=pid, cols=100, rows=50) == pid
        size = env.terminal(pid, sid)
        assert (size.cols, size.rows) == (100, 50)  # the attaching client's size
        r = await env.http.post(f"/v1/sandboxes/{sid}/commands/{pid}/stdin",
                                json={"eof": True}, headers=auth)
        assert r.status_code == 204
        assert await ws.recv() == b"typed in"  # what the first socket typed
        assert json.loads(await ws.recv()) == {"type": "exit", "exit_code": 0}


async def test_a_bad_or_missing_key_is_a_policy_violation(env):
    sid = await env.create()
    for first in (json.dumps({"api_key": "sl_not_a_key", "cols": 80, "rows": 24}),
                  json.dumps({"cols": 80, "rows": 24}), "not json", b"\x00binary"):
        async with env.ws(sid) as ws:
            await ws.send(first)
            code, error = await refused(ws)
        assert code == 1008 and error["type"] == "AuthenticationError", (first, error)
        assert ws.close_reason == error["message"][:123]
    assert env.runtime.vms[sid].agent.procs == {}  # nothing started


async def test_another_tenants_sandbox_is_not_found(env):
    sid = await env.create("a")
    for key, target in ((env.keys["b"], sid), (env.keys["a"], "sb-0123456789")):
        async with env.ws(target) as ws:
            await ws.send(json.dumps({"api_key": key}))
            code, error = await refused(ws)
        assert code == 4404 and error["type"] == "NotFoundError", error
    assert env.runtime.vms[sid].agent.procs == {}


async def test_bad_requests_are_said_and_close_4400(env):
    sid = await env.create()
    async with env.ws(sid) as ws:
        await ws.send(json.dumps({"api_key": env.keys["a"], "cols": 0, "shell": "zsh"}))
        code, error = await refused(ws)
    assert code == 4400 and "cols" in error["message"] and "shell" in error["message"]
    async with env.ws(sid) as ws:
        pid = await opened(ws, env.keys["a"], cmd="cat")
        await ws.send(json.dumps({"type": "resize", "cols": 5000, "rows": 1}))
        code, error = await refused(ws)
    assert code == 4400 and "cols" in error["message"]
    async with env.ws(sid) as ws:
        await ws.send(json.dumps({"api_key": env.keys["a"], "pid": pid, "cmd": "sh"}))
        code, error = await refused(ws)
    assert code == 4400 and "cmd" in error["message"]
    async with env.ws(sid) as ws:
        await ws.send(json.dumps({"api_key": env.keys["a"], "pid": 99999}))
        code, error = await refused(ws)
    assert code == 4404 and "99999" in error["message"]
    async with env.ws(sid) as ws:  # the terminal outlived the bad messages
        assert await opened(ws, env.keys["a"], pid=pid) == pid
        await ws.send(json.dumps({"type": "title", "text": "x"}))
        code, error = await refused(ws)
    assert code == 4400 and "resize" in error["message"]


async def test_a_refused_call_is_said_and_the_terminal_goes_on(env):
    """A resize of a process that has no terminal: an error message, not the end."""
    sid = await env.create()
    auth = {"authorization": f"Bearer {env.keys['a']}"}
    r = await env.http.post(f"/v1/sandboxes/{sid}/commands", headers=auth,
                            json={"cmd": "cat", "background": True})
    pid = r.json()["pid"]
    async with env.ws(sid) as ws:
        await opened(ws, env.keys["a"], pid=pid)
        await ws.send(json.dumps({"type": "resize", "cols": 10, "rows": 10}))
        said = json.loads(await ws.recv())
        assert said["type"] == "error" and "no terminal" in said["error"]["message"]
        await ws.send(b"still here")
        await env.http.post(f"/v1/sandboxes/{sid}/commands/{pid}/stdin", json={"eof": True},
                            headers=auth)
        assert await ws.recv() == b"still here"
        assert json.loads(await ws.recv()) == {"type": "exit", "exit_code": 0}


async def test_a_terminal_of_a_sandbox_on_another_host(tmp_path, postgres):
    """Two hosts of a deployment: a socket opened on one reaches the sandbox the other runs
    (relayed with its first message; the owner authenticates it)."""
    database = postgres.new_database("pty" + secrets.token_hex(4))
    socks = [loopback_socket(), loopback_socket()]  # bound now: the hosts advertise them
    ports = [sock.getsockname()[1] for sock in socks]
    apps = []
    for i, port in enumerate(ports):
        apps.append(await new_env(tmp_path / f"h{i}", database_url=database, host_id=f"h-{i}",
                                  advertise_url=f"http://127.0.0.1:{port}",
                                  store=str(tmp_path / "store")))
    async with serving(apps[0][0], socks[0]), serving(apps[1][0], socks[1]):
        keys = {"a": "sl_pty_a", "b": "sl_pty_b"}
        for tenant, key in keys.items():
            await apps[0][0].state.core.db.add_key(key, tenant)
        here, there = (Env(*apps[i], ports[i], keys) for i in (0, 1))
        sid = await there.create()
        assert sid in apps[1][0].state.core.sandboxes.live
        async with here.ws(sid) as ws:
            await opened(ws, keys["a"], cmd="echo far")
            assert await ws.recv() == b"far\n"
            assert json.loads(await ws.recv()) == {"type": "exit", "exit_code": 0}
            with pytest.raises(ConnectionClosed):
                await ws.recv()
        assert ws.close_code == 1000
        async with here.ws(sid) as ws:  # another tenant's, as on the host that runs it
            await ws.send(json.dumps({"api_key": keys["b"]}))
            code, _ = await refused(ws)
        assert code == 4404
        async with here.ws(sid) as ws:
            await ws.send(json.dumps({"api_key": "sl_nope"}))
            code, _ = await refused(ws)
        assert code == 1008
        for e in (here, there):
            await e.http.aclose()


async def test_a_terminal_that_wakes_a_sandbox_placed_on_another_host(env, monkeypatch):
    """A terminal is a use: it resumes an auto-resume sandbox where a REST resume would
    (here: another host, this one has no room); the socket is then refused, to be opened
    again (it is relayed to that host then). With room here after all, it opens here."""
    core = env.app.state.core
    r = await env.http.post("/v1/sandboxes", json={"template": "base", "auto_resume": True},
                            headers={"authorization": f"Bearer {env.keys['a']}"})
    sid = r.json()["sandbox_id"]
    r = await env.http.post(f"/v1/sandboxes/{sid}/pause",
                            headers={"authorization": f"Bearer {env.keys['a']}"})
    assert r.status_code == 200
    asked = []

    class Peers:
        full = False

        async def resume(self, host, sandbox_id, timeout, reboot, who):
            asked.append((host.id, sandbox_id, who.tenant))
            if self.full:
                raise CapacityError(f"{host.id} is full")
            return SandboxRecord(sandbox_id=sandbox_id, memory_mb=512, cpus=1, host=host.id,
                                 state="running")

    async def place(need):
        return [HostInfo(id="p2", url="http://p2", state=HostState.ACTIVE, slots=4),
                HostInfo(id=core.host_id, url="", state=HostState.ACTIVE, slots=4)]

    peers = Peers()
    monkeypatch.setattr(Hosts, "shared", property(lambda self: True))
    monkeypatch.setattr(core.hosts, "place", place)
    core.placement.peers = peers
    async with env.ws(sid) as ws:
        await ws.send(json.dumps({"api_key": env.keys["a"], "cmd": "echo hi"}))
        code, error = await refused(ws)
    assert code == 4503 and "resumed on host p2" in error["message"]
    assert asked == [("p2", sid, "a")] and sid not in core.sandboxes.live
    peers.full = True  # no room there after all: the next host, this one
    async with env.ws(sid) as ws:
        await opened(ws, env.keys["a"], cmd="echo hi")
        assert await ws.recv() == b"hi\n"
    assert asked[-1] == ("p2", sid, "a") and sid in core.sandboxes.live
