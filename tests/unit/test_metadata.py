"""The metadata stores, SQLite (one host) and PostgreSQL (a deployment, a real server started
by the tests), answer alike: records, names, hosts, heartbeats and lost hosts."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from sandlot.core.db import NameTaken, open_store
from sandlot.core.db.sqlite import SqliteStore
from sandlot.core.hosts import LOST_REASON


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "postgres":
        pg = request.getfixturevalue("postgres")
        url = pg.new_database("t" + secrets.token_hex(4))
    else:
        url = None
    db = open_store(url, tmp_path / "sandlot.db")
    await db.open()
    yield db
    await db.close()


def doc(sid: str, state: str) -> dict:
    return {"sandbox_id": sid, "state": state, "memory_mb": 512, "cpus": 1}


async def silence(store, host: str, seconds: float) -> None:
    """Move `host`'s last heartbeat `seconds` back, as if it had been silent that long (the
    store's own clock stamps heartbeats: the test waits for nothing)."""
    sql = "UPDATE hosts SET heartbeat_at = heartbeat_at - {0} WHERE id = {0}"
    if isinstance(store, SqliteStore):
        store._q(sql.format("?"), (seconds, host))
    else:
        await store._q(sql.format("%s"), (seconds, host))


async def test_records_keys_and_names(store) -> None:
    await store.add_key("sl_k", "team-a")
    await store.add_key("sl_admin", "operator", admin=True)
    assert await store.key_principal("sl_k") == ("team-a", False)
    assert await store.key_principal("sl_admin") == ("operator", True)
    assert await store.key_principal("sl_other") is None
    listed = {k.tenant: k for k in await store.keys()}
    assert set(listed) == {"team-a", "operator"} and listed["operator"].admin
    assert "sl_k" not in repr(listed)  # ids, never the keys
    assert await store.revoke_key(listed["team-a"].key_id)
    assert await store.key_principal("sl_k") is None
    assert not await store.revoke_key(listed["team-a"].key_id)
    # SANDLOT_API_KEY stored before tenants: on the next start it is the operator's admin key
    await store.add_key("sl_old", None)  # as a key row of before tenants
    assert (await store.key_principal("sl_old"))[0].startswith("key-")
    await store.add_key("sl_old", "operator", admin=True)
    assert await store.key_principal("sl_old") == ("operator", True)
    await store.put_sandbox("sb-1", "running", "h-a", doc("sb-1", "running"))
    await store.put_sandbox("sb-2", "running", "h-b", doc("sb-2", "running"))
    await store.put_sandbox("sb-2", "stopped", "h-b", doc("sb-2", "stopped"))
    assert await store.sandbox_host("sb-2") == "h-b"
    assert [d["sandbox_id"] for d in await store.sandboxes(("running",))] == ["sb-1"]
    assert [d["sandbox_id"] for d in await store.sandboxes(host="h-b")] == ["sb-2"]
    await store.put_snapshot("snap-1", "keep", "ready", "h-a", {"snapshot_id": "snap-1"}, 1.0)
    with pytest.raises(NameTaken):
        await store.put_snapshot("snap-2", "keep", "ready", "h-b", {"snapshot_id": "snap-2"},
                                 2.0)
    assert (await store.get_snapshot("keep"))["snapshot_id"] == "snap-1"
    assert await store.name_taken("keep") and not await store.name_taken("keep", "snap-1")
    assert await store.secret("e2b") == await store.secret("e2b")


async def test_volumes(store) -> None:
    await store.add_volume("vol-1", "a/data", "h-a", {"volume_id": "vol-1"}, 1.0)
    with pytest.raises(NameTaken):
        await store.add_volume("vol-2", "a/data", "h-a", {"volume_id": "vol-2"}, 2.0)
    await store.add_volume("vol-3", "b/data", "h-b", {"volume_id": "vol-3"}, 3.0)
    assert (await store.get_volume("vol-1")) == {"volume_id": "vol-1"}
    assert (await store.get_volume("b/data")) == {"volume_id": "vol-3"}
    assert await store.get_volume("vol-2") is None
    assert [d["volume_id"] for d in await store.volumes()] == ["vol-1", "vol-3"]
    assert await store.drop_volume("vol-1") and not await store.drop_volume("vol-1")
    assert [d["volume_id"] for d in await store.volumes()] == ["vol-3"]


