"""Bad input never gets a 500, a dropped connection or a host path (issue 22, item 4), in
process on the fake runtime: bodies that are not UTF-8 or nest too deep on every E2B JSON
route and envd RPC; template names with a NUL or over 255 bytes; snapshot ids of any other
form than sandlot's; a pause short of room (503, like create and fork); host-side errors
(their paths are not shown); an unknown E2B template (the server's templates are not listed)."""

from __future__ import annotations

import json
import struct
import urllib.parse

import httpx
import pytest
from fastapi.routing import APIRoute

from sandlot.errors import CapacityError, StorageError, VmmError, without_paths
from sandlot.server import errors
from sandlot.server.e2b import api as e2b_api
from sandlot.server.e2b.envd import REQUESTS, SERVICES
from sandlot.testing import in_process

DEEP = b"[" * 100_000 + b"]" * 100_000
NOT_UTF8 = b'{"templateID": "\xff\xfe"}'
BAD_IDS = ["snap-../x", "snap-" + "a" * 5000, "snap-", "snap-%00", "a\x00b", "t" * 300,
           "../../etc/passwd", "snap-0123456789\n"]


@pytest.fixture
async def api(tmp_path):
    async with in_process(tmp_path) as srv:
        transport = httpx.ASGITransport(srv.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=srv.url) as http:
            http.srv = srv
            http.rest = {"authorization": f"Bearer {srv.key}"}
            http.e2b = {"x-api-key": srv.key}
            yield http


def host_paths(srv) -> list[str]:
    s = srv.core.settings
    return [str(p) for p in (s.data_dir, s.images, s.run_root, s.shm_root)]


def clean(srv, r: httpx.Response, *statuses: int) -> None:
    assert r.status_code in statuses, (r.request.method, r.request.url, r.status_code, r.text)
    for path in host_paths(srv):
        assert path not in r.text, r.text


def e2b_json_routes() -> list[tuple[str, str]]:
    out = []
    for route in e2b_api.router.routes:
        if isinstance(route, APIRoute) and "{rest" not in route.path:
            for method in route.methods & {"POST", "PUT", "PATCH"}:
                out.append((method, route.path.replace("{sandbox_id}", "sb-0123456789")))
    return out


async def test_bodies_that_are_not_utf8_or_nest_too_deep(api) -> None:
    routes = e2b_json_routes()
    assert len(routes) >= 10
    for method, path in routes:
        for body in (DEEP, NOT_UTF8, b"\x00\x01", b'{"a":' * 5000):
            r = await api.request(method, path, content=body,
                                  headers={**api.e2b, "content-type": "application/json"})
            clean(api.srv, r, 400, 404)
            assert set(r.json()) == {"code", "message"}
    for body in (DEEP, NOT_UTF8):
        r = await api.post("/v1/sandboxes", content=body,
                           headers={**api.rest, "content-type": "application/json"})
        clean(api.srv, r, 400)
        assert r.json()["error"]["type"] == "InvalidArgumentError"
    r = await api.get("/v1/sandboxes", params={"metadata": "[" * 20_000},
                      headers=api.rest)
    clean(api.srv, r, 400)


async def test_envd_rpcs_refuse_bad_json(api) -> None:
    r = await api.post("/v1/sandboxes", json={}, headers=api.rest)
    sandbox_id = r.json()["sandbox_id"]
    headers = {**api.e2b, "e2b-sandbox-id": sandbox_id}
    for service, (unary, server_stream, client_stream) in SERVICES.items():
        for method in unary:
            for body in (DEEP, NOT_UTF8):
                r = await api.post(f"/e2b/envd/{service}/{method}", content=body,
                                   headers={**headers, "content-type": "application/json"})
                clean(api.srv, r, 400)
                assert r.json()["code"] == "invalid_argument"
        for method in (*server_stream, *client_stream):
            for body in (DEEP, NOT_UTF8):
                envelope = struct.pack(">BI", 0, len(body)) + body
                r = await api.post(f"/e2b/envd/{service}/{method}", content=envelope,
                                   headers={**headers,
                                            "content-type": "application/connect+json"})
                clean(api.srv, r, 200, 400)
                assert b"invalid_argument" in r.content, (method, r.content[:300])


# Wrong-typed values for each field of envd's requests (their types: envd.REQUESTS).
WRONG = [5, "x", [], {}, True, -1, "99999999999999999999", {"pid": "x"}, {"pid": []},
         {"tag": {}}, {"cmd": 5}, {"args": "x"}, {"envs": {"A": 1}}, {"size": {"cols": "x"}},
         {"stdin": 5}, {"process": 5}, {"input": {"stdin": 5}}]


