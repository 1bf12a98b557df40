"""Placement in core (core/placement.py): creates, forks and resumes go where the deployment's
hosts have room, through the REST and the E2B API alike. The other hosts are a fake `Peers`
that records what it is asked (the real one is HTTP: tests/vm/test_cluster.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from sandlot.core.hosts import HostInfo, Hosts, HostState
from sandlot.core.models import CreateSandbox, SandboxRecord, SandboxState
from sandlot.core.tenancy import Principal
from sandlot.errors import CapacityError, NotFoundError
from sandlot.testing import in_process

DOMAIN = "sandlot.test"


class FakePeers:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.relayed: list[tuple[str, str]] = []  # (host URL, path) of requests sent on
        self.full: set[str] = set()  # hosts that answer "no room"

    async def create(self, host, req, who, forked_from=None) -> SandboxRecord:
        self.calls.append(("create", host.id, req, who, forked_from))
        if host.id in self.full:
            raise CapacityError(f"{host.id} is full")
        return SandboxRecord(sandbox_id=f"sb-{host.id}{len(self.calls)}", memory_mb=512,
                             cpus=1, host=host.id, forked_from=forked_from,
                             snapshot_id=req.snapshot_id, state="running")

    async def resume(self, host, sandbox_id, timeout, reboot, who) -> SandboxRecord:
        self.calls.append(("resume", host.id, sandbox_id, who))
        if host.id in self.full:
            raise CapacityError(f"{host.id} is full")
        return SandboxRecord(sandbox_id=sandbox_id, memory_mb=512, cpus=1, host=host.id,
                             state="running")


def host(host_id: str, free: int) -> HostInfo:
    return HostInfo(id=host_id, url=f"http://{host_id}", state=HostState.ACTIVE, slots=free)


@pytest.fixture
async def deployment(tmp_path, monkeypatch):
    """An in-process server that believes it is host `here` of a deployment whose other
    hosts are p1 and p2; `order` is what placement ranks first."""
    async with in_process(tmp_path, e2b_domain=DOMAIN) as srv:
        core = srv.core
        monkeypatch.setattr(Hosts, "shared", property(lambda self: True))
        order: list[HostInfo] = []

        async def place(need):
            return list(order)

        monkeypatch.setattr(core.hosts, "place", place)
        peers = FakePeers()
        core.placement.peers = peers

        async def relay(scope, receive, send, url, body=None, fallback=None) -> None:
            """A request sent on to another host: recorded, and answered as from there."""
            peers.relayed.append((url, scope["path"]))
            data = json.dumps({"answered by": url}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})

        monkeypatch.setattr(srv.app.state.peers, "relay", relay)
        client = httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url,
                                   headers={"authorization": f"Bearer {srv.key}",
                                            "x-api-key": srv.key})
        yield core, client, peers, order
        await client.aclose()


async def test_a_fork_spreads_its_children_over_hosts_with_room(deployment, monkeypatch):
    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    parent = (await client.post("/v1/sandboxes", json={})).json()["sandbox_id"]
    monkeypatch.setattr(core.sandboxes, "free_slots", lambda: 1)  # one more child here
    order[:] = [host(core.host_id, 1), host("p1", 1), host("p2", 3)]
    r = await client.post(f"/v1/sandboxes/{parent}/fork", json={"count": 4})
    assert r.status_code == 200, r.text
    kids = r.json()["sandboxes"]
    assert len(kids) == 4 and r.json()["errors"] == []
    spread = [c for c in peers.calls if c[0] == "create"]
    assert sorted(c[1] for c in spread) == ["p1", "p2", "p2"]  # by free slots
    assert {c[4] for c in spread} == {parent}  # forked_from
    assert {c[3] for c in spread} == {Principal("test")}  # the caller's tenant
    snapshot = spread[0][2].snapshot_id
    assert {c[2].snapshot_id for c in spread} == {snapshot}  # one snapshot for all
    r = await client.get(f"/v1/snapshots/{snapshot}")
    assert r.json()["state"] == "deleted"  # gone once they run
    # through E2B, the same spread, and a failed child does not fail the others
    peers.calls.clear()
    peers.full = {"p1", "p2"}
    monkeypatch.setattr(core.sandboxes, "free_slots", lambda: 0)
    r = await client.post(f"/e2b/sandboxes/{parent}/fork", json={"count": 2, "timeout": 60})
    assert r.status_code == 201, r.text
    assert [("error" in c) for c in r.json()] == [True, True]
    peers.full = set()
    r = await client.post(f"/e2b/sandboxes/{parent}/fork", json={"count": 2, "timeout": 60})
    assert [c["sandbox"]["sandboxID"][:5] for c in r.json()] == ["sb-p2", "sb-p2"]
    assert {c[2].timeout for c in peers.calls if c[0] == "create"} == {60}


async def test_creates_and_resumes_go_where_placement_puts_them(deployment):
    core, client, peers, order = deployment
    order[:] = [host("p1", 4), host(core.host_id, 4)]
    r = await client.post("/v1/sandboxes", json={"env": {"K": "v"}})
    assert r.status_code == 201 and r.json()["host"] == "p1"
    assert peers.calls[-1][2].env == {"K": "v"}
    r = await client.post("/e2b/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201 and r.json()["sandboxID"].startswith("sb-p1")
    assert r.json()["envdAccessToken"]
    peers.full = {"p1"}  # no room there after all: the next host, this one
    r = await client.post("/v1/sandboxes", json={})
    assert r.status_code == 201 and r.json()["host"] == core.host_id
    sid = r.json()["sandbox_id"]
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
    order[:] = [host("p2", 4), host(core.host_id, 4)]
    r = await client.post(f"/v1/sandboxes/{sid}/resume", json={})
    assert r.status_code == 200 and r.json()["host"] == "p2"
    assert peers.calls[-1][:3] == ("resume", "p2", sid)


async def test_a_stored_snapshot_forks_into_children_without_a_parent(deployment, monkeypatch):
    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    sid = (await client.post("/v1/sandboxes", json={"env": {"A": "1"}})).json()["sandbox_id"]
    await client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/s"}, content=b"state")
    snap = (await client.post(f"/v1/sandboxes/{sid}/snapshots", json={"name": "base-env"})
            ).json()["snapshot_id"]
    await client.post(f"/v1/snapshots/{snap}/wait")
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204  # no parent
    # one host: all children here, each with the overrides, each its own
    monkeypatch.setattr(Hosts, "shared", property(lambda self: False))
    r = await client.post("/v1/snapshots/base-env/fork",
                          json={"count": 3, "env": {"B": "2"}, "timeout": 77})
    assert r.status_code == 200, r.text
    kids = r.json()["sandboxes"]
    assert len(kids) == 3 and r.json()["errors"] == []
    assert {k["snapshot_id"] for k in kids} == {snap} and {k["timeout"] for k in kids} == {77}
    assert all(k["env"] == {"A": "1", "B": "2"} for k in kids)
    for k in kids:
        r = await client.get(f"/v1/sandboxes/{k['sandbox_id']}/files", params={"path": "/tmp/s"})
        assert r.content == b"state"
    # a deployment: spread over the hosts with room, a full one's child goes to the next
    monkeypatch.setattr(Hosts, "shared", property(lambda self: True))
    order[:] = [host("p1", 1), host("p2", 2), host(core.host_id, 1)]
    peers.full = {"p1"}
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 3})
    assert len(r.json()["sandboxes"]) == 3, r.text
    asked = [c[1] for c in peers.calls if c[0] == "create"]
    assert asked.count("p2") == 3 and "p1" in asked  # p1 said no: its child went on
    # another tenant's snapshot cannot be forked; bad counts are refused
    other = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 1},
                              headers={"authorization": "Bearer " + await _key(core, "b")})
    assert other.status_code == 404
    assert (await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 0})).status_code \
        == 400


async def _stored(client) -> str:
    """A ready snapshot of a sandbox that is gone (killed after the snapshot)."""
    sid = (await client.post("/v1/sandboxes", json={})).json()["sandbox_id"]
    snap = (await client.post(f"/v1/sandboxes/{sid}/snapshots")).json()["snapshot_id"]
    assert (await client.post(f"/v1/snapshots/{snap}/wait")).json()["state"] == "ready"
    assert (await client.delete(f"/v1/sandboxes/{sid}")).status_code == 204
    return snap


async def test_a_snapshot_that_cannot_be_forked_is_refused_clearly(deployment, monkeypatch):
    core, client, peers, order = deployment
    monkeypatch.setattr(Hosts, "shared", property(lambda self: False))
    snap = await _stored(client)
    for count in (0, 65, "x"):
        r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": count})
        assert r.status_code == 400 and "count" in r.text, r.text
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 1, "bogus": 1})
    assert r.status_code == 400, r.text
    # ownership is core's: another tenant's snapshot is not found, as a missing one
    with pytest.raises(NotFoundError):
        await core.placement.fork_snapshot(snap, 1, Principal("other"))
    assert (await client.post("/v1/snapshots/snap-0123456789/fork", json={})).status_code == 404
    # not ready yet, or never: 409; deleted: 404
    sid = (await client.post("/v1/sandboxes", json={})).json()["sandbox_id"]
    core.runtime.persist_delay = 5
    slow = (await client.post(f"/v1/sandboxes/{sid}/snapshots")).json()["snapshot_id"]
    r = await client.post(f"/v1/snapshots/{slow}/fork", json={"count": 2})
    assert r.status_code == 409 and "not ready" in r.json()["error"]["message"], r.text
    core.runtime.persist_delay, core.runtime.fail_persist = 0, "disk full"
    failed = (await client.post(f"/v1/sandboxes/{sid}/snapshots")).json()["snapshot_id"]
    assert (await client.post(f"/v1/snapshots/{failed}/wait")).json()["state"] == "failed"
    r = await client.post(f"/v1/snapshots/{failed}/fork", json={"count": 2})
    assert r.status_code == 409 and "disk full" in r.json()["error"]["message"], r.text
    assert (await client.delete(f"/v1/snapshots/{snap}")).status_code == 204
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 1})
    assert r.status_code == 404 and "deleted" in r.json()["error"]["message"], r.text
    assert not [c for c in peers.calls if c[0] == "create"]  # nothing was started anywhere


async def test_a_snapshot_fork_child_that_fails_leaves_the_others(deployment, monkeypatch):
    core, client, peers, order = deployment
    monkeypatch.setattr(Hosts, "shared", property(lambda self: False))
    snap = await _stored(client)
    core.runtime.fail_restores = 1
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 3})
    assert r.status_code == 200, r.text
    kids, errors = r.json()["sandboxes"], r.json()["errors"]
    assert len(kids) == 2 and len(errors) == 1
    assert errors[0]["error"]["type"] == "InvalidStateError" and 0 <= errors[0]["index"] < 3
    for k in kids:
        assert (await client.get(f"/v1/sandboxes/{k['sandbox_id']}")).json()["state"] == \
            "running"
    # this host's room ends: the children past it fail alone, the others run
    monkeypatch.setattr(core.sandboxes, "settings", dataclasses.replace(
        core.sandboxes.settings, max_sandboxes=len(core.sandboxes.live) + 1))
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 3})
    assert len(r.json()["sandboxes"]) == 1 and len(r.json()["errors"]) == 2, r.text
    assert {e["error"]["type"] for e in r.json()["errors"]} == {"CapacityError"}
    r = await client.post(f"/v1/sandboxes/{kids[0]['sandbox_id']}/rollback",
                          json={"snapshot_id": snap})  # a full host: it keeps its slot
    assert r.status_code == 200 and r.json()["state"] == "running", r.text
    # in a deployment where no host has room: each child's error, not the request's
    monkeypatch.setattr(Hosts, "shared", property(lambda self: True))
    order[:] = [host("p1", 2), host("p2", 2)]
    peers.full = {"p1", "p2"}
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 2})
    assert r.status_code == 200 and r.json()["sandboxes"] == [], r.text
    assert [e["index"] for e in r.json()["errors"]] == [0, 1]


async def _key(core, tenant: str) -> str:
    key = "sl_test_" + tenant * 8
    await core.db.add_key(key, tenant)
    return key


async def test_a_paused_sandbox_forks_from_its_paused_state(deployment, monkeypatch):
    core, client, peers, order = deployment
    monkeypatch.setattr(Hosts, "shared", property(lambda self: False))
    sid = (await client.post("/v1/sandboxes", json={"metadata": {"m": "1"}})).json()[
        "sandbox_id"]
    await client.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/s"}, content=b"p")
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
    r = await client.post(f"/e2b/sandboxes/{sid}/fork", json={"count": 2})  # E2B says 409
    assert r.status_code == 201, r.text
    kids = [c["sandbox"]["sandboxID"] for c in r.json()]
    assert len(kids) == 2
    for kid in kids:
        info = (await client.get(f"/v1/sandboxes/{kid}")).json()
        assert info["forked_from"] == sid and info["metadata"] == {"m": "1"}
        r = await client.get(f"/v1/sandboxes/{kid}/files", params={"path": "/tmp/s"})
        assert r.content == b"p"
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"


async def test_a_host_that_does_not_answer_is_passed_over() -> None:
    """The real Peers: a host that cannot be reached at all is 'no room' to placement, which
    then tries the next host (not a failed create)."""
    from sandlot.core.models import CreateSandbox
    from sandlot.server.forward import Peers

    peers = Peers("host-a", token="t")
    gone = HostInfo(id="gone", url="http://127.0.0.1:9", state=HostState.ACTIVE, slots=4)
    with pytest.raises(CapacityError, match="did not answer"):
        await peers.create(gone, CreateSandbox(), Principal("t"))
    await peers.close()


async def test_children_on_other_hosts_keep_every_setting_of_their_parent(deployment,
                                                                          monkeypatch):
    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    r = await client.post("/e2b/sandboxes", json={
        "templateID": "base", "autoPause": True, "autoResume": {"enabled": True},
        "network": {"allowPublicTraffic": False}, "metadata": {"m": "1"}})
    parent = r.json()["sandboxID"]
    monkeypatch.setattr(core.sandboxes, "free_slots", lambda: 0)
    order[:] = [host(core.host_id, 0), host("p1", 4)]
    r = await client.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1})
    assert r.status_code == 200 and not r.json()["errors"], r.text
    (req,) = [c[2] for c in peers.calls if c[0] == "create"]
    assert (req.public_traffic, req.on_timeout, req.auto_resume, req.metadata) == (
        False, "pause", True, {"m": "1"})
    # and from a paused parent, here
    monkeypatch.setattr(Hosts, "shared", property(lambda self: False))
    assert (await client.post(f"/v1/sandboxes/{parent}/pause")).status_code == 200
    r = await client.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1})
    kid = r.json()["sandboxes"][0]["sandbox_id"]
    assert core.sandboxes.live[kid].record.public_traffic is False


async def test_where_a_sandbox_is_names_its_state_as_a_state(deployment):
    """`locate` (what forwarding routes by) gives a `SandboxState`, running or stored."""
    core, client, _peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    sid = (await client.post("/v1/sandboxes", json={})).json()["sandbox_id"]
    where = await core.sandboxes.locate(sid)
    assert where.state is SandboxState.RUNNING and where.host == core.host_id
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
    assert (await core.sandboxes.locate(sid)).state is SandboxState.PAUSED


RESUMES = ("rest", "e2b connect", "a use", "port traffic", "a parked port")


@pytest.mark.parametrize("how", RESUMES)
async def test_a_resume_on_use_is_placed_as_a_rest_resume(deployment, monkeypatch, how):
    """An auto-resume sandbox brought back by a request that needs it (the middleware), by
    traffic to its port name, or by a connection to a port it kept listening through the
    pause, goes where a REST resume goes: to the host placement ranks first (this one has
    no room), for its tenant; the request is then answered there. A host with no room
    after all passes it to the next, here."""
    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    runtime = core.runtime
    runtime.kept_ports = {8000: ("127.0.0.1", 9)}

    async def url_of(host_id):
        return None if host_id == core.host_id else f"http://{host_id}"

    monkeypatch.setattr(core.hosts, "url_of", url_of)
    sid = (await client.post("/v1/sandboxes", json={"auto_resume": True})).json()["sandbox_id"]
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200

    async def resume() -> httpx.Response | None:
        if how == "rest":
            return await client.post(f"/v1/sandboxes/{sid}/resume", json={})
        if how == "e2b connect":
            return await client.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 60})
        if how == "a use":
            return await client.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/tmp"})
        if how == "port traffic":
            return await client.get("/hello", headers={"host": f"8000-{sid}.{DOMAIN}"})
        runtime.traffic.put_nowait(sid)  # a connection to the port it kept
        for _ in range(500):  # until core took it and its resume is over
            await asyncio.sleep(0.01)
            if runtime.traffic.empty() and not core._waking:
                break
        return None

    order[:] = [host("p2", 4)]  # this host has no room
    r = await resume()
    assert peers.calls[-1] == ("resume", "p2", sid, Principal("test"))
    assert sid not in core.sandboxes.live
    assert runtime.dropped == [sid]  # the ports kept here close: it runs on p2
    if how in ("a use", "port traffic"):  # answered by p2, where it runs now
        assert r.status_code == 200 and r.json() == {"answered by": "http://p2"}
        assert peers.relayed[-1][0] == "http://p2"
    elif r is not None:
        assert r.status_code in (200, 201), r.text
    peers.full = {"p2"}  # no room there after all: the next host, this one
    order[:] = [host("p2", 4), host(core.host_id, 4)]
    relayed = len(peers.relayed)
    r = await resume()
    assert peers.calls[-1] == ("resume", "p2", sid, Principal("test"))
    assert sid in core.sandboxes.live
    assert len(peers.relayed) == relayed  # served here
    if how == "port traffic":  # by the port it kept here (nothing listens on it in a fake)
        assert r.status_code == 502 and "is running" in r.json()["message"]
    elif r is not None:
        assert r.status_code in (200, 201), r.text
    assert runtime.refused == []  # the connections were not refused: it runs here


async def test_traffic_to_a_kept_port_of_a_sandbox_that_cannot_come_back_is_refused(
        deployment):
    """A connection to a port a paused auto-resume sandbox kept, when it cannot be resumed
    (no other host has room, and its restore here fails): the connection ends (it does not
    wait), the sandbox stays paused, and the port stays kept for the next."""
    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    runtime = core.runtime
    runtime.kept_ports = {8000: ("127.0.0.1", 9)}
    sid = (await client.post("/v1/sandboxes", json={"auto_resume": True})).json()["sandbox_id"]
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
    order[:] = [host("p2", 4)]
    peers.full = {"p2"}
    runtime.fail_restores = 1
    runtime.traffic.put_nowait(sid)
    for _ in range(500):
        await asyncio.sleep(0.01)
        if runtime.refused:
            break
    assert runtime.refused == [sid] and runtime.dropped == []
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"


async def _with_volume(core, client, tmp_path, **create) -> tuple[str, str]:
    """A volume of this host, and a sandbox (created through /v1) that mounts it."""
    from sandlot.guest.volserve import VolumeServer

    core.runtime.volumes = VolumeServer(tmp_path / "vols", b"k" * 32)
    vol = (await client.post("/e2b/volumes", json={"name": "data"})).json()["volumeID"]
    r = await client.post("/v1/sandboxes", json={
        **create, "volume_mounts": [{"volume": "data", "path": "/mnt/data"}]})
    assert r.status_code == 201 and r.json()["host"] == core.host_id, r.text
    return vol, r.json()["sandbox_id"]


async def test_a_sandbox_with_volumes_runs_on_their_host_only(deployment, monkeypatch,
                                                              tmp_path):
    """A sandbox that mounts volumes, its snapshots and its children run on the volumes'
    host (here) though placement ranks other hosts first: resumed (REST, E2B connect, on
    use), restored, forked (no spreading: the children past its room fail, naming it), and
    its snapshot forked; the mounts show in its info (/v1 and E2B)."""
    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    _, sid = await _with_volume(core, client, tmp_path, auto_resume=True)
    mounts = [{"name": "data", "path": "/mnt/data"}]
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["volume_mounts"] == mounts
    assert (await client.get(f"/e2b/sandboxes/{sid}")).json()["volumeMounts"] == mounts
    listed = (await client.get("/e2b/v2/sandboxes")).json()
    assert [s["volumeMounts"] for s in listed if s["sandboxID"] == sid] == [mounts]
    order[:] = [host("p1", 4), host("p2", 4), host(core.host_id, 4)]  # others first

    async def paused() -> None:
        assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200

    await paused()
    r = await client.post(f"/v1/sandboxes/{sid}/resume", json={})
    assert r.status_code == 200 and r.json()["host"] == core.host_id, r.text
    assert r.json()["volume_mounts"] == mounts
    await paused()
    r = await client.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 60})
    assert r.status_code in (200, 201) and sid in core.sandboxes.live, r.text
    await paused()
    r = await client.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/tmp"})
    assert r.status_code == 200 and sid in core.sandboxes.live, r.text  # resumed on use
    # a snapshot restored, and forked
    snap = (await client.post(f"/v1/sandboxes/{sid}/snapshots")).json()["snapshot_id"]
    assert (await client.post(f"/v1/snapshots/{snap}/wait")).json()["state"] == "ready"
    r = await client.post("/v1/sandboxes", json={"snapshot_id": snap})
    assert r.status_code == 201 and r.json()["host"] == core.host_id, r.text
    assert r.json()["volume_mounts"] == mounts
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 2})
    assert r.status_code == 200 and r.json()["errors"] == [], r.text
    assert [k["host"] for k in r.json()["sandboxes"]] == [core.host_id] * 2
    # a fork of the running sandbox: the children that fit here, the rest fail alone
    monkeypatch.setattr(core.sandboxes, "free_slots", lambda: 1)
    r = await client.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
    assert r.status_code == 200, r.text
    (kid,) = r.json()["sandboxes"]
    assert kid["host"] == core.host_id and kid["volume_mounts"] == mounts
    errors = [e["error"] for e in r.json()["errors"]]
    assert [e["type"] for e in errors] == ["CapacityError"] * 2
    assert f"live on host {core.host_id}" in errors[0]["message"]
    assert not [c for c in peers.calls if c[0] in ("create", "resume")]  # nothing elsewhere


async def test_a_sandbox_whose_volumes_host_cannot_take_it_is_refused(deployment, tmp_path):
    """The volumes' host full, draining or gone: a resume, restore or snapshot fork fails
    with 503 naming it, and the sandbox stays paused; never elsewhere. A volume host that is
    another: there, through the peers; the one host of a deployment without peers: as ever."""
    from sandlot.core.tenancy import SYSTEM

    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    _, sid = await _with_volume(core, client, tmp_path)
    snap = (await client.post(f"/v1/sandboxes/{sid}/snapshots")).json()["snapshot_id"]
    assert (await client.post(f"/v1/snapshots/{snap}/wait")).json()["state"] == "ready"
    assert (await client.post(f"/v1/sandboxes/{sid}/pause")).status_code == 200
    order[:] = [host("p1", 4), host("p2", 4)]  # this host cannot take it
    for r in (await client.post(f"/v1/sandboxes/{sid}/resume", json={}),
              await client.post(f"/e2b/sandboxes/{sid}/connect", json={"timeout": 60}),
              await client.post("/v1/sandboxes", json={"snapshot_id": snap})):
        assert r.status_code == 503, r.text
        assert f"live on host {core.host_id}" in r.text and "no room" in r.text
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 2})
    assert [e["error"]["type"] for e in r.json()["errors"]] == ["CapacityError"] * 2, r.text
    assert (await client.get(f"/v1/sandboxes/{sid}")).json()["state"] == "paused"
    assert not peers.calls
    # its volumes on p1 (paused there): the resume goes to p1 only; p1 full: 503 naming it
    rec = await core.sandboxes.get(sid, SYSTEM)
    paused = await core.snapshots.get(rec.paused_snapshot, SYSTEM)
    paused.volume_host = rec.volume_host = "p1"
    await core.snapshots._save(paused)
    await core.sandboxes._save(rec)
    order[:] = [host(core.host_id, 4), host("p1", 4)]
    peers.full = {"p1"}
    r = await client.post(f"/v1/sandboxes/{sid}/resume", json={})
    assert r.status_code == 503 and "live on host p1" in r.text, r.text
    assert peers.calls[-1][:3] == ("resume", "p1", sid) and sid not in core.sandboxes.live
    order[:] = [host(core.host_id, 4)]  # p1 lost or draining: not even asked
    r = await client.post(f"/v1/sandboxes/{sid}/resume", json={})
    assert r.status_code == 503 and "host p1" in r.text and len(peers.calls) == 1, r.text
    peers.full = set()
    order[:] = [host(core.host_id, 4), host("p1", 4)]
    r = await client.post(f"/v1/sandboxes/{sid}/resume", json={})
    assert r.status_code == 200 and r.json()["host"] == "p1", r.text
    # a snapshot of p1's volumes: restored and forked on p1
    stored = await core.snapshots.get(snap, SYSTEM)
    stored.volume_host = "p1"
    await core.snapshots._save(stored)
    r = await client.post("/v1/sandboxes", json={"snapshot_id": snap})
    assert r.status_code == 201 and r.json()["host"] == "p1", r.text
    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 2})
    assert [k["host"] for k in r.json()["sandboxes"]] == ["p1", "p1"], r.text
    # this host, asked for it anyway (no placement), refuses it
    with pytest.raises(CapacityError, match="volumes of host p1"):
        await core.sandboxes.create(CreateSandbox(snapshot_id=snap), who=Principal("test"))


async def test_a_volumes_host_that_reported_full_is_asked_all_the_same(deployment, tmp_path):
    """Placement reads another host's room from its heartbeats, which lag the sandboxes it
    has ended since: a sandbox whose volumes live on p1, active, is asked of p1 even when p1's
    last report said full, and p1 answers for itself (room: it runs there; none: 503 naming
    p1). A p1 that stopped reporting is not asked."""
    from sandlot.core.tenancy import SYSTEM

    core, client, peers, order = deployment
    order[:] = [host(core.host_id, 4)]
    _, sid = await _with_volume(core, client, tmp_path)
    snap = (await client.post(f"/v1/sandboxes/{sid}/snapshots")).json()["snapshot_id"]
    assert (await client.post(f"/v1/snapshots/{snap}/wait")).json()["state"] == "ready"
    stored = await core.snapshots.get(snap, SYSTEM)
    stored.volume_host = "p1"
    await core.snapshots._save(stored)
    await core.db.heartbeat("p1", "http://p1", "active", {"slots": 2, "sandboxes": 2})
    order[:] = [host(core.host_id, 4)]  # p1 full, as its last heartbeat said
    r = await client.post("/v1/sandboxes", json={"snapshot_id": snap})
    assert r.status_code == 201 and r.json()["host"] == "p1", r.text
    peers.full = {"p1"}  # full indeed
    r = await client.post("/v1/sandboxes", json={"snapshot_id": snap})
    assert r.status_code == 503 and "live on host p1" in r.text and "p1 is full" in r.text
    assert [c[:2] for c in peers.calls] == [("create", "p1")] * 2
    core.hosts.settings = dataclasses.replace(core.hosts.settings, host_timeout=0)  # silent
    r = await client.post("/v1/sandboxes", json={"snapshot_id": snap})
    assert r.status_code == 503 and "has not reported" in r.text, r.text
    assert len(peers.calls) == 2