async def test_a_silent_host_is_lost_with_its_running_sandboxes_once(store) -> None:
    for host in ("h-a", "h-b"):
        await store.heartbeat(host, f"http://{host}", "active", {"slots": 4})
    await store.put_sandbox("sb-a", "running", "h-a", doc("sb-a", "running"))
    await store.put_sandbox("sb-b", "running", "h-b", doc("sb-b", "running"))
    await store.put_sandbox("sb-p", "paused", "h-b", doc("sb-p", "paused"))
    await store.put_snapshot("snap-b", None, "uploading", "h-b", {"snapshot_id": "snap-b",
                                                                   "state": "uploading"}, 1.0)
    await silence(store, "h-b", 3600)  # h-b has been silent for an hour, h-a answers
    lost = await asyncio.gather(store.mark_lost(600, LOST_REASON),
                                store.mark_lost(600, LOST_REASON))
    assert sorted(lost[0] + lost[1]) == ["h-b"]  # marked once, whoever noticed
    states = {h.host_id: h.state for h in await store.hosts()}
    assert states == {"h-a": "active", "h-b": "lost"}
    b = await store.get_sandbox("sb-b")
    assert b["state"] == "lost" and "h-b stopped answering" in b["error"]
    assert (await store.get_sandbox("sb-p"))["state"] == "paused"  # its state is in the store
    assert (await store.get_sandbox("sb-a"))["state"] == "running"
    assert (await store.get_snapshot("snap-b"))["state"] == "failed"
    # It comes back: a heartbeat makes it active again.
    await store.heartbeat("h-b", "http://h-b", "active", {"slots": 4})
    assert {h.host_id: h.state for h in await store.hosts()}["h-b"] == "active"


async def test_templates_and_builds(store) -> None:
    """Templates built through the API (a deleted one kept as deleted) and their builds with
    their logs, as every host of a deployment reads them."""
    assert await store.get_template("t") is None
    await store.put_template("t", {"name": "t", "snapshot_id": "snap-1"})
    await store.put_template("t", {"name": "t", "snapshot_id": "snap-2"})
    await store.put_template("u", {"name": "u"})
    assert (await store.get_template("t")).doc["snapshot_id"] == "snap-2"
    await store.put_template("u", None)
    row = await store.get_template("u")
    assert row is not None and row.doc is None
    assert [(r.name, r.doc is None) for r in await store.templates()] == [("t", False),
                                                                          ("u", True)]
    await store.put_build("b-1", "requested", "h-a", {"build_id": "b-1"}, 1.0)
    await store.put_build("b-1", "building", "h-b", {"build_id": "b-1", "status": "building"},
                          1.0)
    await store.put_build("b-2", "ready", "h-a", {"build_id": "b-2"}, 2.0)
    assert (await store.get_build("b-1"))["status"] == "building"
    assert await store.get_build("nope") is None
    assert [d["build_id"] for d in await store.builds(("building",), host="h-b")] == ["b-1"]
    await store.add_build_logs("b-1", 0, [{"message": "one"}, {"message": "two"}])
    await store.add_build_logs("b-1", 1, [{"message": "two again"}, {"message": "three"}])
    assert [line["message"] for line in await store.build_logs("b-1", 1, 10)] == ["two",
                                                                                 "three"]
    assert await store.build_logs("b-1", 0, 1) == [{"message": "one"}]
    await store.add_build_logs("b-2", 0, [{"message": "x"}])
    assert await store.drop_builds(("ready", "error"), 3.0) == 1
    assert await store.get_build("b-2") is None and await store.build_logs("b-2", 0, 9) == []
    assert await store.get_build("b-1") is not None
    # a lost host's unfinished builds fail
    await store.heartbeat("h-b", "http://h-b", "active", {})
    await silence(store, "h-b", 3600)
    assert await store.mark_lost(600, LOST_REASON) == ["h-b"]
    failed = await store.get_build("b-1")
    assert failed["status"] == "error" and "h-b stopped answering" in failed["reason"]
    assert [d["build_id"] for d in await store.builds(("error",))] == ["b-1"]


async def test_a_drained_host_stays_drained_through_its_heartbeats(store) -> None:
    await store.heartbeat("h-a", "http://h-a", "active", {})
    assert await store.set_host_state("h-a", "draining")
    await store.heartbeat("h-a", "http://h-a", "active", {})
    assert [h.state for h in await store.hosts()] == ["draining"]
    assert await store.set_host_state("h-a", "active")
    assert not await store.set_host_state("h-none", "draining")


async def test_migrations_run_once_when_hosts_start_together(postgres) -> None:
    url = postgres.new_database("m" + secrets.token_hex(4))
    stores = [open_store(url, None) for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    await stores[0].add_key("sl_x", "t")
    assert all([await s.key_principal("sl_x") == ("t", False) for s in stores])
    for s in stores:
        await s.close()
