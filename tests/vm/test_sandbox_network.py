"""Sandbox networking with real VMs: outbound access and DNS, isolation, exposed ports,
egress rules, networking after fork, and cleanup.

The "internet" is a network namespace this module makes, reachable from the host over a veth:
    host ── sltnet<sfx> N.1/24 ═ netns slt-web-<sfx>: N.2 web "A" + dnsmasq,  (N: this run's
                                                     N.3 web "B"         /24 of 198.18.0.0/15)
Nothing here talks to anything outside this machine.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from snapkit import wait_for

from harness import cleanup, make_server, own_internet, qemu_pids, sh
from sandlot import Sandbox, Sandlot
from sandlot.testing import unused_subnet

SFX = secrets.token_hex(3)
WEB_NS = f"slt-web-{SFX}"
WEB_VETH = f"sltnet{SFX}"
WEB = unused_subnet()  # not another run's
HOST_IP, WEB_A, WEB_B = (str(WEB[i]) for i in (1, 2, 3))

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """The test's own internet: two web servers and a DNS server in a namespace."""
    with own_internet(tmp_path_factory.mktemp("web"), WEB_NS, WEB_VETH, WEB,
                       dns_name="svc-b.test"):
        yield


@pytest.fixture(scope="module")
def net_server(web, tmp_path_factory):
    """A server whose sandboxes resolve names through the test's DNS server."""
    srv = make_server(tmp_path_factory.mktemp("net"), "net")
    srv.extra_env.update({"SANDLOT_DNS": WEB_A, "SANDLOT_NET_POOL": "10.207.0.0/16"})
    srv.start()
    yield srv
    cleanup(srv)


@pytest.fixture
def make(net_server):
    made: list[Sandbox] = []

    def create(**kw) -> Sandbox:
        box = Sandbox.create(**net_server.client_kwargs(), timeout=600, **kw)
        made.append(box)
        return box

    yield create
    for box in made:
        box.kill()


PROBE = """
import socket, sys
ok = []
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(1.5)
    try:
        s.connect((host, int(port)))
        ok.append(target)
    except OSError:
        pass
    finally:
        s.close()
print(" ".join(ok))
"""


def reachable(box: Sandbox, *targets: str) -> list[str]:
    """Which of host:port `targets` the guest can open a TCP connection to."""
    box.files.write("/tmp/probe.py", PROBE)
    out = box.commands.run(f"python3 /tmp/probe.py {' '.join(targets)}", timeout=120)
    return out.stdout.split()


def curl(box: Sandbox, url: str) -> str:
    r = box.commands.run(f"curl -s -m 5 {url}", timeout=60)
    return r.stdout.strip() if r.exit_code == 0 else f"curl failed ({r.exit_code})"


def host_addresses() -> list[str]:
    out = sh("ip", "-4", "-o", "addr", "show")
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


def namespace_of(server, box: Sandbox) -> str:
    owner = "".join(c for c in server.instance.lower() if c.isalnum())[:16]
    return f"sl-{owner}.{box.sandbox_id}"


def test_outbound_and_dns(make):
    box = make()
    assert curl(box, f"http://{WEB_A}/") == "site-A"
    assert box.commands.run("getent hosts svc-b.test").stdout.split()[0] == WEB_B
    assert curl(box, "http://svc-b.test/") == "site-B"


def test_no_internet(make, net_server):
    with Sandlot(**net_server.client_kwargs()) as client:
        wait_for(lambda: (p := client.health()["pool"]["base"])["ready"] == p["size"],
                 timeout=90, what="a full warm pool")
        claimed = client.health()["pool"]["base"]["claimed"]
        box = make(internet=False)  # a pooled sandbox, restored with internet: rules at claim
        assert client.health()["pool"]["base"]["claimed"] == claimed + 1
    assert curl(box, f"http://{WEB_A}/").startswith("curl failed")
    assert box.commands.run("getent hosts svc-b.test").exit_code != 0
    fresh = make(internet=False, memory_mb=640)  # not from the pool: restored offline
    assert curl(fresh, f"http://{WEB_A}/").startswith("curl failed")


