"""Tenants (docs/security.md): a key sees and acts on its tenant's objects only, on every
route of the app, and another tenant's object answers exactly as a missing one; admin keys
see every tenant's. The walk over the app's routes fails when a route is added that it does
not know how to check."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.routing import APIRoute

from sandlot.core import service
from sandlot.testing import in_process

MISSING = {"sandbox_id": "sb-0123456789", "id_or_name": "snap-0123456789",
           "template_id": "snap-0123456789"}
# Routes that name no object: lists and creates (their answers are checked below), the
# deployment's hosts (admin only), shared templates, and what needs no key.
UNSCOPED = {
    ("POST", "/v1/sandboxes"), ("GET", "/v1/sandboxes"), ("GET", "/v1/snapshots"),
    ("GET", "/v1/templates"), ("GET", "/v1/templates/{name}"), ("GET", "/v1/hosts"),
    ("GET", "/v1/hosts/{host_id}"), ("POST", "/v1/hosts/{host_id}/drain"),
    ("POST", "/v1/hosts/{host_id}/activate"), ("POST", "/e2b/sandboxes"),
    ("POST", "/e2b/v2/sandboxes"), ("GET", "/e2b/sandboxes"), ("GET", "/e2b/v2/sandboxes"),
    ("GET", "/e2b/snapshots"), ("GET", "/files"), ("POST", "/files"), ("GET", "/metrics"),
    ("GET", "/health"), ("GET", "/e2b/envd/health"),
    ("GET", "/v1/events"),  # the caller's own changes (tests/unit/test_events.py)
    ("GET", "/console"), ("GET", "/console/{path:path}"),  # static files, no data
    # template builds' names and uploads: tests/unit/test_e2b_template_requests.py
    ("POST", "/e2b/v3/templates"), ("GET", "/e2b/templates/aliases/{alias}"),
    ("PUT", "/e2b/template-uploads/{token}"),
    # template listings, the caller's templates only: tests/unit/test_e2b_listings.py
    ("GET", "/e2b/templates"), ("GET", "/e2b/v2/templates"),
    # tags name their template in the body: tests/unit/test_e2b_template_tags.py
    ("POST", "/e2b/templates/tags"), ("DELETE", "/e2b/templates/tags"),
    # Dockerfile builds by name: tests/unit/test_dockerfile_builds.py
    ("POST", "/v1/templates/{name}/builds"), ("GET", "/v1/templates/{name}/builds/{build_id}"),
    # volumes, another tenant's answered as missing: tests/unit/test_e2b_volumes_api.py
    ("POST", "/e2b/volumes"), ("GET", "/e2b/volumes"), ("GET", "/e2b/volumes/{volume_id}"),
    ("DELETE", "/e2b/volumes/{volume_id}"),
    # a volume's files, another tenant's answered as missing: test_e2b_volume_content.py
    *((m, "/e2b/volumecontent/{volume_id}/" + p) for m, p in (
        ("GET", "path"), ("PATCH", "path"), ("DELETE", "path"), ("GET", "dir"),
        ("POST", "dir"), ("GET", "file"), ("PUT", "file"))),
}
# A body each route with an object accepts, so the answer is about the object, not the body.
BODIES = {
    "/timeout": {"timeout": 60}, "/fork": {"count": 1}, "/ports": {"port": 8000},
    "/network": {"allow_out": [], "allowOut": []}, "/commands": {"cmd": "true"},
    "/stdin": {"data": "x"}, "/resize": {"cols": 80, "rows": 24}, "/mkdir": {"path": "/tmp/d"},
    "/rename": {"src": "/tmp/f", "dst": "/tmp/g"}, "/refreshes": {"duration": 60},
    "/connect": {"timeout": 60},
}


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, included routers walked."""
    def walk(items, prefix: str = ""):
        for r in items:
            if isinstance(r, APIRoute):
                for m in sorted(r.methods):
                    yield m, prefix + r.path
            elif hasattr(r, "original_router"):
                yield from walk(r.original_router.routes, prefix + r.include_context.prefix)
    return list(walk(app.router.routes))


