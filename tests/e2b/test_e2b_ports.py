"""Port URLs with the unmodified `e2b` SDK and real VMs: an HTTP server started in a sandbox
(`python3 -m http.server`) is reached at `sbx.get_host(port)` by a plain HTTP client whose
names resolve through a real DNS server the test starts (dnsmasq, a wildcard for the
server's domain on loopback); with and without a traffic access token, and waking a paused
auto-resume sandbox."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator

import httpcore
import pytest
from e2b import Sandbox, SandboxState

DOMAIN = "sandlot.test"
WEB = 8080  # the port the sandbox's web server listens on

pytestmark = pytest.mark.vm


def resolve(name: str, server: tuple[str, int]) -> str:
    """The first A record of `name`, asked of the DNS server at `server` (one UDP query)."""
    qid = int.from_bytes(os.urandom(2), "big")
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        s.sendto(query, server)
        data = s.recv(4096)
    rid, flags, _, count = struct.unpack(">HHHH", data[:8])
    assert rid == qid and flags & 0xF == 0, f"DNS answer for {name}: rcode {flags & 0xF}"
    pos = 12 + len(question) + 4
    for _ in range(count):
        pos += 2 if data[pos] & 0xC0 == 0xC0 else data.index(b"\0", pos) + 1 - pos
        rtype, _, _, length = struct.unpack(">HHIH", data[pos:pos + 10])
        pos += 10
        if rtype == 1 and length == 4:
            return socket.inet_ntoa(data[pos:pos + 4])
        pos += length
    raise LookupError(f"no A record for {name}")


class Resolving(httpcore.SyncBackend):
    """httpcore's network backend, its names resolved by the test's DNS server."""

    def __init__(self, dns: tuple[str, int]) -> None:
        self.dns = dns

    def connect_tcp(self, host: str, port: int, *args, **kw):
        return super().connect_tcp(resolve(host, self.dns), port, *args, **kw)


@pytest.fixture(scope="module")
def dns(tmp_path_factory) -> Iterator[tuple[str, int]]:
    """dnsmasq on a loopback port: every name under DOMAIN is 127.0.0.1."""
    binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
    if not os.path.exists(binary):
        pytest.fail("no dnsmasq: `make setup` installs dnsmasq-base")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("dns") / "dnsmasq.log"
    proc = subprocess.Popen([binary, "--keep-in-foreground", "--conf-file=/dev/null",
                             "--no-resolv", "--no-hosts", "--bind-interfaces",
                             "--listen-address=127.0.0.1", f"--port={port}", "--pid-file=",
                             f"--address=/{DOMAIN}/127.0.0.1", f"--log-facility={log}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            assert resolve(f"up.{DOMAIN}", ("127.0.0.1", port)) == "127.0.0.1"
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    yield "127.0.0.1", port
    proc.terminate()
    proc.wait(10)


def serve_web(sbx: Sandbox, text: str) -> None:
    sbx.files.write("www/index.html", text)
    sbx.commands.run(f"cd ~/www && exec python3 -m http.server {WEB}", background=True)


def get(http: httpcore.ConnectionPool, url: str, token: str | None = None
        ) -> httpcore.Response:
    headers = {"e2b-traffic-access-token": token} if token else {}
    return http.request("GET", url, headers=headers)


def until_served(http, url: str, token: str | None = None) -> httpcore.Response:
    """The answer once the sandbox's server listens (502 before)."""
    deadline = time.monotonic() + 120
    while True:
        r = get(http, url, token)
        if r.status != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def test_get_host_reaches_the_sandbox(server_factory, dns):
    srv = server_factory(SANDLOT_E2B_DOMAIN=DOMAIN, SANDLOT_POOL_SIZE="0")
    opts = {"api_url": f"{srv.url}/e2b", "sandbox_url": f"{srv.url}/e2b/envd",
            "api_key": srv.key}
    http = httpcore.ConnectionPool(network_backend=Resolving(dns))
    public = Sandbox.create("base", timeout=600, **opts,
                            lifecycle={"on_timeout": "pause", "auto_resume": True})
    made = [public]
    try:
        private = Sandbox.create("base", timeout=600, network={"allow_public_traffic": False},
                                 **opts)
        made.append(private)
        assert public.traffic_access_token is None and private.traffic_access_token
        host = public.get_host(WEB)
        assert host == f"{WEB}-{public.sandbox_id}.{DOMAIN}"
        serve_web(public, "public page\n")
        serve_web(private, "private page\n")

        url = f"http://{host}:{srv.port}/index.html"
        r = until_served(http, url)
        assert r.status == 200 and r.content == b"public page\n"

        url = f"http://{private.get_host(WEB)}:{srv.port}/index.html"
        token = private.traffic_access_token
        r = until_served(http, url, token)
        assert r.status == 200 and r.content == b"private page\n"
        r = get(http, url)
        assert r.status == 403 and b"e2b-traffic-access-token" in r.content
        assert get(http, url, "not-the-token").status == 403

        # traffic wakes the paused auto-resume sandbox, its server where it was
        assert public.pause() is True
        assert public.get_info().state == SandboxState.PAUSED
        r = get(http, f"http://{host}:{srv.port}/index.html")
        assert r.status == 200 and r.content == b"public page\n"
        assert public.get_info().state == SandboxState.RUNNING
    finally:
        http.close()
        for s in made:
            s.kill()
