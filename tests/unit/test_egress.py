"""Image pulls reach only registries the operator allows (images/egress.py): the address
policy, judged after DNS resolution, and a registry reference to a loopback port refused on
REST and E2B create without a connection reaching it, with the one error every failed pull
gets."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from sandlot.config import Settings
from sandlot.images import egress, oci
from sandlot.images.pipeline import registry_access
from sandlot.testing import in_process


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "0.0.0.0", "10.1.2.3", "172.16.0.1", "192.168.1.1",
    "100.64.0.1", "100.127.255.254", "169.254.169.254", "224.0.0.1", "255.255.255.255",
    "::1", "::", "fc00::1", "fd12:3456::1", "fe80::1", "ff02::1", "::ffff:127.0.0.1",
    "::ffff:10.0.0.1", "64:ff9b::a00:1", "2002:7f00:1::1", "2002:a9fe:a9fe::1",
    "not-an-address",
])
def test_addresses_that_are_not_public(address) -> None:
    assert not egress.public_address(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888",
                                     "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses(address) -> None:
    assert egress.public_address(address)


def test_policy_is_checked_after_resolution(monkeypatch) -> None:
    default = egress.Policy()
    for host in ("localhost", "127.0.0.1:5000", "[::1]:5000", "10.0.0.1", "127.1:80"):
        with pytest.raises(egress.Refused):
            default.check(host)
    # a name is judged by what it resolves to, every address of it
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, **kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))])
    with pytest.raises(egress.Refused, match="10.0.0.7"):
        default.check("registry.example")
    assert egress.Policy(frozenset({"registry.example"})).check("registry.example:5000")


def test_policy_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(egress.ALLOW_ENV, raising=False)
    assert egress.Policy.parse(Settings.from_env().registries) == egress.Policy(frozenset(),
                                                                                 True)
    assert egress.Policy.parse("") == egress.Policy(frozenset(), True)
    monkeypatch.setenv(egress.ALLOW_ENV, "Reg.internal:5000, public")
    monkeypatch.setenv(oci.INSECURE_ENV, "127.0.0.1:5001")
    policy = registry_access(Settings.from_env()).registries
    assert policy.public and policy.names("reg.internal", 5000)
    assert not policy.names("reg.internal", 5001)
    assert policy.names("127.0.0.1", 5001)  # insecure registries are named by the operator
    assert policy.check("127.0.0.1:5001") == ["127.0.0.1"]
    only = egress.Policy.parse("mirror.internal")
    assert not only.public and only.names("mirror.internal", 443)
    with pytest.raises(egress.Refused, match="not named"):
        only.check("8.8.8.8")
    assert egress.Policy.parse("docker.io").names(egress.DOCKER_HUB, 443)


@pytest.fixture
def listener():
    """A plain TCP listener on a loopback port, to show that nothing connected to it."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    yield sock
    sock.close()


def no_connection(sock: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        sock.accept()


def test_resolve_refuses_before_any_connection(listener, monkeypatch) -> None:
    monkeypatch.delenv(egress.ALLOW_ENV, raising=False)
    monkeypatch.delenv(oci.INSECURE_ENV, raising=False)
    port = listener.getsockname()[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::ffff:7f00:1]:{port}",
                 f"[::1]:{port}"):
        ref = oci.parse_reference(f"{host}/x:1")
        with pytest.raises(oci.ImageError) as e:
            oci.resolve(ref, registry_access(Settings.from_env()))
        assert e.value.message == oci.UNIFORM.format(ref=ref.text)
    no_connection(listener)


