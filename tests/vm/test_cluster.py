"""sandlot on several hosts: three `sandlot serve` processes, each with its own data dir and
instance, sharing a real PostgreSQL and a real S3 store (both started by the tests on
loopback). Any host's API serves every sandbox; snapshots restore and fork on other hosts; a
full host's fork children go elsewhere; a killed host's sandboxes are reported lost, its
snapshots stay restorable, and it cleans up when it comes back."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from snapkit import ask, start_holder, wait_for
from websockets.sync.client import connect

from harness import cleanup, start_cluster, tenant_key
from sandlot import Sandbox, Sandlot
from sandlot.errors import CapacityError

HOSTS = ("a", "b", "c")
A_SLOTS = 2  # host a is small: a fork there must spread
HOST_TIMEOUT = 15  # silence before a host is lost: a live host on a loaded machine never is
DOMAIN = "cluster.test"  # of port URLs (<port>-<sandbox id>.DOMAIN), sent as the Host header


@pytest.fixture(scope="module")
def cluster(s3, postgres, tmp_path_factory):
    hosts = start_cluster(s3, postgres, tmp_path_factory,
                          {name: A_SLOTS if name == "a" else 8 for name in HOSTS}, "cluster",
                          SANDLOT_HEARTBEAT="1", SANDLOT_HOST_TIMEOUT=str(HOST_TIMEOUT),
                          SANDLOT_E2B_DOMAIN=DOMAIN)
    yield hosts
    for srv in hosts.values():
        cleanup(srv)


def client(srv) -> Sandlot:
    return Sandlot(**srv.client_kwargs())


def through(srv, sandbox_id: str) -> Sandbox:
    return Sandbox.connect(sandbox_id, **srv.client_kwargs())


def test_every_host_is_listed_with_its_capacity(cluster) -> None:
    hosts = {h.id: h for h in client(cluster["b"]).hosts.list()}
    assert set(hosts) == {"host-a", "host-b", "host-c"}
    for name, srv in cluster.items():
        h = hosts[f"host-{name}"]
        assert h.state == "active" and h.url == srv.url and h.cores >= 1
        assert h.slots == (A_SLOTS if name == "a" else 8) and h.memory_free_mb > 0


def test_a_host_drained_or_activated_through_any_host_stays_so(cluster) -> None:
    b, c = client(cluster["b"]), client(cluster["c"])
    assert b.hosts.drain("host-a").state == "draining"
    time.sleep(2.5)  # heartbeats of every host, host a's too
    assert {h.id: h.state for h in c.hosts.list()}["host-a"] == "draining"
    assert c.hosts.activate("host-a").state == "active"
    time.sleep(2.5)
    assert {h.id: h.state for h in b.hosts.list()}["host-a"] == "active"


def test_a_sandbox_is_used_through_any_host(cluster) -> None:
    sbx = Sandbox.create(timeout=600, **cluster["a"].client_kwargs())
    owner = sbx.info.host
    assert owner in {"host-a", "host-b", "host-c"}
    other = next(srv for name, srv in cluster.items() if f"host-{name}" != owner)
    remote = through(other, sbx.sandbox_id)
    assert remote.info.host == owner
    assert remote.commands.run("echo hello from $(hostname)").stdout.startswith("hello")
    chunks = []
    result = remote.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done",
                                 on_stdout=chunks.append)
    assert result.stdout == "1\n2\n3\n" and "".join(chunks) == "1\n2\n3\n"  # streamed through
    remote.files.write("/root/big.bin", os.urandom(3 << 20))
    assert len(remote.files.read("/root/big.bin", format="bytes")) == 3 << 20
    assert sbx.sandbox_id in {s.sandbox_id for s in client(other).sandboxes.list()}
    # a terminal's WebSocket too: relayed to the owner, which checks the first message's key
    url = other.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sbx.sandbox_id}/pty"
    with connect(url, open_timeout=60) as ws:
        ws.send(json.dumps({"api_key": other.key, "cmd": "echo far-$((2 * 21)); exit 6"}))
        frames = []
        while not isinstance(frame := ws.recv(timeout=60), str) or '"exit"' not in frame:
            frames.append(frame)
    assert b"far-42" in b"".join(f for f in frames if isinstance(f, bytes))
    assert json.loads(frame) == {"type": "exit", "exit_code": 6}
    remote.kill()
    assert client(cluster["c"]).sandboxes.get_info(sbx.sandbox_id).state == "stopped"


def test_the_e2b_sdk_works_through_a_host_that_does_not_run_the_sandbox(cluster) -> None:
    import e2b

    def opts(srv) -> dict:
        return {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd",
                "api_key": srv.key}

    sbx = e2b.Sandbox.create("base", timeout=600, **opts(cluster["a"]))
    owner = client(cluster["a"]).sandboxes.get_info(sbx.sandbox_id).host
    other = next(srv for name, srv in cluster.items() if f"host-{name}" != owner)
    remote = e2b.Sandbox.connect(sbx.sandbox_id, **opts(other))
    assert remote.commands.run("echo e2b").stdout == "e2b\n"
    remote.files.write("/root/e2b.txt", "through another host")
    assert remote.files.read("/root/e2b.txt") == "through another host"
    url = remote.download_url("/root/e2b.txt", use_signature_expiration=60)
    assert httpx.get(url).text == "through another host"  # signed, naming no sandbox
    assert sbx.sandbox_id in {i.sandbox_id for i in e2b.Sandbox.list(**opts(other)).next_items()}
    remote.kill()


def test_a_snapshot_taken_on_one_host_restores_and_forks_on_another(cluster) -> None:
    a, b = cluster["a"], cluster["b"]
    src = Sandbox.create(timeout=600, **a.client_kwargs())
    answer = start_holder(src)
    src.files.write("/root/state.txt", "from " + src.info.host)
    snap = src.create_snapshot(name="cl-shared").wait()
    taker = src.info.host
    src.kill()
    others = [f"host-{n}" for n in HOSTS if f"host-{n}" != "host-b"]
    c = client(b)
    for h in others:  # only b takes new sandboxes now
        c.hosts.drain(h)
    try:
        restored = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=600, **a.client_kwargs())
        assert restored.info.host == "host-b" != taker
        assert restored.files.read("/root/state.txt") == "from " + taker
        assert ask(restored).memory == answer.memory  # exactly where it was
        kids = restored.fork(2)
        assert {k.info.host for k in kids} == {"host-b"}
        assert {k.files.read("/root/state.txt") for k in kids} == {"from " + taker}
    finally:
        for h in others:
            c.hosts.activate(h)
    for box in (*kids, restored):
        box.kill()
    snap.remove()


def test_a_request_no_host_can_take_names_what_is_missing(cluster) -> None:
    c = client(cluster["c"])
    for h in ("host-a", "host-b", "host-c"):
        c.hosts.drain(h)
    try:
        with pytest.raises(CapacityError) as e:
            Sandbox.create(timeout=60, **cluster["c"].client_kwargs())
    finally:
        for h in ("host-a", "host-b", "host-c"):
            c.hosts.activate(h)
    assert "no host can take" in str(e.value)
    assert all(f"host-{n}: draining" in str(e.value) for n in HOSTS)


def test_a_full_hosts_fork_children_start_elsewhere(cluster) -> None:
    a = cluster["a"]
    for h in ("host-b", "host-c"):  # the parent and its neighbour land on a
        client(a).hosts.drain(h)
    try:
        parent = Sandbox.create(timeout=600, **a.client_kwargs())
        neighbour = Sandbox.create(timeout=600, **a.client_kwargs())
        assert {parent.info.host, neighbour.info.host} == {"host-a"}  # a is full now
    finally:
        for h in ("host-b", "host-c"):
            client(a).hosts.activate(h)
    parent.files.write("/root/state.txt", "parent's")
    kids = parent.fork(4)
    assert len(kids) == 4
    assert all(k.info.host in ("host-b", "host-c") for k in kids)
    assert {k.info.forked_from for k in kids} == {parent.sandbox_id}
    assert {k.files.read("/root/state.txt") for k in kids} == {"parent's"}
    assert parent.commands.run("cat /root/state.txt").stdout == "parent's"  # untouched
    # the snapshot the children came from is not listed, and is gone
    assert [s for s in client(a).snapshots.list() if s.sandbox_id == parent.sandbox_id] == []
    for box in (*kids, parent, neighbour):
        box.kill()



def test_tenants_keep_to_their_own_on_every_host(cluster) -> None:
    """A tenant's sandbox on one host, its fork children spread to others: another tenant
    finds none of them through any host; the tenant and the admin find all."""
    a = cluster["a"]
    keys = {t: tenant_key(a, t) for t in ("ta", "tb")}

    def as_(tenant: str, srv) -> dict:
        return {"api_url": srv.url, "api_key": keys[tenant]}

    for h in ("host-b", "host-c"):  # the parent and its neighbour land on a (then full)
        client(a).hosts.drain(h)
    try:
        parent = Sandbox.create(timeout=600, **as_("ta", a))
        neighbour = Sandbox.create(timeout=600, **as_("ta", a))
    finally:
        for h in ("host-b", "host-c"):
            client(a).hosts.activate(h)
    parent.files.write("/root/t.txt", "ta's")
    kids = parent.fork(2)
    assert len(kids) == 2 and all(k.info.host in ("host-b", "host-c") for k in kids)
    mine = {parent.sandbox_id, neighbour.sandbox_id} | {k.sandbox_id for k in kids}
    for name, srv in cluster.items():
        assert {s.sandbox_id for s in Sandlot(**as_("tb", srv)).sandboxes.list()} & mine == set()
        assert {s.sandbox_id for s in Sandlot(**as_("ta", srv)).sandboxes.list()} >= mine
        assert {s.sandbox_id for s in client(srv).sandboxes.list()} >= mine  # the admin
        for sid in mine:  # forwarded to the host that runs it, and refused there
            r = httpx.get(f"{srv.url}/v1/sandboxes/{sid}/files", params={"path": "/root/t.txt"},
                          headers={"authorization": f"Bearer {keys['tb']}"})
            assert r.status_code == 404, (name, sid, r.text)
    assert {k.files.read("/root/t.txt") for k in kids} == {"ta's"}
    r = httpx.post(f"{cluster['b'].url}/v1/sandboxes/{parent.sandbox_id}/fork",
                   json={"count": 1}, headers={"authorization": f"Bearer {keys['tb']}"})
    assert r.status_code == 404
    for box in (*kids, parent, neighbour):
        box.kill()


def test_a_paused_sandbox_resumes_on_another_host(cluster) -> None:
    a = cluster["a"]
    for h in ("host-b", "host-c"):
        client(a).hosts.drain(h)
    try:
        sbx = Sandbox.create(timeout=600, **a.client_kwargs())
    finally:
        for h in ("host-b", "host-c"):
            client(a).hosts.activate(h)
    sbx.files.write("/root/state.txt", "paused on a")
    sbx.pause()
    client(a).hosts.drain("host-a")  # it must come back elsewhere
    try:
        resumed = through(cluster["b"], sbx.sandbox_id).resume()
        assert resumed.info.host in ("host-b", "host-c")
        assert resumed.files.read("/root/state.txt") == "paused on a"
    finally:
        client(a).hosts.activate("host-a")
    resumed.kill()


def test_a_use_of_a_paused_sandbox_resumes_it_where_placement_says(cluster) -> None:
    """An auto-resume sandbox paused on a host that then has no room: a request to its port
    URL through that host, and later a call that uses it, each resume it on another host
    (as a resume through the API would), where the request is answered."""
    a = cluster["a"]
    for h in ("host-b", "host-c"):
        client(a).hosts.drain(h)
    try:
        sbx = Sandbox.create(timeout=600, auto_resume=True, **a.client_kwargs())
    finally:
        for h in ("host-b", "host-c"):
            client(a).hosts.activate(h)
    sid = sbx.sandbox_id
    sbx.files.write("/root/www/index.html", "served from the sandbox")
    sbx.commands.run("cd /root/www && exec python3 -m http.server 8000", background=True)
    port_url = {"host": f"8000-{sid}.{DOMAIN}"}
    wait_for(lambda: httpx.get(a.url, headers=port_url, timeout=60).status_code == 200,
             timeout=120)
    sbx.pause()
    client(a).hosts.drain("host-a")  # it must come back elsewhere
    try:
        r = httpx.get(a.url, headers=port_url, timeout=300)  # wakes it, on b or c
        assert r.status_code == 200 and r.text == "served from the sandbox"
        first = client(a).sandboxes.get_info(sid)
        assert first.state == "running" and first.host in ("host-b", "host-c")

        through(a, sid).pause()
        assert client(a).sandboxes.get_info(sid).state == "paused"
        # a call that needs it running, sent to a host that has no room: placed, then
        # answered where it runs
        assert through(a, sid).files.read("/root/www/index.html") == "served from the sandbox"
        again = client(a).sandboxes.get_info(sid)
        assert again.state == "running" and again.host in ("host-b", "host-c")
    finally:
        client(a).hosts.activate("host-a")
    through(a, sid).kill()


def test_a_killed_host_is_lost_and_comes_back_clean(cluster) -> None:
    a, b, c = cluster["a"], cluster["b"], cluster["c"]
    client(a).hosts.drain("host-a")
    client(a).hosts.drain("host-c")
    try:
        on_b = Sandbox.create(timeout=600, **b.client_kwargs())
        doomed = Sandbox.create(timeout=600, **b.client_kwargs())
        on_b.files.write("/root/state.txt", "b's")
        snap = on_b.create_snapshot().wait()
    finally:
        client(a).hosts.activate("host-a")
        client(a).hosts.activate("host-c")
    client(a).hosts.drain("host-b")
    try:
        on_c = Sandbox.create(timeout=600, **c.client_kwargs())  # on a or c
    finally:
        client(a).hosts.activate("host-b")
    assert on_b.info.host == "host-b" and on_c.info.host != "host-b"
    qemu_pid = on_b.info.pid

    b.stop(signal.SIGKILL)
    wait_for(lambda: client(a).sandboxes.get_info(on_b.sandbox_id).state == "lost",
             6 * HOST_TIMEOUT, interval=0.2, what="b's sandbox reported lost")
    hosts = {h.id: h.state for h in client(c).hosts.list()}
    assert hosts["host-b"] == "lost" and hosts["host-a"] == hosts["host-c"] == "active"
    assert on_b.sandbox_id in {s.sandbox_id for s in client(a).sandboxes.list()}
    with pytest.raises(Exception) as e:  # noqa: B017 - the SDK's typed error, whichever
        through(a, on_b.sandbox_id).commands.run("true")
    assert "lost" in str(e.value)
    assert through(a, on_c.sandbox_id).commands.run("echo alive").stdout == "alive\n"
    assert client(c).sandboxes.kill(doomed.sandbox_id)  # a lost sandbox's record is closed
    assert client(a).sandboxes.get_info(doomed.sandbox_id).state == "stopped"
    doomed_pid = doomed.info.pid
    again = Sandbox.create(snapshot_id=snap.snapshot_id, timeout=600, **a.client_kwargs())
    assert again.info.host in ("host-a", "host-c")
    assert again.files.read("/root/state.txt") == "b's"

    b.start(timeout=180)  # comes back: what it left behind goes
    wait_for(lambda: not _alive(qemu_pid), 120, what="the lost sandbox's QEMU gone")
    wait_for(lambda: not _alive(doomed_pid), 120, what="the killed sandbox's QEMU gone")
    assert client(b).sandboxes.get_info(on_b.sandbox_id).state == "stopped"
    wait_for(lambda: {h.id: h.state for h in client(a).hosts.list()}["host-b"] == "active",
             60, what="b active again")
    fresh = Sandbox.create(timeout=600, **b.client_kwargs())
    assert fresh.commands.run("echo ok").stdout == "ok\n"
    for box in (fresh, again, on_c):
        box.kill()
    snap.remove()


def test_an_unknown_host_is_a_404(cluster) -> None:
    r = httpx.get(f"{cluster['a'].url}/v1/hosts/host-none",
                  headers={"authorization": f"Bearer {cluster['a'].key}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sandbox_with_a_volume_stays_on_the_volumes_host(cluster) -> None:
    """A volume made through host a lives there: a sandbox that mounts it, created and
    resumed through host b, runs on a, and its mount works; with a draining, the resume
    through b is refused naming it (never placed elsewhere) and the sandbox stays paused."""
    import e2b
    from e2b.exceptions import ServiceBusyException

    a, b = cluster["a"], cluster["b"]

    def opts(srv) -> dict:  # through `srv`, with host a's key
        return {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd",
                "api_key": a.key}

    vol = e2b.Volume.create("placed", **opts(a))
    try:
        # host a is small (A_SLOTS) and its last heartbeat may still count the sandboxes the
        # tests before this one killed there: b asks a all the same, and a answers for itself
        sbx = e2b.Sandbox.create(volume_mounts={"/mnt/v": vol}, timeout=600, **opts(b))
        sid = sbx.sandbox_id
        assert client(a).sandboxes.get_info(sid).host == "host-a"
        sbx.commands.run("echo before > /mnt/v/one.txt", timeout=120)
        assert e2b.Sandbox.get_info(sid, **opts(b)).volume_mounts == [
            {"name": "placed", "path": "/mnt/v"}]
        assert sbx.pause() is True
        client(a).hosts.drain("host-a")
        try:
            with pytest.raises(ServiceBusyException, match="host-a.*draining"):
                e2b.Sandbox.connect(sid, timeout=600, **opts(b))
            assert client(b).sandboxes.get_info(sid).state == "paused"
        finally:
            client(a).hosts.activate("host-a")
        resumed = e2b.Sandbox.connect(sid, timeout=600, **opts(b))
        assert client(b).sandboxes.get_info(sid).host == "host-a"
        assert resumed.commands.run("cat /mnt/v/one.txt; echo after > /mnt/v/two.txt",
                                    timeout=120).stdout == "before\n"
        assert (a.data_dir / "volumes" / vol.volume_id / "two.txt").read_text() == "after\n"
        resumed.kill()
    finally:
        e2b.Volume.destroy(vol.volume_id, **opts(a))
