"""Hostile inputs and guests against a real server and real VMs: requests the guest agent
could not carry are refused before a VM starts, a listing of the whole guest is bounded, a
guest too busy to answer (a fork bomb) cannot hold a command past its timeout, and a client
that reads one command's output slowly holds back no other command of that sandbox."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from harness import qemu_pids
from sandlot import CommandTimeoutError

MiB = 1 << 20


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=120,
                        headers={"authorization": f"Bearer {server.key}"})


def refused(r: httpx.Response, status: int = 400, says: str = "") -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] in ("InvalidArgumentError", "PayloadTooLargeError")
    assert says in r.json()["error"]["message"], r.text


def test_inputs_over_the_limits_start_no_vm_and_reach_no_guest(own_server):
    """own_server has no warm pool: every QEMU under it is accounted for."""
    api = http(own_server)
    pids = set(qemu_pids(own_server.run_root))
    for body, status, says in [
        ({"env": {"A": "x" * MiB}}, 400, "limit"),
        ({"env": {"A\0": "1"}}, 400, "variable name"),
        ({"env": {"A": "1\0"}}, 400, "NUL"),
        ({"metadata": {f"k{i}": "v" * 1000 for i in range(50_000)}}, 413, "limit"),
        ({"metadata": {f"k{i}": "v" for i in range(100)}}, 400, "keys"),
    ]:
        for _ in range(2):
            refused(api.post("/v1/sandboxes", json=body), status, says)
    assert set(qemu_pids(own_server.run_root)) == pids
    assert api.get("/v1/sandboxes", params={"all": True}).json()["sandboxes"] == []

    sid = api.post("/v1/sandboxes", json={}).json()["sandbox_id"]
    try:
        url = f"/v1/sandboxes/{sid}/commands"
        for body, says in [({"cmd": "echo " + "x" * MiB}, "cmd is"),
                           ({"cmd": "echo a\0b"}, "NUL"),
                           ({"cmd": "true", "env": {"A": "b\0"}}, "NUL"),
                           ({"cmd": "true", "cwd": "/tm\0p"}, "NUL"),
                           ({"cmd": "cat", "stdin": "x" * (5 * MiB)}, "stdin is")]:
            refused(api.post(url, json=body), says=says)
        r = api.post(url, json={"cmd": "wc -c", "stdin": "y" * MiB})
        assert '"1048576\\n"' in r.text, r.text

        refused(api.get(f"/v1/sandboxes/{sid}/files/list",
                        params={"path": "/", "depth": 10**9}), says="depth")
        # The whole guest file system, /proc and /sys included: the agent stops early (the
        # refusal is its limit's, not a time-out's).
        refused(api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/", "depth": 32}),
                says="listing too large")
        listed = api.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/", "depth": 1})
        assert listed.status_code == 200 and len(listed.json()["entries"]) > 10
        assert api.post(url, json={"cmd": "true"}).status_code == 200
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("pool", ["0", "1"])
def test_a_create_that_fails_after_its_vm_started_leaves_no_vm(server_factory, pool):
    """With the edge limits raised, an env too large for the agent's frame is refused only
    when it is sent, once a VM runs (a restore, or a claim from the warm pool): that VM must
    go with the request."""
    srv = server_factory(SANDLOT_POOL_SIZE=pool, SANDLOT_MAX_ENV_BYTES=str(8 * MiB),
                         SANDLOT_MAX_BODY_BYTES=str(16 * MiB))
    api = http(srv)

    def settled() -> set[int]:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pools = api.get("/health").json()["pool"]
            pids = set(qemu_pids(srv.run_root))
            if all(p["ready"] == p["size"] for p in pools.values()) and \
                    len(pids) == int(pool):
                return pids
            time.sleep(0.5)
        raise AssertionError(f"the pool did not settle: {api.get('/health').json()}")

    before = settled()
    env = {f"K{i}": "x" * 100_000 for i in range(15)}  # 1.5 MB: over the agent's frame
    for _ in range(3):
        refused(api.post("/v1/sandboxes", json={"env": env}), says="too large")
    after = settled()
    assert len(after) == len(before), (before, after)  # a claimed VM is replaced, not kept
    assert api.get("/v1/sandboxes").json()["sandboxes"] == []
    if pool == "1":
        assert api.get("/health").json()["pool"]["base"]["claimed"] >= 1


def test_a_guest_too_busy_to_answer_cannot_hold_a_command(server, sandbox_factory):
    bomb, other = sandbox_factory(), sandbox_factory()
    # Bounded: `timeout` kills the bomb's process group after 20 s; the sandbox dies below.
    bomb.commands.start("timeout 20 bash -c ':(){ :|:& };:'")
    time.sleep(2)
    t0 = time.monotonic()
    with pytest.raises(CommandTimeoutError) as exc:
        bomb.commands.run("sleep 60", timeout=5)
    took = time.monotonic() - t0
    # ended, not left to hang: the host's deadline is timeout + grace (5 + 5 s); 6x that
    assert took < 6 * (5 + 5), f"the command ended after {took:.1f} s: {exc.value}"
    for _ in range(3):  # the other sandbox still answers (how fast: bench/)
        assert other.commands.run("true", timeout=60).exit_code == 0
    pid = bomb.info.pid
    assert bomb.kill() is True
    assert pid not in qemu_pids(server.run_root)
    assert other.commands.run("echo fine").stdout == "fine\n"


def test_a_slow_reader_holds_back_only_its_own_command(server, sandbox_factory):
    sbx = sandbox_factory()
    url = f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/commands"
    headers = {"authorization": f"Bearer {server.key}"}
    body = {"cmd": "head -c 40000000 /dev/zero | base64 -w 0", "timeout": 300}
    received = 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
        chunks = r.iter_bytes(65536)
        received += len(next(chunks))
        time.sleep(3)  # the command floods; its client reads nothing
        for _ in range(4):
            # held back behind the slow reader, it would end only at its timeout
            assert sbx.commands.run("echo other", timeout=60).stdout == "other\n"
            received += len(next(chunks))  # one chunk a second
            time.sleep(1)
    # The slow stream was closed by its client; the sandbox goes on.
    assert sbx.commands.run("echo after").stdout == "after\n"


def test_a_slow_reader_loses_nothing(server, sandbox_factory):
    sbx = sandbox_factory()
    url = f"{server.url}/v1/sandboxes/{sbx.sandbox_id}/commands"
    headers = {"authorization": f"Bearer {server.key}"}
    body = {"cmd": "head -c 20000000 /dev/zero | base64 -w 0; echo; echo done", "timeout": 300}
    out = []
    done = threading.Event()

    def others():
        while not done.is_set():
            assert sbx.commands.run("true", timeout=30).exit_code == 0

    helper = threading.Thread(target=others, daemon=True)
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
        helper.start()
        for i, line in enumerate(r.iter_lines()):
            if i < 20:
                time.sleep(0.2)
            event = json.loads(line)
            if event["type"] == "stdout":
                out.append(event["data"])
            last = event
    done.set()
    helper.join(30)
    text = "".join(out)
    assert last == {"type": "exit", "exit_code": 0}, last
    assert text.endswith("\ndone\n") and len(text) == 26666668 + 6, len(text)
