"""E2B's template update (`PATCH /templates/{id}`, `/v2/templates/{id}`: public or not) on the
fake runtime, two tenants: a public template is created from by every key (by its name and
by `name:tag`, with the unmodified e2b SDK), listed and changed by its owner's keys alone;
the operator's templates answer 403, an unknown one 404. Through PostgreSQL and two hosts:
tests/unit/test_template_records.py."""

from __future__ import annotations

import httpx
import pytest
from e2b import AsyncSandbox, AsyncTemplate
from e2b.api.client.api.templates import patch_v_2_templates_template_id as patch_v2
from e2b.api.client.client import Client
from e2b.api.client.models import TemplateUpdateRequest
from e2b.exceptions import SandboxException, TemplateException
from fastkit import two_tenants
from test_e2b_template_tags import made, version


@pytest.fixture
async def env(tmp_path):
    async with two_tenants(tmp_path, "sl_pub") as (core, keys, url):
        yield core, keys, {t: {"api_url": f"{url}/e2b", "sandbox_url": f"{url}/e2b/envd",
                               "api_key": k} for t, k in keys.items()}


def http(opts: dict) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=opts["api_url"], headers={"x-api-key": opts["api_key"]})


async def listed(opts: dict) -> dict[str, bool]:
    async with http(opts) as h:
        r = await h.get("/templates")
        assert r.status_code == 200, r.text
        return {t["templateID"]: t["public"] for t in r.json()}


async def test_a_public_template_is_every_keys_to_use_and_its_owners_to_change(env) -> None:
    core, keys, opts = env
    who = await core.authenticate(keys["a"])
    await core.builds._point("env", ["default"], await made(core, who, "one"))
    await core.builds._point("env", ["v2"], await made(core, who, "two"))
    with pytest.raises(SandboxException):
        await AsyncSandbox.create("env", **opts["b"])

    # made public through the SDK's generated client (no SDK method wraps the call)
    async with Client(base_url=opts["a"]["api_url"],
                      headers={"X-API-KEY": keys["a"]}) as client:
        r = await patch_v2.asyncio_detailed("env", client=client,
                                            body=TemplateUpdateRequest(public=True))
    assert r.status_code == 200 and r.parsed.names == ["env"]
    assert await version("env", opts["b"]) == "one"
    assert await version("env:v2", opts["b"]) == "two"
    assert (await listed(opts["a"]))["env"] is True  # its owner's listing says so
    assert "env" not in await listed(opts["b"])  # E2B lists a team's own
    async with http(opts["b"]) as h:
        r = await h.get("/templates/aliases/env")
        assert r.status_code == 200 and r.json() == {"templateID": "env", "public": True}

    # only its owner changes it: update, tags, delete, a build of the name
    async with http(opts["b"]) as h:
        for method, path, body in (("PATCH", "/templates/env", {"public": False}),
                                   ("PATCH", "/v2/templates/env", {"public": False}),
                                   ("POST", "/templates/tags", {"target": "env", "tags": ["x"]}),
                                   ("DELETE", "/templates/tags", {"name": "env", "tags": ["v2"]}),
                                   ("DELETE", "/templates/env", None),
                                   ("POST", "/v3/templates", {"name": "env"})):
            r = await h.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert set(r.json()) == {"code", "message"}
    with pytest.raises(TemplateException):
        await AsyncTemplate.assign_tags("env", "mine", **opts["b"])
    assert await version("env", opts["b"]) == "one"

    # a rebuild (the default tag moved) keeps it public; private again: the other key's
    # creates are refused, its owner's are not
    await core.builds._point("env", ["default"], await made(core, who, "three"))
    assert await version("env", opts["b"]) == "three"
    async with http(opts["a"]) as h:
        r = await h.patch("/templates/env", json={"public": False})
        assert r.status_code == 200 and r.content == b""
        r = await h.patch("/v2/templates/env", json={})  # nothing to change
        assert r.status_code == 200 and r.json() == {"names": ["env"]}
    assert (await listed(opts["a"]))["env"] is False
    for name in ("env", "env:v2"):
        with pytest.raises(SandboxException):
            await AsyncSandbox.create(name, **opts["b"])
    assert await version("env:v2", opts["a"]) == "two"

    # deleted and built again by its owner: private
    async with http(opts["a"]) as h:
        assert (await h.patch("/templates/env", json={"public": True})).status_code == 200
        assert (await h.delete("/templates/env")).status_code == 204
    await core.builds._point("env", ["default"], await made(core, who, "four"))
    assert (await listed(opts["a"]))["env"] is False
    with pytest.raises(SandboxException):
        await AsyncSandbox.create("env", **opts["b"])


async def test_bad_updates_answer_4xx(env) -> None:
    core, keys, opts = env
    await core.builds._point("env", ["default"],
                             await made(core, await core.authenticate(keys["a"]), "one"))
    async with http(opts["a"]) as h:
        for path, body, status in (("/templates/base", {"public": False}, 403),  # operator's
                                   ("/v2/templates/base", {"public": True}, 403),
                                   ("/templates/nothing", {"public": True}, 404),
                                   ("/v2/templates/nothing", {"public": True}, 404),
                                   ("/templates/Bad%20Name", {"public": True}, 400),
                                   ("/templates/env", {"public": "yes"}, 400),
                                   ("/templates/env", [1], 400)):
            r = await h.patch(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            assert set(r.json()) == {"code", "message"}
    async with http(opts["b"]) as h:  # another tenant's private template: unknown
        r = await h.patch("/templates/env", json={"public": True})
        assert r.status_code == 404
    assert (await listed(opts["a"]))["env"] is False
