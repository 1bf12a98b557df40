"""How template build records reach the metadata store (SQLite here): a request reads the
unfinished builds once, keeps its checks (another tenant's build of the name, the tenant's
limits), and a running build is saved only when its status or its logs changed."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from sandlot.config import Limits
from sandlot.core import builds as builds_mod
from sandlot.core.builds import Build, TemplateBuilds
from sandlot.core.db.sqlite import SqliteStore
from sandlot.core.templates import TemplateStore
from sandlot.core.tenancy import Principal
from sandlot.errors import ConflictError, NotFoundError, PermissionDeniedError
from sandlot.testing import fake_settings


class CountingStore(SqliteStore):
    """SQLite, counting the build listings and the build writes."""

    listings = 0
    puts = 0

    async def builds(self, states=None, host=None):
        self.listings += 1
        return await super().builds(states, host)

    async def put_build(self, *args, **kwargs) -> None:
        self.puts += 1
        await super().put_build(*args, **kwargs)


@pytest.fixture
def builds(tmp_path):
    settings = fake_settings(tmp_path)
    db = CountingStore(settings.db_path)
    yield TemplateBuilds(settings, TemplateStore(settings, None, db), None, db, "h-1")


ALICE, BOB = Principal("alice"), Principal("bob")


async def test_a_request_lists_the_unfinished_builds_once(builds) -> None:
    first = await builds.request("env", None, None, None, None, ALICE)
    assert (builds.db.listings, first.state) == (1, "requested")
    running = Build(build_id="b-run", name="other", owner="bob", cpus=1, memory_mb=512,
                    tags=["default"], status="building", started=True, host="h-2")
    await builds._save(running)
    with pytest.raises(PermissionDeniedError, match="being built by another team"):
        await builds.request("other", None, None, None, None, ALICE)
    builds.settings = dataclasses.replace(builds.settings, limits=Limits(key_builds=1))
    with pytest.raises(ConflictError, match="1 builds of yours are running"):
        await builds.request("mine", None, None, None, None, BOB)
    await builds.request("mine", None, None, None, None, ALICE)  # alice runs none


async def test_unstarted_requests_are_limited(builds, monkeypatch) -> None:
    monkeypatch.setattr(builds_mod, "MAX_UNSTARTED", 2)
    for _ in range(2):
        await builds.request("env", None, None, None, None, ALICE)
    with pytest.raises(ConflictError, match="requested and not started"):
        await builds.request("env", None, None, None, None, ALICE)
    await builds.request("env", None, None, None, None, BOB)


async def test_a_running_build_is_saved_when_it_changed(builds, monkeypatch) -> None:
    monkeypatch.setattr(builds_mod, "SAVE_INTERVAL", 0)
    build = Build(build_id="b-1", name="env", owner="alice", cpus=1, memory_mb=512,
                  tags=["default"], status="building", started=True, host="h-1")
    saver = asyncio.create_task(builds._save_while_running(build))
    for _ in range(50):
        await asyncio.sleep(0)
    assert builds.db.puts == 1  # once, then unchanged
    build.log("a line")
    for _ in range(50):
        await asyncio.sleep(0)
    assert builds.db.puts == 2
    assert [d["message"] for d in await builds.db.build_logs("b-1", 0, 10)] == ["a line"]
    build.status = "ready"
    for _ in range(50):
        await asyncio.sleep(0)
    saver.cancel()
    assert builds.db.puts == 3
    assert (await builds.db.get_build("b-1"))["status"] == "ready"


async def test_recover_fails_the_builds_this_host_ran(builds) -> None:
    for bid, host in (("b-here", "h-1"), ("b-there", "h-2")):
        await builds._save(Build(build_id=bid, name="env", owner="alice", cpus=1,
                                 memory_mb=512, tags=["default"], status="building",
                                 started=True, host=host))
    await builds.recover()
    here = await builds.db.get_build("b-here")
    assert (here["status"], here["error"]) == ("error", "BuildError")
    assert (await builds.db.get_build("b-there"))["status"] == "building"
    assert [d["build_id"] for d in await builds.db.builds(("error",))] == ["b-here"]


async def test_template_names_are_checked_before_a_lookup(builds) -> None:
    for name in ("", "Bad", "env:Bad", "env:a:b", "env:default:default"):
        with pytest.raises(NotFoundError, match="not found"):
            await builds.templates.info(name)
        with pytest.raises(NotFoundError, match="not found"):
            await builds.templates.current(name)
