"""E2B's template tags with the unmodified e2b SDK (AsyncTemplate.assign_tags, remove_tags,
get_tags; AsyncSandbox.create("name:tag")) on the fake runtime: the templates' builds are
made here as a build makes them (a snapshot each), so no build runs (builds with tags and
real VMs: tests/e2b/test_e2b_templates.py)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from e2b import AsyncSandbox, AsyncTemplate
from e2b.exceptions import SandboxException, TemplateException
from fastkit import two_tenants

from sandlot.core.models import CreateSandbox, SnapshotState, TemplateInfo, now
from sandlot.errors import NotFoundError


@pytest.fixture
async def env(tmp_path):
    async with two_tenants(tmp_path, "sl_tags") as (core, keys, url):
        yield core, keys, {t: {"api_url": f"{url}/e2b", "sandbox_url": f"{url}/e2b/envd",
                               "api_key": k} for t, k in keys.items()}


async def made(core, who, text: str) -> TemplateInfo:
    """A build of template `env` as a build leaves it: a snapshot of a sandbox holding
    /version."""
    rec = await core.sandboxes.create(CreateSandbox(template="base"), who=who)
    async def body():
        yield text.encode()
    await core.files.write(rec.sandbox_id, "/version", body(), who=who)
    snap = await core.sandboxes.snapshot(rec.sandbox_id, memory=True, who=who)
    snap = await core.snapshots.wait(snap.snapshot_id, 60, who=who)
    assert snap.state == SnapshotState.READY
    await core.sandboxes.kill(rec.sandbox_id, who=who)
    base = core.templates.get("base")
    return base.model_copy(update={"name": "env", "owner": who.tenant, "built_at": now(),
                                   "snapshot_id": snap.snapshot_id,
                                   "build_id": str(uuid.uuid4())})


async def version(template: str, opts: dict) -> str:
    sbx = await AsyncSandbox.create(template, **opts)
    try:
        return await sbx.files.read("/version")
    finally:
        await sbx.kill()


async def test_tags_assigned_listed_used_and_removed(env) -> None:
    core, keys, opts = env
    who = await core.authenticate(keys["a"])
    one, two = await made(core, who, "one"), await made(core, who, "two")
    await core.builds._point("env", ["default"], one)
    await core.builds._point("env", ["v2"], two)

    tags = {t.tag: t.build_id for t in await AsyncTemplate.get_tags("env", **opts["a"])}
    assert tags == {"default": one.build_id, "v2": two.build_id}
    assigned = await AsyncTemplate.assign_tags("env:v2", ["prod", "stable"], **opts["a"])
    assert assigned.build_id == two.build_id and assigned.tags == ["prod", "stable"]
    assert (await AsyncTemplate.assign_tags("env", "first", **opts["a"])).build_id == \
        one.build_id
    assert await version("env", opts["a"]) == "one"
    assert await version("env:default", opts["a"]) == "one"
    assert await version("env:prod", opts["a"]) == "two"
    assert await version("env:first", opts["a"]) == "one"

    await AsyncTemplate.remove_tags("env", ["v2", "stable"], **opts["a"])
    await AsyncTemplate.remove_tags("env", "no-such-tag", **opts["a"])  # E2B: no error
    assert {t.tag for t in await AsyncTemplate.get_tags("env", **opts["a"])} == \
        {"default", "prod", "first"}
    assert (await core.snapshots.get(two.snapshot_id, who)).state == SnapshotState.READY
    await AsyncTemplate.remove_tags("env", "prod", **opts["a"])  # no tag names it: dropped
    with pytest.raises(NotFoundError):
        await core.snapshots.get(two.snapshot_id, who)
    with pytest.raises(SandboxException) as ei:
        await AsyncSandbox.create("env:prod", **opts["a"])
    assert "not found" in str(ei.value).lower()
    with pytest.raises(TemplateException) as ei:
        await AsyncTemplate.remove_tags("env", "default", **opts["a"])
    assert "default" in str(ei.value)

    # another tenant sees none of it, and changes none of it
    with pytest.raises(TemplateException):
        await AsyncTemplate.get_tags("env", **opts["b"])
    with pytest.raises(TemplateException):
        await AsyncTemplate.assign_tags("env", "mine", **opts["b"])
    with pytest.raises(SandboxException):
        await AsyncSandbox.create("env:first", **opts["b"])

    # a delete takes the tags and their builds with it
    api = opts["a"]["api_url"]
    async with httpx.AsyncClient() as http:
        r = await http.delete(f"{api}/templates/env", headers={"x-api-key": keys["a"]})
        assert r.status_code == 204, r.text
        r = await http.get(f"{api}/templates/env/tags", headers={"x-api-key": keys["a"]})
        assert r.status_code == 404 and set(r.json()) == {"code", "message"}
    with pytest.raises(NotFoundError):
        await core.snapshots.get(one.snapshot_id, who)


async def test_bad_tag_requests_answer_4xx(env) -> None:
    core, keys, opts = env
    api = opts["a"]["api_url"]
    headers = {"x-api-key": keys["a"]}
    async with httpx.AsyncClient(headers=headers) as http:
        for method, body, status in (
                ("POST", {"target": "base", "tags": ["x"]}, 403),  # the operator's
                ("POST", {"target": "nothing", "tags": ["x"]}, 404),
                ("POST", {"target": "base", "tags": []}, 400),
                ("POST", {"target": "base", "tags": ["Bad Tag"]}, 400),
                ("POST", {"target": "Bad Name", "tags": ["x"]}, 400),
                ("POST", {"tags": ["x"]}, 400),
                ("POST", [1], 400),
                ("DELETE", {"name": "nothing", "tags": ["x"]}, 404),
                ("DELETE", {"name": "base", "tags": ["x"]}, 403),
                ("DELETE", {"name": "base", "tags": ["default"]}, 400)):
            r = await http.request(method, f"{api}/templates/tags", json=body)
            assert r.status_code == status, (method, body, r.text)
            assert set(r.json()) == {"code", "message"}
        r = await http.get(f"{api}/templates/nothing/tags")
        assert r.status_code == 404
        tags = (await http.get(f"{api}/templates/base/tags")).json()  # the operator's: shown
        assert [t["tag"] for t in tags] == ["default"]
        r = await http.post(f"{api}/v3/templates", json={"name": "t", "tags": ["x", "y"]})
        assert r.status_code == 202 and r.json()["tags"] == ["default", "x", "y"]