async def test_envd_rpcs_refuse_fields_of_the_wrong_type(api) -> None:
    """Every field of every envd request, given values of other types: a 400
    invalid_argument (an end-stream error for streams), never an internal error."""
    r = await api.post("/v1/sandboxes", json={}, headers=api.rest)
    headers = {**api.e2b, "e2b-sandbox-id": r.json()["sandbox_id"]}
    for service, (unary, server_stream, client_stream) in SERVICES.items():
        for method, schema in REQUESTS[service].items():
            names = [*schema, *(f"{k}.{sub}" for k, v in schema.items()
                                if isinstance(v, dict) for sub in v)]
            for name in names:
                for value in WRONG:
                    msg = {name: value} if "." not in name else \
                        {name.split(".")[0]: {name.split(".")[1]: value}}
                    body = json.dumps(msg).encode()
                    if method in unary:
                        r = await api.post(f"/e2b/envd/{service}/{method}", content=body,
                                           headers={**headers,
                                                    "content-type": "application/json"})
                        clean(api.srv, r, 200, 400, 404, 409)  # some values fit a field
                        continue
                    envelope = struct.pack(">BI", 0, len(body)) + body
                    r = await api.post(f"/e2b/envd/{service}/{method}", content=envelope,
                                       headers={**headers, "connect-timeout-ms": "200",
                                                "content-type": "application/connect+json"})
                    clean(api.srv, r, 200)
                    assert b'"internal"' not in r.content, (method, msg, r.content[-200:])
            assert method in (*unary, *server_stream, *client_stream)
    r = await api.post("/e2b/envd/filesystem.Filesystem/Stat", json={"path": 5},
                       headers=headers)
    assert r.status_code == 400 and r.json() == {"code": "invalid_argument",
                                                 "message": "path must be a string"}


async def test_template_names_and_snapshot_ids_of_no_valid_form(api) -> None:
    for bad in BAD_IDS:
        for body in ({"template": bad}, {"snapshot_id": bad}):
            r = await api.post("/v1/sandboxes", json=body, headers=api.rest)
            clean(api.srv, r, 400, 404)
        r = await api.post("/e2b/sandboxes", json={"templateID": bad}, headers=api.e2b)
        clean(api.srv, r, 400, 404)
        quoted = urllib.parse.quote(bad, safe="")
        r = await api.get(f"/v1/snapshots/{quoted}", headers=api.rest)
        clean(api.srv, r, 400, 404)
        r = await api.delete(f"/e2b/templates/{quoted}", headers=api.e2b)
        clean(api.srv, r, 400, 404, 501)
    assert not api.srv.core.sandboxes.live


async def test_an_unknown_e2b_template_lists_nothing(api) -> None:
    r = await api.post("/e2b/sandboxes", json={"templateID": "nope"}, headers=api.e2b)
    clean(api.srv, r, 404)
    assert "base" not in r.json()["message"]


async def test_a_pause_short_of_room_is_a_503(api, monkeypatch) -> None:
    r = await api.post("/v1/sandboxes", json={}, headers=api.rest)
    sandbox_id = r.json()["sandbox_id"]

    async def no_room(*args, **kwargs):
        raise CapacityError("the image cache has 3 MiB free; a capture needs more")

    monkeypatch.setattr(api.srv.runtime, "capture", no_room)
    r = await api.post(f"/v1/sandboxes/{sandbox_id}/pause", headers=api.rest)
    clean(api.srv, r, 503)
    assert r.json()["error"]["type"] == "CapacityError"
    r = await api.post(f"/e2b/sandboxes/{sandbox_id}/pause", headers=api.e2b)
    clean(api.srv, r, 503)
    assert sandbox_id in api.srv.core.sandboxes.live  # it keeps running


@pytest.mark.parametrize("error", [StorageError, VmmError, RuntimeError])
async def test_host_side_errors_name_no_host_path(api, monkeypatch, error) -> None:
    r = await api.post("/v1/sandboxes", json={}, headers=api.rest)
    sandbox_id = r.json()["sandbox_id"]
    disk = api.srv.core.settings.data_dir / "disks" / sandbox_id / "overlay.qcow2"

    async def fails(*args, **kwargs):
        raise error(f"writing {disk}: No space left on device (/srv/other/file.bin)")

    monkeypatch.setattr(api.srv.runtime, "capture", fails)
    answers = []
    r = await api.post(f"/v1/sandboxes/{sandbox_id}/snapshots", headers=api.rest, json={})
    answers.append(r)  # taken in the background: the failure is the snapshot's `error`
    snapshot_id = r.json()["snapshot_id"]
    answers.append(await api.post(f"/v1/snapshots/{snapshot_id}/wait", headers=api.rest))
    answers.append(await api.get(f"/v1/snapshots/{snapshot_id}", headers=api.rest))
    assert answers[-1].json()["state"] == "failed" and answers[-1].json()["error"]
    answers.append(await api.post(f"/e2b/sandboxes/{sandbox_id}/snapshots", headers=api.e2b,
                                  json={}))
    answers.append(await api.post(f"/v1/sandboxes/{sandbox_id}/pause", headers=api.rest))
    answers.append(await api.get(f"/v1/sandboxes/{sandbox_id}", headers=api.rest))
    for r in answers:
        clean(api.srv, r, 200, 201, 404, 500, 502)
        assert "/srv/other" not in r.text and "overlay.qcow2" not in r.text, r.text
        assert json.loads(r.text)  # answered, not dropped


def test_messages_lose_host_paths() -> None:
    errors.add_host_roots("/var/lib/sandlot-test-root", "s3://bucket/prefix", "/")
    said = errors.redact("reading /var/lib/sandlot-test-root/store/manifests/x.json: gone; "
                         "guest file /tmp/x, /var/lib/sandlot-test-rootless/y")
    assert said == ("reading <host path>: gone; guest file /tmp/x, "
                    "/var/lib/sandlot-test-rootless/y")
    assert errors.public_message(StorageError("writing /srv/a/b.qcow2: full.")) == \
        "writing <host path>: full."
    assert errors.public_message(RuntimeError("/secret/x")) == \
        "internal error (RuntimeError); the server's log has the details"
    assert without_paths("no path here, nor /etc") == "no path here, nor /etc"
