"""E2B template builds on a deployment of two `sandlot serve` hosts (a real PostgreSQL and a
real S3 store on loopback), with the unmodified e2b SDK: a template built on host a is
created on host b; rebuilt on a with a change (a new snapshot, the old one dropped), b, which
remembers the first build, creates from the new one (and from its tag); the build's status
and logs are answered by b; a delete through b is seen by a. Host b keeps its own template
index (a host of a real deployment has its own images dir), its builds shared with a."""

from __future__ import annotations

import secrets

import httpx
import pytest
from e2b import Sandbox, Template

from harness import cleanup, start_cluster
from sandlot import Sandlot

TIMEOUT = 900
NAME = "cluster-tpl-" + secrets.token_hex(3)


@pytest.fixture(scope="module")
def pair(s3, postgres, tmp_path_factory):
    """Two hosts, each with a template index of its own (`start_cluster`)."""
    hosts = start_cluster(s3, postgres, tmp_path_factory, {"a": 4, "b": 4}, "ctpl",
                          SANDLOT_HEARTBEAT="1")
    yield hosts
    httpx.delete(f"{hosts['a'].url}/e2b/templates/{NAME}",
                 headers={"X-API-KEY": hosts["a"].key})  # if the test stopped before its delete
    for srv in hosts.values():
        cleanup(srv)


def opts(srv) -> dict:
    return {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd",
            "api_key": srv.key}


def version(srv, template: str = NAME) -> str:
    with Sandbox.create(template, timeout=300, **opts(srv)) as sbx:
        assert sbx.get_info().sandbox_id
        return sbx.files.read("/home/user/version").strip()


def test_a_rebuilt_template_is_used_by_every_host(pair) -> None:
    a, b = pair["a"], pair["b"]
    admin = Sandlot(**b.client_kwargs())
    admin.hosts.drain("host-a")  # creates go to b; builds still run where they are asked
    try:
        Template.build(Template().from_base_image().run_cmd(
            "echo one > /home/user/version"), NAME, cpu_count=1, memory_mb=512, **opts(a))
        assert version(b) == "one"
        logs: list[str] = []
        info = Template.build(Template().from_base_image().run_cmd(
            "echo two > /home/user/version"), NAME, cpu_count=1, memory_mb=512, tags=["v2"],
            on_build_logs=lambda e: logs.append(str(e.message)), **opts(a))
        assert version(b) == "two"  # b remembered the first build; it uses the second
        assert version(b, f"{NAME}:v2") == "two"
        assert {t.tag: t.build_id for t in Template.get_tags(NAME, **opts(b))} == \
            {"default": info.build_id, "v2": info.build_id}

        # the build's status and logs, asked from the host that did not run it
        status = Template.get_build_status(info, logs_offset=0, **opts(b))
        assert status.status.value == "ready"
        said = [e.message for e in status.log_entries]
        assert said[0] == f"Build {info.build_id} of template {NAME} queued"
        assert any("echo two" in m for m in said)
        assert [m for m in logs if m in said] == said  # what the SDK printed while on a
    finally:
        admin.hosts.activate("host-a")

    # deleted through b: gone for a too
    r = httpx.delete(f"{b.url}/e2b/templates/{NAME}", headers={"X-API-KEY": b.key})
    assert r.status_code == 204, r.text
    assert Template.exists(NAME, **opts(a)) is False
    with pytest.raises(Exception) as ei:
        Sandbox.create(NAME, **opts(a))
    assert "not found" in str(ei.value).lower()