async def test_create_from_a_loopback_registry_is_refused(tmp_path, listener,
                                                           monkeypatch) -> None:
    monkeypatch.delenv(egress.ALLOW_ENV, raising=False)
    monkeypatch.delenv(oci.INSECURE_ENV, raising=False)
    port = listener.getsockname()[1]
    async with in_process(tmp_path) as srv:
        async with httpx.AsyncClient(transport=srv.async_transport(), base_url=srv.url) as c:
            answers = []
            for ref in (f"127.0.0.1:{port}/x:1", f"localhost:{port}/team/x:latest",
                        f"127.0.0.1:{port + 1 if port < 65535 else 1}/x:1"):
                r = await c.post("/v1/sandboxes", json={"image": ref},
                                 headers={"authorization": f"Bearer {srv.key}"})
                answers.append((r.status_code, r.json()["error"]["type"],
                                r.json()["error"]["message"].replace(ref, "REF")))
                # E2B create has no image field: a reference as its template names nothing
                for body in ({"templateID": ref}, {"templateID": "base", "image": ref}):
                    e = await c.post("/e2b/sandboxes", json=body,
                                     headers={"x-api-key": srv.key})
                    assert e.status_code in (201, 404), e.text
            # the same answer for an open port and a closed one
            assert len(set(answers)) == 1, answers
            assert answers[0][:2] == (400, "ImageError")
            assert not srv.core.sandboxes.live or all(
                lv.record.template == "base" for lv in srv.core.sandboxes.live.values())
    no_connection(listener)


PROXY_CONNECT = """
import os, socket, sys, urllib.parse
proxy = urllib.parse.urlparse(os.environ["HTTPS_PROXY"])
s = socket.create_connection((proxy.hostname, proxy.port), timeout=10)
s.sendall(f"CONNECT {sys.argv[1]} HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n".encode())
print(s.recv(100).decode().split("\\r\\n")[0])
"""
DIRECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 5)"


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root")
def test_a_pull_runs_where_the_proxy_is_the_only_way_out(listener) -> None:
    """skopeo (Go) goes around a proxy for loopback hosts: in its own network namespace that
    reaches nothing, and through the proxy only what the policy allows gets through."""
    port = str(listener.getsockname()[1])
    direct = egress.run([sys.executable, "-c", DIRECT, port], egress.Policy())
    assert direct.returncode != 0 and b"ConnectionRefusedError" in direct.stderr
    refused = egress.run([sys.executable, "-c", PROXY_CONNECT, f"127.0.0.1:{port}"],
                         egress.Policy())
    assert refused.stdout.decode().strip() == "HTTP/1.1 403 Forbidden", refused
    no_connection(listener)
    named = egress.Policy(frozenset({f"127.0.0.1:{port}"}))
    allowed = egress.run([sys.executable, "-c", PROXY_CONNECT, f"127.0.0.1:{port}"], named)
    assert allowed.stdout.decode().startswith("HTTP/1.1 200"), allowed
    listener.setblocking(True)
    listener.settimeout(10)
    listener.accept()[0].close()  # the proxy connected, from the host's namespace


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("skopeo") is None,
                    reason="needs root (a network namespace) and skopeo")
def test_redirects_to_loopback_reach_nothing(listener) -> None:
    """A registry the policy allows redirects skopeo to the listener: by a literal loopback
    address and `localhost` (Go goes around the proxy: its namespace has nothing there) and
    by a name the proxy checks (refused). Nothing reaches the listener."""
    port = listener.getsockname()[1]
    targets = [f"http://127.0.0.1:{port}/x", f"http://localhost:{port}/x",
               f"http://127.2:{port}/x"]
    asked: list[str] = []

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            asked.append(self.path)
            if self.path == "/v2/":
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            self.send_response(307)
            self.send_header("Location", targets[int(self.path.split("/")[2][1:])])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    registry = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    try:
        host = f"127.1:{registry.server_address[1]}"  # a name to Go: it goes through the proxy
        policy = egress.Policy(frozenset({host}))
        for i in range(len(targets)):
            proc = egress.run(["skopeo", "--command-timeout", "60s", "inspect", "--raw",
                               "--tls-verify=false", f"docker://{host}/r{i}:1"], policy)
            assert proc.returncode != 0
            assert f"/v2/r{i}/manifests/1" in asked  # the registry was reached, and redirected
        no_connection(listener)
    finally:
        registry.shutdown()
        registry.server_close()