@pytest.fixture
async def tenants(tmp_path):
    """A server with tenants a and b and an admin; a has a running sandbox with a file, a
    named snapshot and a paused sandbox."""
    async with in_process(tmp_path) as srv:
        keys = {"a": await srv.add_key("a"), "a2": await srv.add_key("a"),
                "b": await srv.add_key("b"), "admin": await srv.add_key("ops", admin=True)}
        client = httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url)

        async def call(who: str, method: str, path: str, **kw) -> httpx.Response:
            headers = {"authorization": f"Bearer {keys[who]}", "x-api-key": keys[who],
                       **kw.pop("headers", {})}
            return await client.request(method, path, headers=headers, **kw)

        sid = (await call("a", "POST", "/v1/sandboxes", json={})).json()["sandbox_id"]
        await call("a", "PUT", f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/f"},
                   content=b"a's")
        snap = (await call("a", "POST", f"/v1/sandboxes/{sid}/snapshots",
                           json={"name": "env"})).json()["snapshot_id"]
        await call("a", "POST", f"/v1/snapshots/{snap}/wait")
        paused = (await call("a", "POST", "/v1/sandboxes", json={})).json()["sandbox_id"]
        assert (await call("a", "POST", f"/v1/sandboxes/{paused}/pause")).status_code == 200
        yield srv, call, {"sandbox": sid, "snapshot": snap, "paused": paused}
        await client.aclose()


def _normal(r: httpx.Response, *ids: str) -> tuple[int, str]:
    text = r.text
    for i in ids:
        text = text.replace(i, "<id>")
    return r.status_code, text


async def test_every_route_answers_another_tenants_object_as_a_missing_one(tenants) -> None:
    srv, call, objs = tenants
    checked = 0
    for method, path in routes(srv.app):
        if "{rest:path}" in path:
            continue  # E2B's and envd's catch-alls: 501 for whatever they are given
        if (method, path) in UNSCOPED:
            continue
        params = set(p.split(":")[0] for p in
                     (seg[1:-1] for seg in path.split("/") if seg.startswith("{")))
        if path.startswith("/e2b/envd/"):
            params.add("sandbox_id")  # named by the E2b-Sandbox-Id header
        assert params & {"sandbox_id", "id_or_name", "template_id", "service"}, (
            f"{method} {path}: a new route; say how its objects are scoped (UNSCOPED, or a "
            "parameter this test fills)")
        for target in ("sandbox", "paused") if "sandbox_id" in params else ("snapshot",):
            real = {"sandbox_id": objs[target], "id_or_name": objs["snapshot"],
                    "template_id": objs["snapshot"]}
            answers = []
            for who, values in (("b", real), ("b", MISSING)):
                url = path
                for name, value in values.items():
                    url = url.replace("{" + name + "}", value).replace(
                        "{" + name + ":path}", value)
                url = url.replace("{pid}", "1").replace("{service}", "process.Process")
                url = url.replace("{method}", "List")
                kw: dict = {"params": {"path": "/tmp/f", "timeout": 0}}
                if "{service}" in path or path.startswith("/e2b/envd/"):
                    kw["headers"] = {"e2b-sandbox-id": values["sandbox_id"],
                                     "content-type": "application/json"}
                    kw["content"] = b"{}"
                elif method in ("POST", "PUT", "PATCH"):
                    body = next((b for suffix, b in BODIES.items() if path.endswith(suffix)),
                                {})
                    if path.endswith("/rollback"):
                        body = {"snapshot_id": objs["snapshot"]}
                    kw["json"] = body
                r = await call(who, method, url, **kw)
                answers.append(_normal(r, *values.values()))
            assert answers[0] == answers[1], f"{method} {path} ({target})"
            assert answers[0][0] in (404, 400) or path.startswith("/e2b/envd"), answers
            checked += 1
    assert checked > 40
    # a's objects are all still there, and a sees them
    for sid in (objs["sandbox"], objs["paused"]):
        assert (await call("a", "GET", f"/v1/sandboxes/{sid}")).status_code == 200
    r = await call("a", "GET", f"/v1/sandboxes/{objs['sandbox']}/files",
                   params={"path": "/tmp/f"})
    assert r.content == b"a's"
    assert (await call("a", "GET", f"/v1/snapshots/{objs['snapshot']}")).json()["state"] \
        == "ready"


