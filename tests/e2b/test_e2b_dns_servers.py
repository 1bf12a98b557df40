"""E2B's `network.dns_servers` with the unmodified `e2b` SDK and real VMs: with every
destination denied, the addresses given as DNS servers are still reached (all traffic to
them), on create, after `update_network`, across a pause and resume, and in a fork.

The "internet" is a network namespace this module makes, reachable from the host over a veth
(tests/harness.py `own_internet`): web servers "A" and "B" on two of its addresses. Nothing
here talks to anything outside this machine.
"""

from __future__ import annotations

import secrets

import pytest
from e2b import Sandbox

from harness import own_internet
from sandlot.testing import unused_subnet

SFX = secrets.token_hex(3)
NET = unused_subnet()  # not another run's
WEB_A, WEB_B = str(NET[2]), str(NET[3])
DENY_ALL = ["0.0.0.0/0"]

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    with own_internet(tmp_path_factory.mktemp("web"), f"slt-dns-{SFX}", f"sltdns{SFX}", NET):
        yield


def sites(sbx: Sandbox) -> set[str]:
    """The test's web sites the sandbox reaches ("site-A", "site-B")."""
    out = sbx.commands.run(f"for a in {WEB_A} {WEB_B}; do curl -s -m 3 http://$a/; done; true",
                           timeout=120)
    return set(out.stdout.split())


def test_dns_servers_are_reached_where_all_is_denied(web, server_factory):
    srv = server_factory(SANDLOT_POOL_SIZE="0")
    opts = {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd",
            "api_key": srv.key}
    sbx = Sandbox.create("base", timeout=600, **opts,
                         network={"deny_out": DENY_ALL, "dns_servers": [WEB_B]})
    made = [sbx]
    try:
        assert sites(sbx) == {"site-B"}
        assert sbx.get_info().network["dns_servers"] == [WEB_B]
        # the guest's resolv.conf is left as it is: the sandbox's own nameserver
        assert "10.0.2.3" in sbx.files.read("/etc/resolv.conf")

        sbx.update_network({"deny_out": DENY_ALL, "dns_servers": [WEB_A]})
        assert sites(sbx) == {"site-A"}
        sbx.update_network({"deny_out": DENY_ALL, "dns_servers": []})
        assert sites(sbx) == set()
        sbx.update_network({"deny_out": DENY_ALL, "dns_servers": [WEB_A]})

        assert sbx.pause() is True
        sbx = Sandbox.connect(sbx.sandbox_id, **opts)  # resumes it
        assert sites(sbx) == {"site-A"}
        forks = sbx.fork(count=1)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        made += forks
        assert sites(forks[0]) == {"site-A"}
        assert forks[0].get_info().network["dns_servers"] == [WEB_A]

        sbx.update_network({"deny_out": DENY_ALL})  # left out: none (E2B's default)
        assert sites(sbx) == set()
        assert "dns_servers" not in (sbx.get_info().network or {})
    finally:
        for s in made:
            s.kill()
