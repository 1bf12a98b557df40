"""GET /v1/events (the console's live lists): a key is needed; each subscriber gets the
changes of its own tenant's sandboxes and snapshots only (an admin: everyone's), in the API's
shape; a pause's snapshot is not shown; /console answers its files or how to build them."""

from __future__ import annotations

import asyncio
import json

import httpx

from sandlot.core.events import QUEUE, RELOAD, Events
from sandlot.core.tenancy import Principal
from sandlot.server.routes_events import sse
from sandlot.testing import in_process


async def drain(it, n: int) -> list:
    return [await asyncio.wait_for(anext(it), 5) for _ in range(n)]


async def pending(it) -> list:
    """What a subscription holds now (it is never empty-handed: None marks silence)."""
    got = []
    while (item := await asyncio.wait_for(anext(it), 5)) is not None:
        got.append(item)
    return got


async def test_events_need_a_key_and_keep_to_the_tenant(tmp_path) -> None:
    async with in_process(tmp_path) as srv:
        keys = {"a": await srv.add_key("a"), "b": await srv.add_key("b"),
                "ops": await srv.add_key("ops", admin=True)}
        async with httpx.AsyncClient(transport=srv.async_transport(),
                                     base_url=srv.url) as client:
            r = await client.get("/v1/events")
            assert r.status_code == 401 and "API key" in r.text
            r = await client.get("/v1/events", headers={"authorization": "Bearer nope"})
            assert r.status_code == 401 and "invalid API key" in r.text
            feeds = {who: srv.core.events.subscribe(await srv.core.authenticate(k), 0.05)
                     for who, k in keys.items()}
            for feed in feeds.values():
                assert await anext(feed) is None  # subscribed, nothing yet

            def call(who: str, method: str, path: str, **kw):
                return client.request(method, path, headers={
                    "authorization": f"Bearer {keys[who]}"}, **kw)

            sid = (await call("a", "POST", "/v1/sandboxes", json={})).json()["sandbox_id"]
            snap = (await call("a", "POST", f"/v1/sandboxes/{sid}/snapshots",
                               json={"name": "s"})).json()["snapshot_id"]
            await call("a", "POST", f"/v1/snapshots/{snap}/wait")
            assert (await call("a", "POST", f"/v1/sandboxes/{sid}/pause")).status_code == 200
            b_sid = (await call("b", "POST", "/v1/sandboxes", json={})).json()["sandbox_id"]

            a_seen = await pending(feeds["a"])
            assert {c.id for c in a_seen} == {sid, snap}
            assert [c.record["state"] for c in a_seen if c.id == sid][-1] == "paused"
            assert {c.kind for c in a_seen if c.id == snap} == {"snapshot"}
            assert "owner" not in a_seen[0].record  # the API's shape: no internal fields
            assert {c.id for c in await pending(feeds["b"])} == {b_sid}
            assert {c.id for c in await pending(feeds["ops"])} == {sid, snap, b_sid}
            for feed in feeds.values():
                await feed.aclose()
            assert srv.core.events.subscribers == 0


async def test_the_stream_is_server_sent_events() -> None:
    events = Events()
    stream = sse(events, Principal("a"), 0.05)
    assert await anext(stream) == b"event: ready\ndata: {}\n\n"
    assert await anext(stream) == b": keepalive\n\n"
    events.publish_sandbox({"sandbox_id": "sb-1", "memory_mb": 512, "cpus": 1, "owner": "a",
                            "state": "running"})
    events.publish_sandbox({"sandbox_id": "sb-2", "memory_mb": 512, "cpus": 1, "owner": "b"})
    events.publish_snapshot({"snapshot_id": "sn-p", "owner": "a", "kind": "pause"})
    events.publish_snapshot({"snapshot_id": "sn-1", "owner": "a", "state": "ready"})
    first = await anext(stream)
    head, _, data = first.decode().rpartition("data: ")
    assert head == "event: sandbox\nid: sb-1\n"
    assert json.loads(data)["state"] == "running"
    assert (await anext(stream)).startswith(b"event: snapshot\nid: sn-1\n")
    await stream.aclose()
    assert events.subscribers == 0


async def test_a_subscriber_that_falls_behind_is_told_to_reload() -> None:
    events = Events()
    feed = events.subscribe(Principal("a"), 0.05)
    assert await anext(feed) is None
    for i in range(QUEUE + 5):
        events.publish_sandbox({"sandbox_id": f"sb-{i}", "memory_mb": 1, "cpus": 1,
                                "owner": "a"})
    got = await pending(feed)
    assert got[0] == RELOAD and len(got) < 10  # then what came after it
    await feed.aclose()


async def test_the_console_is_served_or_says_how_to_build_it(tmp_path) -> None:
    built = tmp_path / "dist"
    built.mkdir()
    (built / "index.html").write_text("<title>sandlot</title>")
    for where, status, text in ((built, 200, "<title>sandlot</title>"),
                                (tmp_path / "none", 503, "make setup")):
        async with in_process(tmp_path / where.name, console_dir=where) as srv, httpx.AsyncClient(
                transport=srv.async_transport(), base_url=srv.url) as client:
            r = await client.get("/console")
            assert r.status_code == 307 and r.headers["location"] == "/console/"
            r = await client.get("/console/")
            assert r.status_code == status and text in r.text
            if status == 200:
                assert "default-src 'self'" in r.headers["content-security-policy"]


async def test_a_deployments_feed_has_every_hosts_changes(postgres) -> None:
    """Two hosts on one PostgreSQL: a console connected to host A sees the sandboxes and
    snapshots host B saves (the store notifies; A reads them), its own tenant's only."""
    import secrets

    from sandlot.core.db import open_store
    from sandlot.core.events import FeedingStore

    url = postgres.new_database("ev" + secrets.token_hex(4))
    stores = [open_store(url, None) for _ in range(2)]
    for store in stores:
        await store.open()
    try:
        events = Events()
        host_a, host_b = FeedingStore(stores[0], events), FeedingStore(stores[1], Events())
        feed = events.subscribe(Principal("t1", False), 0.2)
        assert await anext(feed) is None  # subscribed
        doc = {"sandbox_id": "sb-b", "state": "running", "memory_mb": 512, "cpus": 1,
               "owner": "t1"}
        await host_b.put_sandbox("sb-b", "running", "h-b", doc)
        await host_b.put_sandbox("sb-x", "running", "h-b", doc | {"sandbox_id": "sb-x",
                                                                  "owner": "t2"})
        await host_b.put_snapshot("snap-b", None, "ready", "h-b", {
            "snapshot_id": "snap-b", "sandbox_id": "sb-b", "state": "ready",
            "owner": "t1"}, 1.0)
        await host_a.put_sandbox("sb-a", "running", "h-a", doc | {"sandbox_id": "sb-a"})
        seen: list = []
        while len(seen) < 3:
            change = await asyncio.wait_for(anext(feed), 10)
            if change is not None:
                seen.append(change)
        assert sorted((c.kind, c.id) for c in seen) == [
            ("sandbox", "sb-a"), ("sandbox", "sb-b"), ("snapshot", "snap-b")]
        assert await pending(feed) == []  # each once; never another tenant's
    finally:
        for store in stores:
            await store.close()