async def test_listings_show_a_tenants_own_and_an_admin_sees_all(tenants) -> None:
    srv, call, objs = tenants
    b_sid = (await call("b", "POST", "/v1/sandboxes", json={})).json()["sandbox_id"]

    def ids(r: httpx.Response, key: str, field: str) -> set[str]:
        data = r.json()
        return {x[field] for x in (data[key] if key else data)}

    mine = {objs["sandbox"], objs["paused"]}
    assert ids(await call("a", "GET", "/v1/sandboxes"), "sandboxes", "sandbox_id") == mine
    assert ids(await call("a2", "GET", "/v1/sandboxes"), "sandboxes", "sandbox_id") == mine
    assert ids(await call("b", "GET", "/v1/sandboxes"), "sandboxes", "sandbox_id") == {b_sid}
    assert ids(await call("admin", "GET", "/v1/sandboxes"), "sandboxes", "sandbox_id") == (
        mine | {b_sid})
    assert ids(await call("b", "GET", "/e2b/sandboxes"), "", "sandboxID") == {b_sid}
    assert ids(await call("b", "GET", "/e2b/v2/sandboxes"), "", "sandboxID") == {b_sid}
    assert (await call("b", "GET", "/v1/snapshots")).json()["snapshots"] == []
    assert (await call("b", "GET", "/e2b/snapshots")).json() == []
    assert ids(await call("a", "GET", "/v1/snapshots"), "snapshots", "snapshot_id") == {
        objs["snapshot"]}
    assert ids(await call("admin", "GET", "/v1/snapshots"), "snapshots", "snapshot_id") == {
        objs["snapshot"]}
    # the admin acts on a tenant's sandbox
    r = await call("admin", "GET", f"/v1/sandboxes/{objs['sandbox']}/files",
                   params={"path": "/tmp/f"})
    assert r.content == b"a's"
    # the deployment's hosts are the operators'
    assert (await call("b", "GET", "/v1/hosts")).status_code == 403
    assert (await call("admin", "GET", "/v1/hosts")).status_code == 200