def test_host_and_loopback_unreachable(make, net_server):
    """A server on every host address, the sandlot API too: the guest reaches none of them."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        box = make()
        api_port = net_server.port
        targets = [f"{addr}:{p}" for addr in ["127.0.0.1", "10.0.2.2", "10.0.2.3",
                                              *host_addresses()]
                   for p in (port, api_port)]
        # The host itself can connect to them (the probe is not vacuous).
        for host, p in [(a, port) for a in host_addresses()] + [("127.0.0.1", api_port)]:
            with socket.create_connection((host, p), timeout=2):
                pass
        assert reachable(box, *targets) == []
        assert reachable(box, f"{WEB_A}:80") == [f"{WEB_A}:80"]  # while the internet works
    finally:
        stop.set()
        thread.join(2)
        listener.close()


def test_sandboxes_cannot_reach_each_other(make, net_server):
    a = make()
    b = make()
    a.commands.run("python3 -m http.server 8000 >/dev/null 2>&1 &")
    ns_a = namespace_of(net_server, a)
    addrs = sh("ip", "-n", ns_a, "-4", "-o", "addr", "show", "dev", "eth0")
    ns_addr = addrs.split()[3].split("/")[0]
    host_side = str(ns_addr[: ns_addr.rfind(".")]) + "." + str(int(ns_addr.rsplit(".", 1)[1]) - 1)
    deadline = time.monotonic() + 30
    while "8000" not in a.commands.run("ss -lnt").stdout and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reachable(a, "127.0.0.1:8000") == ["127.0.0.1:8000"]
    assert reachable(b, f"{ns_addr}:8000", f"{host_side}:8000", "10.0.2.15:8000") == []


def test_exposed_ports_on_parent_and_forks(make):
    parent = make()
    parent.commands.run("mkdir -p /srv/www && echo parent > /srv/www/index.html && "
                        "cd /srv/www && python3 -m http.server 8080 >/dev/null 2>&1 &")
    host = parent.get_host(8080)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}/", timeout=2).text == "parent\n":
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    assert httpx.get(f"http://{host}/", timeout=5).text == "parent\n"

    snap = parent.create_snapshot()
    snap.wait(timeout=120)
    assert httpx.get(f"http://{host}/", timeout=5).text == "parent\n"

    children = parent.fork(3)
    assert len(children) == 3 and not children.errors
    hosts = set()
    for i, child in enumerate(children):
        child.commands.run(f"echo child-{i} > /srv/www/index.html")
        child_host = child.get_host(8080)
        hosts.add(child_host)
        assert httpx.get(f"http://{child_host}/", timeout=5).text == f"child-{i}\n"
        assert curl(child, f"http://{WEB_A}/") == "site-A"  # outbound works at once too
        child.kill()
    assert httpx.get(f"http://{host}/", timeout=5).text == "parent\n"
    assert host not in hosts and len(hosts) == 3

    restored = Sandbox.create(snapshot_id=snap.snapshot_id, api_url=parent._api.api_url,
                              api_key=parent._api.api_key)
    try:
        assert httpx.get(f"http://{restored.get_host(8080)}/", timeout=10).text == "parent\n"
    finally:
        restored.kill()
        snap.remove()


def test_egress_rules(make):
    box = make(network={"allow_out": [f"{WEB_A}/32"]})
    assert curl(box, f"http://{WEB_A}/") == "site-A"
    assert curl(box, f"http://{WEB_B}/").startswith("curl failed")
    box.set_network(allow_out=[], deny_out=[WEB_A])
    assert curl(box, f"http://{WEB_A}/").startswith("curl failed")
    assert curl(box, f"http://{WEB_B}/") == "site-B"
    box.set_network(deny_out=[])
    assert curl(box, f"http://{WEB_A}/") == "site-A"
    box.set_network(internet=False)
    assert curl(box, f"http://{WEB_B}/").startswith("curl failed")


def test_no_leftovers_after_kill_and_restart(net_server):
    kw = net_server.client_kwargs()
    a = Sandbox.create(**kw)
    b = Sandbox.create(**kw)
    prefix = namespace_of(net_server, a).rsplit(".", 1)[0] + "."

    def ours() -> set[str]:
        return {n.split()[0] for n in sh("ip", "netns", "list").splitlines()
                if n.startswith(prefix)}

    assert {namespace_of(net_server, a), namespace_of(net_server, b)} <= ours()
    a.kill()
    assert namespace_of(net_server, a) not in ours()

    net_server.stop(signal.SIGKILL)
    os.kill(b.info.pid, signal.SIGKILL)  # b dies while no server watches
    net_server.start()
    assert not Sandbox.connect(b.sandbox_id, **kw).is_running()
    # The warm pool may already be refilling (new namespaces of its own): none of a's or b's.
    assert not ours() & {namespace_of(net_server, a), namespace_of(net_server, b)}
    assert b.info.pid not in qemu_pids(net_server.run_root)
    aliases = [Path(f"/sys/class/net/{n}/ifalias").read_text().strip()
               for n in os.listdir("/sys/class/net") if n.startswith("slv")]
    assert not [a for a in aliases if a.endswith(a_id := b.sandbox_id)], a_id


def test_traffic_to_an_exposed_port_resumes_a_paused_auto_resume_sandbox(make):
    """auto_resume: a paused sandbox's exposed port keeps listening at the same address; a
    connection to it brings the sandbox back (its server process included) and is served."""
    box = make(auto_resume=True)
    box.commands.run("mkdir -p /srv/www && echo awake > /srv/www/index.html && "
                     "cd /srv/www && python3 -m http.server 8081 >/dev/null 2>&1 &")
    host = box.get_host(8081)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert httpx.get(f"http://{host}/", timeout=2).text == "awake\n"
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the guest's web server did not come up"
            time.sleep(0.2)
    box.pause()
    assert box.get_info().state == "paused"
    assert httpx.get(f"http://{host}/", timeout=120).text == "awake\n"  # the same address
    assert box.get_info().state == "running"
    assert box.get_host(8081) == host

    plain = make()  # without auto_resume a pause closes its ports
    plain.commands.run("cd /srv && python3 -m http.server 8082 >/dev/null 2>&1 &")
    plain_host = plain.get_host(8082)
    plain.pause()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{plain_host}/", timeout=5)
    assert plain.get_info().state == "paused"
