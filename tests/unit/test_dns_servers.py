"""E2B's `network.dns_servers` and REST's `dns_servers` on the fake runtime: what reaches the
sandbox's network policy on create and update (the unmodified e2b SDK), kept across pause
and resume and in a fork, and bad lists answered 400 with a message (the rules themselves,
in namespaces: tests/unit/test_network.py; with real VMs: tests/e2b/test_e2b_dns_servers.py)."""

from __future__ import annotations

import httpx
import pytest
from e2b import AsyncSandbox
from fastkit import two_tenants

DENY_ALL = ["0.0.0.0/0"]


@pytest.fixture
async def env(tmp_path):
    async with two_tenants(tmp_path, "sl_dns") as (core, keys, url):
        yield core, keys["a"], url


def servers(core, sandbox_id: str) -> tuple[str, ...]:
    """The DNS servers of the sandbox's network policy, as its VM has it now."""
    return core.sandboxes.live[sandbox_id].vm.network.dns_servers


async def test_dns_servers_reach_the_policy_and_stay(env) -> None:
    core, key, url = env
    opts = {"api_url": f"{url}/e2b", "sandbox_url": f"{url}/e2b/envd", "api_key": key}
    sbx = await AsyncSandbox.create("base", network={"deny_out": DENY_ALL,
                                                     "dns_servers": ["192.0.2.53"]}, **opts)
    assert servers(core, sbx.sandbox_id) == ("192.0.2.53",)
    assert (await sbx.get_info()).network["dns_servers"] == ["192.0.2.53"]
    await sbx.update_network({"deny_out": DENY_ALL, "dns_servers": ["192.0.2.1", "192.0.2.2"]})
    assert servers(core, sbx.sandbox_id) == ("192.0.2.1", "192.0.2.2")
    assert await sbx.pause()
    sbx = await AsyncSandbox.connect(sbx.sandbox_id, **opts)
    assert servers(core, sbx.sandbox_id) == ("192.0.2.1", "192.0.2.2")
    [child] = await sbx.fork(count=1)
    assert servers(core, child.sandbox_id) == ("192.0.2.1", "192.0.2.2")
    await sbx.update_network({"deny_out": DENY_ALL, "dns_servers": []})
    assert servers(core, sbx.sandbox_id) == ()
    assert (await sbx.get_info()).network["dns_servers"] == []
    await sbx.update_network({"deny_out": DENY_ALL})  # left out: none given
    assert servers(core, sbx.sandbox_id) == ()
    assert "dns_servers" not in (await sbx.get_info()).network

    async with httpx.AsyncClient(base_url=f"{url}/v1",
                                 headers={"authorization": f"Bearer {key}"}) as http:
        r = await http.post("/sandboxes", json={"template": "base", "network": {
            "deny_out": DENY_ALL, "dns_servers": ["192.0.2.9"]}})
        assert r.status_code == 201, r.text
        sid = r.json()["sandbox_id"]
        assert servers(core, sid) == ("192.0.2.9",)
        r = await http.put(f"/sandboxes/{sid}/network", json={"allow_out": ["192.0.2.7"]})
        assert r.status_code == 200, r.text
        assert r.json()["network"] == {"allow_out": ["192.0.2.7"], "deny_out": DENY_ALL,
                                       "dns_servers": ["192.0.2.9"]}  # the rest as it was
        r = await http.put(f"/sandboxes/{sid}/network", json={"dns_servers": []})
        assert r.status_code == 200 and servers(core, sid) == ()


@pytest.mark.parametrize("dns", [["example.com"], ["::1"], ["192.0.2.0/24"], ["1.2.3"],
                                 ["192.0.2.1 "], [""], ["192.0.2.1"] * 11])
async def test_dns_servers_that_are_not_ipv4_addresses_answer_400(env, dns) -> None:
    core, key, url = env
    async with httpx.AsyncClient(base_url=url, headers={"x-api-key": key,
                                                        "authorization": f"Bearer {key}"}
                                 ) as http:
        r = await http.post("/e2b/sandboxes", json={"templateID": "base",
                                                    "network": {"dnsServers": dns}})
        assert r.status_code == 400, r.text
        assert "dns_servers" in r.json()["message"]
        r = await http.post("/v1/sandboxes", json={"template": "base",
                                                   "network": {"dns_servers": dns}})
        assert r.status_code == 400, r.text
        assert "dns_servers" in r.json()["error"]["message"]
        made = (await http.post("/e2b/sandboxes", json={"templateID": "base"})).json()
        r = await http.put(f"/e2b/sandboxes/{made['sandboxID']}/network",
                           json={"dnsServers": dns})
        assert r.status_code == 400 and "dns_servers" in r.json()["message"], r.text
    assert not any(lv.record.network and lv.record.network.dns_servers
                   for lv in core.sandboxes.live.values())


async def test_dns_servers_of_the_wrong_type_answer_400(env) -> None:
    _, key, url = env
    async with httpx.AsyncClient(base_url=f"{url}/e2b", headers={"x-api-key": key}) as http:
        for dns in ("192.0.2.1", [1], {"a": 1}):
            r = await http.post("/sandboxes", json={"templateID": "base",
                                                    "network": {"dnsServers": dns}})
            assert r.status_code == 400 and set(r.json()) == {"code", "message"}, r.text