async def test_names_forks_and_restores_keep_to_the_tenant(tenants) -> None:
    srv, call, objs = tenants
    b_sid = (await call("b", "POST", "/v1/sandboxes", json={})).json()["sandbox_id"]
    # b may use a name a uses: names are per tenant
    r = await call("b", "POST", f"/v1/sandboxes/{b_sid}/snapshots", json={"name": "env"})
    assert r.status_code == 201, r.text
    b_snap = r.json()["snapshot_id"]
    await call("b", "POST", f"/v1/snapshots/{b_snap}/wait")
    assert (await call("b", "GET", "/v1/snapshots/env")).json()["snapshot_id"] == b_snap
    assert (await call("a", "GET", "/v1/snapshots/env")).json()["snapshot_id"] == objs[
        "snapshot"]
    r = await call("b", "POST", f"/v1/sandboxes/{b_sid}/snapshots", json={"name": "env"})
    assert r.status_code == 409  # but not twice within one tenant
    # restoring by name restores one's own; by another tenant's id, nothing
    r = await call("b", "POST", "/v1/snapshots/env/restore", json={})
    assert r.status_code == 201 and r.json()["snapshot_id"] == b_snap
    r = await call("b", "POST", "/v1/sandboxes", json={"snapshot_id": objs["snapshot"]})
    assert r.status_code == 404
    r = await call("b", "POST", "/e2b/sandboxes", json={"templateID": objs["snapshot"]})
    assert r.status_code == 404 and "base" not in r.text  # no list of templates either
    # fork children are the caller's tenant's
    r = await call("a2", "POST", f"/v1/sandboxes/{objs['sandbox']}/fork", json={"count": 2})
    children = [c["sandbox_id"] for c in r.json()["sandboxes"]]
    assert len(children) == 2
    for child in children:
        assert (await call("a", "GET", f"/v1/sandboxes/{child}")).status_code == 200
        assert (await call("b", "GET", f"/v1/sandboxes/{child}")).status_code == 404
    # E2B's connect hands out the envd access token only to the sandbox's tenant
    r = await call("b", "POST", f"/e2b/sandboxes/{objs['sandbox']}/connect", json={})
    assert r.status_code == 404 and "envdAccessToken" not in r.text
    r = await call("a", "POST", f"/e2b/sandboxes/{objs['sandbox']}/connect", json={})
    token = r.json()["envdAccessToken"]
    # a's token reaches a's sandbox, not b's
    ok = await call("b", "GET", "/e2b/envd/files", params={"path": "/tmp/f"},
                    headers={"e2b-sandbox-id": objs["sandbox"], "x-access-token": token,
                             "x-api-key": ""})
    assert ok.content == b"a's"
    r = await call("b", "GET", "/e2b/envd/files", params={"path": "/tmp/f"},
                   headers={"e2b-sandbox-id": b_sid, "x-access-token": token,
                            "x-api-key": ""})
    assert r.status_code == 401


async def test_a_revoked_key_is_refused(tenants, monkeypatch) -> None:
    srv, call, objs = tenants
    monkeypatch.setattr(service, "KEY_CACHE_SECONDS", 0.05)
    assert (await call("a2", "GET", "/v1/sandboxes")).status_code == 200
    for row in [k for k in await srv.core.db.keys() if k.tenant == "a"]:
        assert await srv.core.db.revoke_key(row.key_id)
    await asyncio.sleep(0.1)  # past what the server remembers of a check
    assert (await call("a2", "GET", "/v1/sandboxes")).status_code == 401
    assert (await call("admin", "GET", f"/v1/sandboxes/{objs['sandbox']}")).status_code == 200


async def test_a_clients_peer_headers_are_never_relayed_to_another_host() -> None:
    """A request forwarded to the host that runs its sandbox carries the deployment's peer
    token; the tenant a peer's call acts for must be the forwarding host's word only, never a
    header the client sent (which would act as any tenant, or admin, with no key)."""
    from sandlot.server.forward import Peers, peer_principal

    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(b"{}"))

    peers = Peers("host-a", token="the-peer-token")
    peers.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    forged = [(b"x-sandlot-principal", b"victim; admin"), (b"x-sandlot-forked-from", b"sb-x"),
              (b"x-sandlot-forwarded", b"a-guess"), (b"authorization", b"Bearer sl_mine")]
    scope = {"type": "http", "method": "GET", "path": "/v1/sandboxes/sb-0123456789",
             "raw_path": b"/v1/sandboxes/sb-0123456789", "query_string": b"",
             "headers": forged}
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await peers.relay(scope, receive, send, "http://host-b", body=b"")
    await peers.close()
    out = seen[0].headers
    assert out.get_list("x-sandlot-forwarded") == ["the-peer-token"]
    assert "x-sandlot-principal" not in out and "x-sandlot-forked-from" not in out
    assert out["authorization"] == "Bearer sl_mine"  # the host that runs it checks the key
    there = {"type": "http", "headers": [(k.encode(), v.encode()) for k, v in out.items()],
             "app": type("App", (), {"state": type("S", (), {"peers": peers})()})()}
    assert peer_principal(there) is None
