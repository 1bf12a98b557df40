"""Templates built through the API and their builds, as the hosts of a deployment share them
(two in-process hosts on the fake runtime, one PostgreSQL): a host that remembers a template
uses what another host rebuilt, and forgets one another host deleted; a build requested on
one host is started on another, and its status and logs are answered by both, also after a
restart (the builds themselves, with real VMs: tests/vm/test_cluster_templates.py)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import httpx
import pytest

from sandlot.core.models import TemplateInfo
from sandlot.core.tenancy import Principal
from sandlot.errors import NotFoundError
from sandlot.testing import in_process


@contextlib.asynccontextmanager
async def hosts(tmp_path, database: str, runtimes=None):
    async with contextlib.AsyncExitStack() as stack:
        made = []
        for i, name in enumerate("ab"):
            made.append(await stack.enter_async_context(in_process(
                tmp_path / name, runtime=runtimes[i] if runtimes else None,
                database_url=database, host_id=f"h-{name}", store=str(tmp_path / "store"))))
        yield made


def new_database(postgres) -> str:
    return postgres.new_database("tpl" + secrets.token_hex(4))


def client(srv, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url + "/e2b",
                             headers={"x-api-key": key})


async def test_a_host_uses_the_template_another_host_rebuilt(tmp_path, postgres) -> None:
    async with hosts(tmp_path, new_database(postgres)) as (a, b):
        base = a.core.templates.get("base")
        v1 = TemplateInfo(**(base.model_dump() | {"name": "env", "owner": "test",
                                                  "snapshot_id": "snap-1", "recipe": "r1"}))
        await a.core.templates.put(v1)
        assert (await b.core.templates.info("env")).snapshot_id == "snap-1"
        assert b.core.templates.get("env").snapshot_id == "snap-1"  # remembered on b
        await a.core.templates.put(v1.model_copy(update={"snapshot_id": "snap-2",
                                                         "recipe": "r2"}))
        assert (await b.core.templates.info("env")).snapshot_id == "snap-2"
        assert b.core.templates.get("env").snapshot_id == "snap-2"
        assert [t.name for t in await b.core.templates.listing()] == ["base", "env"]
        async with client(b, b.key) as http:  # b's tenant is "test", as a's
            assert (await http.get("/templates/aliases/env")).status_code == 200
            assert (await http.delete("/templates/env")).status_code == 204
        with pytest.raises(NotFoundError):
            await a.core.templates.info("env")
        with pytest.raises(NotFoundError):
            a.core.templates.get("env")  # forgotten on a too
        assert [t.name for t in await a.core.templates.listing()] == ["base"]
        # the operator builds a template of that name on a host since: it is used there
        operator = base.model_copy(update={"name": "env"})
        (a.core.settings.images / "templates" / "env.json").write_text(
            operator.model_dump_json())
        assert (await a.core.templates.info("env")) == operator


async def test_a_template_made_public_on_one_host_is_public_on_another(tmp_path,
                                                                        postgres) -> None:
    async with hosts(tmp_path, new_database(postgres)) as (a, b):
        other = Principal("other")
        await a.core.db.add_key("sl_other_key", other.tenant)
        base = a.core.templates.get("base")
        await a.core.templates.put(TemplateInfo(**(base.model_dump() | {
            "name": "env", "owner": "test", "snapshot_id": "snap-1"})))
        assert (await b.core.templates.info("env")).public is False  # remembered on b
        async with client(a, a.key) as on_a:
            r = await on_a.patch("/v2/templates/env", json={"public": True})
            assert r.status_code == 200, r.text
        assert (await b.core.templates.info("env", other)).public is True
        assert [t.name for t in await b.core.templates.listing(other)] == ["base"]
        async with client(b, "sl_other_key") as on_b:
            assert (await on_b.patch("/templates/env", json={"public": False})).status_code \
                == 403
        async with client(b, b.key) as on_b:
            assert (await on_b.patch("/templates/env", json={"public": False})).status_code \
                == 200
        with pytest.raises(NotFoundError):
            await a.core.templates.info("env", other)


async def wait_status(http: httpx.AsyncClient, path: str) -> dict:
    for _ in range(500):
        status = (await http.get(path)).json()
        if status["status"] in ("ready", "error"):
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"the build did not end: {status}")


async def test_a_builds_status_is_answered_by_every_host_and_after_a_restart(
        tmp_path, postgres) -> None:
    database = new_database(postgres)
    async with hosts(tmp_path, database) as (a, b):
        runtimes = [a.runtime, b.runtime]
        key = a.key
        async with client(a, key) as on_a, client(b, key) as on_b:
            made = (await on_a.post("/v3/templates", json={"name": "env"})).json()
            status = f"/templates/env/builds/{made['buildID']}/status"
            assert (await on_b.get(status)).json()["status"] == "waiting"  # requested on a
            # started on b (the fake guest has no shell: the build fails making the user)
            r = await on_b.post(f"/v2/templates/env/builds/{made['buildID']}",
                                json={"fromTemplate": "base", "steps": []})
            assert r.status_code == 202, r.text
            assert (await on_a.post(f"/v2/templates/env/builds/{made['buildID']}",
                                    json={"fromTemplate": "base"})).status_code == 409
            done = await wait_status(on_b, status)
            assert done["status"] == "error" and "user account" in done["reason"]["message"]
            for http in (on_a, on_b):
                seen = (await http.get(status)).json()
                assert seen["status"] == "error" and seen["reason"] == done["reason"]
                assert [e["message"] for e in seen["logEntries"]] == \
                    [e["message"] for e in done["logEntries"]]
                assert "queued" in seen["logEntries"][0]["message"]
            page = (await on_a.get(status, params={"logsOffset": 1, "limit": 1})).json()
            assert [e["message"] for e in page["logEntries"]] == \
                [done["logEntries"][1]["message"]]
            assert (await on_a.get(status.replace("/env/", "/other/"))).status_code == 404
    # both hosts restarted: the finished build is still known
    async with hosts(tmp_path, database, runtimes) as (a, b), client(b, key) as on_b:
        again = (await on_b.get(status)).json()
        assert again["status"] == "error" and again["reason"] == done["reason"]
        assert len(again["logEntries"]) == len(done["logEntries"])


async def test_a_build_running_when_its_host_stops_fails(tmp_path) -> None:
    from sandlot.core.builds import Build

    async with in_process(tmp_path) as srv:
        runtime = srv.runtime
        build = Build(build_id="b-1", name="env", owner="test", cpus=1, memory_mb=512,
                      tags=["default"], status="building", started=True,
                      host=srv.core.host_id)
        build.log("step 1")
        await srv.core.builds._save(build)
    async with in_process(tmp_path, runtime=runtime) as srv:
        async with client(srv, srv.key) as http:
            status = (await http.get("/templates/env/builds/b-1/status")).json()
        assert status["status"] == "error"
        assert "restarted" in status["reason"]["message"]
        assert [e["message"] for e in status["logEntries"]] == ["step 1"]
