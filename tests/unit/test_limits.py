"""Inputs are checked at the edge, in process on the fake runtime: what the guest agent could
not carry, what would bloat every list, and bodies over the limit get a typed 4xx with a
message, and no VM; exposed ports are bounded per sandbox; the host ends a command the guest
does not end past its timeout; a pooled VM whose claim fails never lives on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from sandlot.config import Limits
from sandlot.core.tenancy import SYSTEM
from sandlot.errors import ERRORS, GuestError, InvalidArgumentError, PayloadTooLargeError
from sandlot.sdk._base import error_from_response
from sandlot.testing import in_process

MiB = 1 << 20


@pytest.fixture
async def api(tmp_path, request):
    settings = getattr(request, "param", {})
    async with in_process(tmp_path, **settings) as srv:
        async with httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url,
                                     headers={"authorization": f"Bearer {srv.key}"}) as http:
            http.srv = srv
            yield http


def refused(r: httpx.Response, status: int = 400, kind: str = "InvalidArgumentError",
            says: str = "") -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind, error
    assert says in error["message"], error


async def sandbox(api) -> str:
    r = await api.post("/v1/sandboxes", json={})
    assert r.status_code == 201, r.text
    return r.json()["sandbox_id"]


async def test_create_refuses_env_the_guest_cannot_take(api) -> None:
    cases = [({"A": "x" * MiB}, "limit"), ({"A\0": "1"}, "not a valid variable name"),
             ({"1A": "1"}, "not a valid variable name"), ({"A": "1\0"}, "NUL"),
             ({"A-B": "1"}, "not a valid variable name"),
             ({f"K{i}": "x" * 1000 for i in range(300)}, "the limit is"),
             ({"A": "\x01" * 100_000}, "the limit is 262144")]  # 600 KB as JSON
    for env, says in cases:
        refused(await api.post("/v1/sandboxes", json={"env": env}), says=says)
        refused(await api.post("/v1/snapshots/any/restore", json={"env": env}), says=says)
    assert api.srv.runtime.vms == {}  # no VM was started for any of them
    assert (await api.get("/v1/sandboxes", params={"all": True})).json()["sandboxes"] == []


async def test_metadata_is_bounded(api) -> None:
    for metadata, says in [({f"k{i}": "v" for i in range(65)}, "65 keys"),
                           ({"k": "v" * 5000}, "the limit is 4096"),
                           ({"k" * 300: "v"}, "the limit is 256"),
                           ({f"k{i}": "v" * 4000 for i in range(10)}, "metadata is")]:
        refused(await api.post("/v1/sandboxes", json={"metadata": metadata}), says=says)
    huge = {f"k{i}": "v" * 1000 for i in range(50_000)}  # ~50 MB
    refused(await api.post("/v1/sandboxes", json={"metadata": huge}), 413,
            "PayloadTooLargeError", "SANDLOT_MAX_BODY_BYTES")
    ok = {f"k{i}": "v" * 400 for i in range(64)}
    r = await api.post("/v1/sandboxes", json={"metadata": ok})
    assert r.status_code == 201 and r.json()["metadata"] == ok
    assert len((await api.get("/v1/sandboxes")).content) < 64 << 10


async def test_commands_refuse_what_the_guest_cannot_take(api) -> None:
    sid = await sandbox(api)
    url = f"/v1/sandboxes/{sid}/commands"
    for body, says in [({"cmd": "echo " + "x" * (200 << 10)}, "cmd is"),
                       ({"cmd": "echo a\0b"}, "NUL"),
                       ({"cmd": "true", "env": {"A": "b\0"}}, "NUL"),
                       ({"cmd": "true", "env": {"A=B": "1"}}, "variable name"),
                       ({"cmd": "true", "cwd": "/tm\0p"}, "NUL"),
                       ({"cmd": "true", "cwd": "/" + "d" * 5000}, "cwd is"),
                       ({"cmd": "true", "user": "ro\0ot"}, "NUL"),
                       ({"cmd": "cat", "stdin": "x" * (2 * MiB)}, "stdin is"),
                       ({"cmd": "cat", "stdin": "x" * (2 * MiB), "background": True},
                        "stdin is")]:
        refused(await api.post(url, json=body), says=says)
    r = await api.post(url, json={"cmd": "sleep 5", "background": True})
    pid = r.json()["pid"]
    refused(await api.post(f"{url}/{pid}/stdin", json={"data": "x" * (2 * MiB)}),
            says="stdin is")
    r = await api.post(url, json={"cmd": "cat", "stdin": "y" * MiB})
    out = "".join(json.loads(line).get("data", "") for line in r.text.splitlines())
    assert r.status_code == 200 and out == "y" * MiB


@pytest.mark.parametrize("api", [{"limits": Limits(list_entries=3)}], indirect=True)
async def test_listing_depth_and_size_are_bounded(api) -> None:
    sid = await sandbox(api)
    url = f"/v1/sandboxes/{sid}/files"
    for depth in (10**9, 33, 0, -1):
        refused(await api.get(f"{url}/list", params={"path": "/", "depth": depth}),
                says="depth must be between 1 and 32")
    refused(await api.get(f"{url}/list", params={"path": "/tm\0p"}), says="NUL")
    refused(await api.get(f"{url}/stat", params={"path": "/" + "p" * 5000}), says="path is")
    r = await api.get(f"{url}/list", params={"path": "/", "depth": 1})
    assert r.status_code == 200 and len(r.json()["entries"]) == 3  # /home /root /tmp
    await api.put(url, params={"path": "/tmp/a"}, content=b"1")
    refused(await api.get(f"{url}/list", params={"path": "/", "depth": 32}),
            says="listing too large")


@pytest.mark.parametrize("api", [{"limits": Limits(ports=3)}], indirect=True)
async def test_exposed_ports_are_bounded_per_sandbox(api) -> None:
    calls = []
    expose = api.srv.runtime.expose

    async def counting(vm, port):
        calls.append(port)
        return await expose(vm, port)

    api.srv.runtime.expose = counting
    sid, other = await sandbox(api), await sandbox(api)
    first = (await api.post(f"/v1/sandboxes/{sid}/ports", json={"port": 8000})).json()
    again = await asyncio.gather(*(api.post(f"/v1/sandboxes/{sid}/ports", json={"port": 8000})
                                   for _ in range(5)))
    assert all(r.json() == first for r in again)
    assert calls == [8000]  # one listener per port
    for port in (8001, 8002):
        assert (await api.post(f"/v1/sandboxes/{sid}/ports", json={"port": port})
                ).status_code == 200
    refused(await api.post(f"/v1/sandboxes/{sid}/ports", json={"port": 8003}),
            says="already exposes 3 ports")
    assert (await api.post(f"/v1/sandboxes/{sid}/ports", json={"port": 8001})).status_code == 200
    assert (await api.post(f"/v1/sandboxes/{other}/ports", json={"port": 8003})
            ).status_code == 200
    assert sorted(calls) == [8000, 8001, 8002, 8003]


async def test_request_bodies_are_bounded(api) -> None:
    big = json.dumps({"metadata": {"k": "v" * (9 * MiB)}}).encode()
    r = await api.post("/v1/sandboxes", content=big,
                       headers={"content-type": "application/json"})
    refused(r, 413, "PayloadTooLargeError", "the limit is 8388608")

    async def chunks():  # no Content-Length: counted as it streams in
        for i in range(0, len(big), MiB):
            yield big[i : i + MiB]

    r = await api.post("/v1/sandboxes", content=chunks(),
                       headers={"content-type": "application/json"})
    refused(r, 413, "PayloadTooLargeError")
    sid = await sandbox(api)  # file uploads stream to the guest: not bounded by it
    r = await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/big"},
                      content=b"z" * (9 * MiB))
    assert r.status_code == 200 and r.json()["size"] == 9 * MiB
    body = {"error": {"type": "PayloadTooLargeError", "message": "too big"}}
    error = error_from_response(413, json.dumps(body).encode())
    assert isinstance(error, PayloadTooLargeError) and isinstance(error, InvalidArgumentError)
    assert ERRORS["PayloadTooLargeError"] is PayloadTooLargeError


@pytest.mark.parametrize("api", [{"command_grace": 0.5}], indirect=True)
async def test_the_host_ends_a_command_the_guest_does_not_end(api) -> None:
    sid = await sandbox(api)
    url = f"/v1/sandboxes/{sid}/commands"
    t0 = time.monotonic()
    r = await api.post(url, json={"cmd": "hang", "timeout": 1})
    elapsed = time.monotonic() - t0
    assert r.status_code == 200
    last = json.loads(r.text.splitlines()[-1])
    assert last["type"] == "error" and last["error"]["type"] == "CommandTimeoutError", r.text
    assert "unresponsive" in last["error"]["message"]
    # ended, not left to hang: the host's deadline is timeout + grace (1 + 0.5 s); 10x that
    assert elapsed < 10 * (1 + 0.5), elapsed
    info = (await api.get(f"/v1/sandboxes/{sid}")).json()
    assert info["error"].startswith("unresponsive: ")
    r = await api.post(url, json={"cmd": "echo still here"})
    assert '"still here\\n"' in r.text and '"exit_code":0' in r.text
    assert (await api.get(f"/v1/sandboxes/{sid}")).json()["error"] is None
    assert (await api.delete(f"/v1/sandboxes/{sid}")).status_code == 204


class _Agent:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def configure(self, configure):
        raise self.error


@pytest.mark.parametrize("error", [ValueError("frame too large"), GuestError("gone"),
                                   InvalidArgumentError("too large for the agent")])
async def test_a_failed_claim_kills_the_pooled_vm(tmp_path, error) -> None:
    from sandlot.runtime.base import MachinePlan
    from sandlot.runtime.qemu import QemuRuntime
    from sandlot.runtime.qemu_vm import QemuVm
    from sandlot.testing import fake_settings

    runtime = QemuRuntime(fake_settings(tmp_path, pool_size=1))
    vm = QemuVm.__new__(QemuVm)
    vm.id, vm.cpus = "sb-pooled", 1

    async def guest():
        return _Agent(error)

    vm.guest = guest
    killed = []

    async def kill(v):
        killed.append(v)

    runtime.kill = kill
    runtime.pool.take = lambda image: vm
    image = type("I", (), {"machine": type("M", (), {"memory_mb": 512})()})()
    plan = MachinePlan(cpus=1, memory_mb=512, env={"A": "1"}, generation="g")
    if isinstance(error, GuestError):
        assert await runtime.claim(image, plan) is None  # the caller restores one instead
    else:
        with pytest.raises(type(error)):
            await runtime.claim(image, plan)
    assert killed == [vm]


@pytest.mark.parametrize("api", [{"limits": Limits(streams=2)}], indirect=True)
async def test_open_streams_are_bounded_per_sandbox(api) -> None:
    sid, other = await sandbox(api), await sandbox(api)
    url = f"/v1/sandboxes/{sid}/commands"
    await api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"}, content=b"data")
    running = [asyncio.create_task(api.post(url, json={"cmd": "sleep 1"})) for _ in range(2)]
    await asyncio.sleep(0.3)
    r = await api.post(url, json={"cmd": "true"})
    refused(r, 409, "InvalidStateError", "2 streams open")
    refused(await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"}), 409,
            "InvalidStateError", "SANDLOT_MAX_STREAMS")
    r = await api.post(f"/v1/sandboxes/{other}/commands", json={"cmd": "echo other"})
    assert r.status_code == 200 and "other" in r.text
    assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
    for _ in range(3):  # every stream closed gives its slot back
        assert (await api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"})
                ).content == b"data"
        assert (await api.post(url, json={"cmd": "true"})).status_code == 200
    _, chunks = await api.srv.core.files.read(sid, "/tmp/f", who=SYSTEM)  # opened, never read
    del chunks
    assert api.srv.core.sandboxes.live[sid].streams == 0


@pytest.mark.parametrize("api", [{"command_grace": 0.2}], indirect=True)
async def test_a_slow_reader_of_a_command_that_ended_in_time_gets_no_timeout(api) -> None:
    from sandlot.core.commands import Exited, Output
    from sandlot.core.models import ExecRequest

    sid = await sandbox(api)
    events = api.srv.core.commands.run(sid, ExecRequest(cmd="echo a; echo b", timeout=0.5),
                                       who=SYSTEM)
    await anext(events)
    await asyncio.sleep(1.5)  # the reader comes back well past timeout + grace
    rest = [e async for e in events]
    assert [e.data for e in rest if isinstance(e, Output)] == [b"a\n", b"b\n"]
    assert rest[-1] == Exited(0, False)
    assert (await api.srv.core.sandboxes.get(sid, SYSTEM)).error is None


@pytest.mark.parametrize("api", [{"stream_keepalive": 0.2}], indirect=True)
async def test_a_silent_command_stream_gets_keepalive_lines(api) -> None:
    """Clients and proxies drop a response that stays silent too long (Node's fetch after
    300 s): while a command prints nothing, its stream carries keepalive lines, which the
    SDKs skip."""
    from sandlot.sdk._base import CommandStream

    sid = await sandbox(api)
    r = await api.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": "sleep 1; echo done"})
    kinds = [json.loads(line)["type"] for line in r.text.splitlines()]
    assert kinds[0] == "start" and kinds[-2:] == ["stdout", "exit"], kinds
    assert kinds.count("keepalive") >= 3, kinds
    parsed = CommandStream()
    for line in r.text.splitlines():
        parsed.feed(line)
    assert parsed.exit_code == 0 and "".join(parsed._stdout) == "done\n"


@pytest.mark.parametrize("api", [{"limits": Limits(key_sandboxes=2, key_ports=3, key_streams=2)}],
                         indirect=True)
async def test_each_api_key_has_limits_of_its_own(api) -> None:
    """Sandboxes (forks included), exposed ports and open streams per API key: one key at
    its limits leaves another key's room untouched."""
    other_key = await api.srv.add_key("other")
    other = {"authorization": f"Bearer {other_key}"}
    a1, a2 = await sandbox(api), await sandbox(api)
    refused(await api.post("/v1/sandboxes", json={"template": "base"}), 503, "CapacityError",
            "SANDLOT_MAX_KEY_SANDBOXES")
    refused(await api.post(f"/v1/sandboxes/{a1}/fork", json={"count": 1}), 503,
            "CapacityError", "this tenant runs 2 sandboxes")
    r = await api.post("/v1/sandboxes", json={"template": "base"}, headers=other)
    assert r.status_code == 201, r.text
    b1 = r.json()["sandbox_id"]

    for sid, port in ((a1, 8000), (a1, 8001), (a2, 8000)):
        assert (await api.post(f"/v1/sandboxes/{sid}/ports", json={"port": port})
                ).status_code == 200
    refused(await api.post(f"/v1/sandboxes/{a2}/ports", json={"port": 8001}),
            says="SANDLOT_MAX_KEY_PORTS")
    assert (await api.post(f"/v1/sandboxes/{b1}/ports", json={"port": 8001}, headers=other)
            ).status_code == 200

    running = [asyncio.create_task(api.post(f"/v1/sandboxes/{sid}/commands",
                                            json={"cmd": "sleep 1"})) for sid in (a1, a2)]
    await asyncio.sleep(0.3)
    refused(await api.post(f"/v1/sandboxes/{a1}/commands", json={"cmd": "true"}), 409,
            "InvalidStateError", "SANDLOT_MAX_KEY_STREAMS")
    r = await api.post(f"/v1/sandboxes/{b1}/commands", json={"cmd": "echo b"}, headers=other)
    assert r.status_code == 200 and "b" in r.text
    assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
    assert (await api.post(f"/v1/sandboxes/{a1}/commands", json={"cmd": "true"})
            ).status_code == 200
    assert api.srv.core.sandboxes.key_streams.open == {}

    # A sandbox that goes makes room for its key again.
    assert (await api.delete(f"/v1/sandboxes/{a2}")).status_code == 204
    assert (await api.post(f"/v1/sandboxes/{a1}/fork", json={"count": 1})).status_code == 200


@pytest.mark.parametrize("api", [{"limits": Limits(disk_mb=4096)}], indirect=True)
async def test_a_sandboxs_disk_is_asked_within_the_limit_and_reported(api) -> None:
    refused(await api.post("/v1/sandboxes", json={"disk_mb": 8192}),
            says="SANDLOT_MAX_DISK_MB")
    refused(await api.post("/v1/sandboxes", json={"disk_mb": 1}), says="disk_mb")
    assert api.srv.runtime.vms == {}
    r = await api.post("/v1/sandboxes", json={"disk_mb": 3072})
    assert r.status_code == 201 and r.json()["disk_mb"] == 3072, r.text
    sid = r.json()["sandbox_id"]
    forked = (await api.post(f"/v1/sandboxes/{sid}/fork", json={"count": 1})).json()
    assert [c["disk_mb"] for c in forked["sandboxes"]] == [3072]
    metrics = (await api.get(f"/v1/sandboxes/{sid}/metrics")).json()["metrics"]
    assert metrics[-1]["disk_total"] == 3072 * MiB
