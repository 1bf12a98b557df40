"""E2B template builds, fast tier: the steps checked, and every refusal of the build routes as
E2B's 4xx (the builds themselves: tests/e2b/test_e2b_templates.py)."""

from __future__ import annotations

import httpx
import pytest

from harness import tar_gz
from sandlot.core.models import TemplateInfo
from sandlot.errors import InvalidArgumentError
from sandlot.images import steps
from sandlot.testing import in_process

HASH = "a" * 64


@pytest.mark.parametrize("step, words", [
    ({"type": "ADD", "args": ["x"]}, "unknown type"),
    ({"type": "RUN", "args": []}, "a command"),
    ({"type": "RUN", "args": ["ls", "bad user!"]}, "invalid user"),
    ({"type": "ENV", "args": ["A"]}, "pairs"),
    ({"type": "ENV", "args": ["1A", "x"]}, "variable name"),
    ({"type": "WORKDIR", "args": ["relative"]}, "absolute"),
    ({"type": "COPY", "args": ["../etc/passwd", "/x"], "filesHash": HASH}, "inside the build"),
    ({"type": "COPY", "args": ["/etc/passwd", "/x"], "filesHash": HASH}, "inside the build"),
    ({"type": "COPY", "args": ["a", "/x"]}, "filesHash"),
    ({"type": "COPY", "args": ["a", "/x", "", "999"], "filesHash": HASH}, "mode"),
    ("RUN ls", "object"),
])
def test_bad_steps_are_refused_by_number(step, words) -> None:
    with pytest.raises(InvalidArgumentError) as ei:
        steps.parse_steps([{"type": "USER", "args": ["root"]}, step])
    assert "step 2" in ei.value.message and words in ei.value.message


@pytest.fixture
async def api(tmp_path):
    async with in_process(tmp_path) as srv:
        keys = {"a": srv.key, "b": await srv.add_key("b")}
        client = httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url)

        async def call(method: str, path: str, who: str = "a", **kw) -> httpx.Response:
            return await client.request(method, "/e2b" + path,
                                        headers={"x-api-key": keys[who]}, **kw)
        yield srv, call, client
        await client.aclose()


async def test_bad_build_requests_answer_e2b_4xx(api) -> None:
    srv, call, client = api
    for body, status, words in (
            ({}, 400, "name is required"), ({"name": "Bad Name"}, 400, "invalid template name"),
            ({"name": "image-x"}, 400, "sandlot's own"),
            ({"name": "t", "cpuCount": 99}, 400, "cpuCount"),
            ({"name": "t", "memoryMB": 1 << 30}, 400, "memoryMB"),
            ({"name": "t", "minFreeDiskMb": -1}, 400, "minFreeDiskMb"),
            ({"name": "t", "tags": ["Bad Tag"]}, 400, "invalid tag"),
            ({"name": "base"}, 403, "not yours"),  # the operator's template
            ([1], 400, "")):
        r = await call("POST", "/v3/templates", json=body)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"code", "message"} and words in r.json()["message"]

    r = await call("POST", "/v3/templates", json={"name": "t:v1", "cpuCount": 1})
    assert r.status_code == 202
    made = r.json()
    assert made["templateID"] == "t" and made["tags"] == ["v1"]
    build = f"/templates/t/builds/{made['buildID']}"
    status = (await call("GET", build + "/status")).json()
    assert status["status"] == "waiting" and status["logEntries"] == []
    assert (await call("GET", build + "/status", who="b")).status_code == 404
    assert (await call("GET", "/templates/t/builds/nope/status")).status_code == 404
    assert (await call("GET", build + "/status", params={"logsOffset": -1})).status_code == 400

    start = f"/v2{build}"
    for body, status, words in (
            ({"fromImage": "x", "steps": [{"type": "ADD", "args": []}]}, 400, "unknown type"),
            ({"fromTemplate": "nothing", "steps": []}, 404, "not found"),
            ({"fromTemplate": "t", "steps": []}, 400, "itself"),
            ({"steps": []}, 400, "fromImage or fromTemplate"),
            ({"fromImage": "NOT a ref", "steps": []}, 400, "reference"),
            ({"fromImage": "x", "steps": [{"type": "COPY", "args": ["a", "/a"],
                                           "filesHash": HASH}]}, 400, "not uploaded"),
            ({"fromImage": "x", "fromImageRegistry": {"type": "aws"}}, 400, "awsAccessKeyId"),
            ({"fromImage": "x", "fromImageRegistry": {"type": "gcp"}}, 400,
             "serviceAccountJson"),
            ({"fromImage": "x", "fromImageRegistry": {"type": "ftp"}}, 400, "unknown"),
            ({"fromImage": "x", "fromImageRegistry": {"type": "registry", "username": "u"}},
             400, "username and a password"),
            ({"fromImage": "x", "fromImageRegistry": {"type": "registry", "username": "a:b",
                                                      "password": "p"}}, 400, "without ':'")):
        r = await call("POST", start, json=body)
        assert r.status_code == status, (body, r.text)
        assert words in r.json()["message"]
    assert (await call("POST", start, who="b", json={"fromImage": "x"})).status_code == 404


