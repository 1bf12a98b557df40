"""E2B's template listings (GET /templates, /v2/templates, /templates/{id}) and sandbox logs
(GET /sandboxes/{id}/logs, /v2/...), called through the unmodified e2b SDK's generated
client (the E2B CLI's calls; no SDK method wraps them), on the fake runtime. Each answers
what the caller's key may see: another key gets 404."""

from __future__ import annotations

import json
import uuid

import pytest
from e2b.api.client.api.sandboxes import (
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.api.templates import (
    get_templates,
    get_templates_template_id,
    get_v2_templates,
)
from e2b.api.client.models import (
    LogLevel,
    LogsDirection,
    SandboxLogs,
    SandboxLogsV2Response,
    Template,
    TemplateWithBuilds,
)
from e2b.api.client_async import get_api_client
from e2b.connection_config import ConnectionConfig
from fastkit import two_tenants

from sandlot.core.builds import Build
from sandlot.core.models import CreateSandbox, now
from sandlot.errors import NotFoundError


@pytest.fixture
async def env(tmp_path):
    async with two_tenants(tmp_path, "sl_list") as (core, keys, url):
        clients = {t: get_api_client(ConnectionConfig(api_url=f"{url}/e2b", api_key=k))
                   for t, k in keys.items()}
        yield core, keys, clients


def build_of(who, name: str, status: str, cpus: int = 1, memory_mb: int = 256) -> Build:
    """A started build of template `name` by `who`'s tenant, in `status`."""
    return Build(build_id=str(uuid.uuid4()), name=name, owner=who.tenant, cpus=cpus,
                 memory_mb=memory_mb, tags=["default"], status=status, started=True)


async def own_template(core, who, name: str) -> str:
    """A template `who` built (as a build leaves it: a record and the template)."""
    build = build_of(who, name, "ready")
    await core.builds._save(build)
    base = core.templates.get("base")
    await core.templates.put(base.model_copy(update={
        "name": name, "owner": who.tenant, "built_at": now(), "build_id": build.build_id}))
    return build.build_id


async def test_templates_listed_for_their_key(env) -> None:
    core, keys, client = env
    a = await core.authenticate(keys["a"])
    build_id = await own_template(core, a, "a-env")
    waiting = build_of(a, "a-next", "building", cpus=2, memory_mb=512)
    await core.builds._save(waiting)

    res = await get_templates.asyncio_detailed(client=client["a"])
    assert res.status_code == 200, res.content
    listed = {t.template_id: t for t in res.parsed}
    assert all(isinstance(t, Template) for t in res.parsed)
    assert set(listed) == {"base", "a-env", "a-next"}
    assert listed["base"].public is True and listed["base"].build_status.value == "ready"
    mine = listed["a-env"]
    assert mine.public is False and mine.build_id == build_id and mine.names == ["a-env"]
    assert mine.aliases == ["a-env"] and mine.envd_version and mine.disk_size_mb > 0
    assert listed["a-next"].build_status.value == "building"
    assert listed["a-next"].cpu_count == 2 and listed["a-next"].memory_mb == 512

    other = await get_templates.asyncio_detailed(client=client["b"])
    assert {t.template_id for t in other.parsed} == {"base"}  # never another key's

    page = await get_v2_templates.asyncio_detailed(client=client["a"], limit=2)
    rest = await get_v2_templates.asyncio_detailed(
        client=client["a"], limit=2, next_token=page.headers["x-next-token"])
    assert len(page.parsed) == 2 and "x-next-token" not in rest.headers
    assert {t.template_id for t in page.parsed + rest.parsed} == set(listed)


async def test_a_template_with_its_builds(env) -> None:
    core, keys, client = env
    a = await core.authenticate(keys["a"])
    build_id = await own_template(core, a, "a-env")
    failed = build_of(a, "a-env", "error")
    await core.builds._save(failed)

    res = await get_templates_template_id.asyncio_detailed("a-env", client=client["a"])
    assert res.status_code == 200, res.content
    assert isinstance(res.parsed, TemplateWithBuilds)
    assert res.parsed.build_id == build_id and res.parsed.build_count == 2
    builds = {str(b.build_id): b.status.value for b in res.parsed.builds}
    assert builds == {build_id: "ready", failed.build_id: "error"}
    base = await get_templates_template_id.asyncio_detailed("base", client=client["b"])
    assert base.status_code == 200 and base.parsed.public is True
    assert len(base.parsed.builds) == 1 and base.parsed.builds[0].status.value == "ready"

    for name in ("a-env", "nothing"):
        res = await get_templates_template_id.asyncio_detailed(name, client=client["b"])
        assert res.status_code == 404 and name in json.loads(res.content)["message"]


async def test_deleting_templates(env) -> None:
    """A key deletes its own templates; the operator's answer 403 (E2B's answer to a
    template of another team), another key's 404."""
    core, keys, client = env
    a = await core.authenticate(keys["a"])
    await own_template(core, a, "a-env")
    http = client["b"].get_async_httpx_client()
    r = await http.delete("/templates/a-env")
    assert r.status_code == 404
    r = await http.delete("/templates/base")
    assert r.status_code == 403 and "operator" in r.json()["message"]
    r = await client["a"].get_async_httpx_client().delete("/templates/a-env")
    assert r.status_code == 204
    res = await get_templates.asyncio_detailed(client=client["a"])
    assert {t.template_id for t in res.parsed} == {"base"}


async def test_sandbox_logs(env) -> None:
    core, keys, client = env
    a = await core.authenticate(keys["a"])
    rec = await core.sandboxes.create(CreateSandbox(template="base"), who=a)
    sid = rec.sandbox_id

    res = await get_sandboxes_sandbox_id_logs.asyncio_detailed(sid, client=client["a"])
    assert res.status_code == 200, res.content
    assert isinstance(res.parsed, SandboxLogs)
    first = res.parsed.log_entries[0]
    assert sid in first.message and "template base" in first.message
    assert first.level == LogLevel.INFO and first.fields["sandboxID"] == sid
    assert res.parsed.logs[0].line == first.message
    later = int(first.timestamp.timestamp() * 1000) + 1
    res = await get_sandboxes_sandbox_id_logs.asyncio_detailed(sid, client=client["a"],
                                                               start=later)
    assert res.parsed.log_entries == []

    v2 = await get_v_2_sandboxes_sandbox_id_logs.asyncio_detailed(
        sid, client=client["a"], direction=LogsDirection.BACKWARD, search="template")
    assert v2.status_code == 200 and isinstance(v2.parsed, SandboxLogsV2Response)
    assert [e.message for e in v2.parsed.logs] == [first.message]
    v2 = await get_v_2_sandboxes_sandbox_id_logs.asyncio_detailed(
        sid, client=client["a"], level=LogLevel.ERROR)
    assert v2.parsed.logs == []

    await core.sandboxes.pause(sid, who=a)
    res = await get_sandboxes_sandbox_id_logs.asyncio_detailed(sid, client=client["a"])
    assert [e.message for e in res.parsed.log_entries][-1] == f"Sandbox {sid} paused"

    for call in (get_sandboxes_sandbox_id_logs, get_v_2_sandboxes_sandbox_id_logs):
        res = await call.asyncio_detailed(sid, client=client["b"])
        assert res.status_code == 404  # another key's sandbox
        assert sid in json.loads(res.content)["message"]
    http = client["a"].get_async_httpx_client()
    for bad in ({"direction": "sideways"}, {"level": "loud"}, {"limit": -1}):
        r = await http.get(f"/v2/sandboxes/{sid}/logs", params=bad)
        assert r.status_code == 400 and set(r.json()) == {"code", "message"}


async def test_an_image_pulled_with_a_tenants_login_is_its_own(env) -> None:
    """The template of an image a build pulled with its own registry login (core's
    `private_image`) is used by that tenant only, and not listed (it is sandlot's own); that
    tenant may delete it."""
    core, keys, client = env
    a, b = await core.authenticate(keys["a"]), await core.authenticate(keys["b"])
    base = core.templates.get("base")
    await core.templates.put(base.model_copy(update={
        "name": "image-t0123456789abcdef", "image": "127.0.0.1:1/x@sha256:" + "0" * 64,
        "owner": a.tenant}))
    assert (await core.templates.info("image-t0123456789abcdef", a)).owner == a.tenant
    with pytest.raises(NotFoundError):
        await core.templates.info("image-t0123456789abcdef", b)
    for key in "ab":
        res = await get_templates.asyncio_detailed(client=client[key])
        assert {t.template_id for t in res.parsed} == {"base"}
    # its tenant deletes it (E2B's DELETE /templates/{id}), another cannot
    http = {key: client[key].get_async_httpx_client() for key in "ab"}
    assert (await http["b"].delete("/templates/image-t0123456789abcdef")).status_code == 404
    assert (await http["a"].delete("/templates/image-t0123456789abcdef")).status_code == 204
    with pytest.raises(NotFoundError):
        await core.templates.info("image-t0123456789abcdef", a)
    assert (await http["a"].delete("/templates/image-0123456789abcdef")).status_code == 404


async def test_build_logs_from_a_time(env) -> None:
    """E2B's GET /templates/{id}/builds/{build}/logs (cursor, direction, level)."""
    from e2b.api.client.api.templates import get_templates_template_id_builds_build_id_logs
    from e2b.api.client.models import TemplateBuildLogsResponse

    core, keys, client = env
    a = await core.authenticate(keys["a"])
    build = build_of(a, "a-env", "error")
    for n in range(3):
        build.log(f"line {n}")
    build.log("it broke", "error")
    await core.builds._save(build)
    call = get_templates_template_id_builds_build_id_logs.asyncio_detailed
    res = await call("a-env", build.build_id, client=client["a"])
    assert res.status_code == 200 and isinstance(res.parsed, TemplateBuildLogsResponse)
    assert [e.message for e in res.parsed.logs] == ["line 0", "line 1", "line 2", "it broke"]
    res = await call("a-env", build.build_id, client=client["a"], level=LogLevel.ERROR)
    assert [e.message for e in res.parsed.logs] == ["it broke"]
    last = int(build.logs[-1].at.timestamp() * 1000)
    res = await call("a-env", build.build_id, client=client["a"], cursor=last,
                     direction=LogsDirection.BACKWARD, limit=2)
    assert [e.message for e in res.parsed.logs][0] == "it broke"
    assert len(res.parsed.logs) == 2
    res = await call("a-env", build.build_id, client=client["b"])
    assert res.status_code == 404  # another key's build