async def test_uploads_are_a_tenants_own(api) -> None:
    srv, call, client = api
    assert (await call("GET", "/templates/t/files/short")).status_code == 400
    link = (await call("GET", f"/templates/t/files/{HASH}")).json()
    assert link["present"] is False and "/e2b/template-uploads/" in link["url"]
    path = link["url"].split(srv.url, 1)[1]
    assert (await client.put(path, content=b"not a tar")).status_code == 400
    assert (await client.put(path + "x", content=tar_gz({"a": b"1"}))).status_code == 404
    r = await client.put(path, content=tar_gz({"app/main.py": b"print(1)"}))
    assert r.status_code == 200
    assert (await client.put(path, content=tar_gz({"a": b"1"}))).status_code == 404  # once
    assert (await call("GET", f"/templates/t/files/{HASH}")).json()["present"] is True
    assert (await call("GET", f"/templates/t/files/{HASH}", who="b")).json()["present"] \
        is False
    link = (await call("GET", f"/templates/t/files/{'b' * 64}")).json()
    evil = tar_gz({"../../escape": b"x"})
    r = await client.put(link["url"].split(srv.url, 1)[1], content=evil)
    assert r.status_code == 400


async def test_another_tenants_template_is_not_theirs(api) -> None:
    srv, call, client = api
    index = srv.core.settings.images / "templates"
    base = srv.core.templates.get("base")
    tenant_a = (await srv.core.authenticate(srv.key)).tenant
    owned = TemplateInfo(**(base.model_dump() | {"name": "a-env", "owner": tenant_a}))
    (index / "a-env.json").write_text(owned.model_dump_json())
    assert (await call("GET", "/templates/aliases/a-env")).json()["templateID"] == "a-env"
    assert (await call("GET", "/templates/aliases/a-env", who="b")).status_code == 403
    assert (await call("GET", "/templates/aliases/nothing", who="b")).status_code == 404
    assert (await call("POST", "/v3/templates", who="b", json={"name": "a-env"})
            ).status_code == 403
    assert (await call("POST", "/sandboxes", who="b", json={"templateID": "a-env"})
            ).status_code == 404
    assert (await call("DELETE", "/templates/a-env", who="b")).status_code == 404
    assert (await call("DELETE", "/templates/base")).status_code == 403
    assert (await call("DELETE", "/templates/a-env")).status_code == 204
    assert (await call("GET", "/templates/aliases/a-env")).status_code == 404


async def test_requested_builds_are_bounded(api) -> None:
    srv, call, client = api
    from sandlot.core.builds import MAX_UNSTARTED

    for _ in range(MAX_UNSTARTED):
        assert (await call("POST", "/v3/templates", json={"name": "many"})).status_code == 202
    r = await call("POST", "/v3/templates", json={"name": "many"})
    assert r.status_code == 409 and "not started" in r.json()["message"]
    assert (await call("POST", "/v3/templates", who="b", json={"name": "theirs"})
            ).status_code == 202  # another tenant's bound is its own


async def test_odd_names_answer_4xx(api) -> None:
    import urllib.parse

    srv, call, client = api
    for bad in (" ", "A" * 300, "a/../b", "ünïcode", "x\x00y", ":tag",
                "a" * 64 + ":" + "b" * 200, "%2e%2e"):
        q = urllib.parse.quote(bad, safe="")
        for method, path in (("GET", f"/templates/aliases/{q}"),
                             ("GET", f"/templates/{q}/files/{q}"),
                             ("GET", f"/templates/{q}/builds/{q}/status"),
                             ("POST", f"/v2/templates/{q}/builds/{q}"),
                             ("DELETE", f"/templates/{q}"),
                             ("PUT", f"/template-uploads/{q}")):
            r = await (call(method, path, json={"fromImage": "x"}) if method == "POST"
                       else call(method, path))
            assert 400 <= r.status_code < 500 or r.status_code == 501, (method, bad, r.text)
            assert set(r.json()) == {"code", "message"}
        r = await call("POST", "/v3/templates", json={"name": bad})
        assert r.status_code in (400, 403), (bad, r.text)


async def test_uploads_are_bounded_unpacked_and_per_tenant(tmp_path) -> None:
    """A small gzip of a large file is refused by its unpacked size; a tenant's kept uploads
    stay within their bound, the oldest dropped first (the SDK then uploads them again)."""
    from sandlot.config import Limits

    limits = Limits(build_upload_bytes=1 << 20, build_uploads_bytes=5000)
    async with in_process(tmp_path, limits=limits) as srv:
        client = httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url)
        headers = {"x-api-key": srv.key}

        async def put(files_hash: str, files: dict[str, bytes]) -> httpx.Response:
            link = (await client.get(f"/e2b/templates/t/files/{files_hash}",
                                     headers=headers)).json()
            return await client.put(link["url"].split(srv.url, 1)[1], content=tar_gz(files))

        async def present(files_hash: str) -> bool:
            return (await client.get(f"/e2b/templates/t/files/{files_hash}",
                                     headers=headers)).json()["present"]

        bomb = await put("c" * 64, {"zeros": bytes(3 << 20)})
        assert len(tar_gz({"zeros": bytes(3 << 20)})) < 1 << 20
        assert bomb.status_code == 413 and "unpacked" in bomb.json()["message"]
        assert not await present("c" * 64)
        assert (await put("a" * 64, {"f": b"1" * 3000})).status_code == 200
        assert (await put("b" * 64, {"f": b"2" * 3000})).status_code == 200
        assert not await present("a" * 64) and await present("b" * 64)
        await client.aclose()
