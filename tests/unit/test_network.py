"""sandlot.vmm.network for real, with network namespaces playing the guest and the internet.

    host ── slti<sfx> N.1/24 ═ netns slt-inet-<sfx>:   (N: a /24 of 198.18.0.0/15 this run's own)
                                          N.2 banner :80, echo :7, dnsmasq :53
                                          N.3 banner :80
    host ── slt<sfx>v<slot> ═ sl-<owner>.<id> ── tap0 (veth) ═ slt-g-<id>:
                                        eth0 10.0.2.15/24, gw 10.0.2.2

Nothing here talks to anything outside this machine. Needs root, ip, nft and dnsmasq.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from sandlot.errors import InvalidArgumentError, InvalidStateError, SandboxError
from sandlot.testing import remove_net_table, unused_subnet
from sandlot.vmm import network
from sandlot.vmm.netns import run_in_netns
from sandlot.vmm.network import (
    DNS_ADDRESS,
    GATEWAY_ADDRESS,
    GUEST_ADDRESS,
    NetworkManager,
    NetworkPolicy,
    SandboxNetwork,
)

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nft", "dnsmasq")),
        reason="needs root, ip, nft and dnsmasq",
    ),
    pytest.mark.timeout(120),
]

SFX = secrets.token_hex(3)
INET_NS = f"slt-inet-{SFX}"
INET_VETH = f"slti{SFX}"
INET = unused_subnet()  # not another run's
OWNER = f"t{SFX}"  # the managers' here: their names are this run's (another's come and go)
# ... and their nft table, whose veths are VETH<slot> (`inet sandlot`, slv<slot>: deployments')
TABLE, VETH = f"sandlot_{SFX}", f"slt{SFX}v"
INET_HOST, INET_A, INET_B = (str(INET[i]) for i in (1, 2, 3))
POOL = "10.209.0.0/16"
TIMEOUT = 1.0


def sh(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{argv}: {proc.stderr}")
    return proc.stdout


def new_socket(netns: str | None, kind: int = socket.SOCK_STREAM) -> socket.socket:
    if netns is None:
        return socket.socket(socket.AF_INET, kind)
    return run_in_netns(netns, lambda: socket.socket(socket.AF_INET, kind))


class Server:
    """A threaded TCP server in a namespace: sends '<name> <peer ip>' and closes, or echoes."""

    def __init__(self, netns: str | None, addr: str, port: int, name: str = "",
                 echo: bool = False) -> None:
        self.sock = new_socket(netns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.name, self.echo = name, echo
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, peer = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True).start()

    def _handle(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        conn.settimeout(10)
        with conn:
            try:
                if not self.echo:
                    conn.sendall(f"{self.name} {peer[0]}\n".encode())
                    return
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(5)
        self.sock.close()


def fetch(netns: str | None, addr: str, port: int, timeout: float = TIMEOUT) -> str:
    """Connect from `netns` and read until EOF; raises OSError if unreachable."""
    with new_socket(netns) as s:
        s.settimeout(timeout)
        s.connect((addr, port))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data.decode()


def reachable(netns: str | None, addr: str, port: int, timeout: float = TIMEOUT) -> bool:
    try:
        return bool(fetch(netns, addr, port, timeout))
    except OSError:
        return False


def dns_query(netns: str, name: str, tcp: bool = False, timeout: float = 2.0) -> list[str]:
    """A-records for `name` asked of 10.0.2.3 from inside `netns`."""
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    msg = struct.pack(">HHHHHH", 0x5A5A, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with new_socket(netns, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.connect((DNS_ADDRESS, 53))
        if tcp:
            s.sendall(struct.pack(">H", len(msg)) + msg)
            buf = b""
            while len(buf) < 2 or len(buf) < 2 + struct.unpack(">H", buf[:2])[0]:
                chunk = s.recv(4096)
                if not chunk:
                    raise OSError("short DNS answer")
                buf += chunk
            reply = buf[2:]
        else:
            s.send(msg)
            reply = s.recv(4096)
    answers = struct.unpack(">H", reply[6:8])[0]
    pos, out = 12 + len(question) + 4, []
    for _ in range(answers):
        while reply[pos] and reply[pos] < 0xC0:
            pos += reply[pos] + 1
        pos += 2 if reply[pos] >= 0xC0 else 1
        rtype, _, _, length = struct.unpack(">HHIH", reply[pos:pos + 10])
        pos += 10
        if rtype == 1:
            out.append(socket.inet_ntoa(reply[pos:pos + length]))
        pos += length
    return out


def wait_until(cond: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def settled_state() -> tuple[set[str], set[str], set[str]]:
    """`host_state` once it stops changing (an earlier test's veth may still be going: the
    kernel removes a deleted namespace's links in the background)."""
    state = host_state()
    for _ in range(50):
        time.sleep(0.2)
        again = host_state()
        if again == state:
            return state
        state = again
    return state


def _left_of(nets) -> set[str]:
    """What is left on the host of these networks: namespaces, veths, nft objects."""
    namespaces, links, objects = host_state()
    return ({n.namespace for n in nets} & namespaces | {n.host_veth for n in nets} & links
            | {o for o in objects for n in nets if o.endswith((f"-{n.slot}", f'"{n.host_veth}"'))})


def _alias(link: str) -> str:
    try:
        with open(f"/sys/class/net/{link}/ifalias") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_state() -> tuple[set[str], set[str], set[str]]:
    """(sl-* namespaces, VETH* links, per-sandbox nft objects) of this run's owner on the host
    right now: another owner's (a server's, another run's) come and go meanwhile. The nft
    objects of a slot whose veth is another owner's are theirs."""
    namespaces = {n for n in os.listdir("/run/netns")} if os.path.isdir("/run/netns") else set()
    links = {n: _alias(n) for n in os.listdir("/sys/class/net") if n.startswith(VETH)}
    theirs = {n[len(VETH):] for n, alias in links.items() if not alias.startswith(f"{OWNER}.")}
    out = sh("nft", "-j", "list", "table", "inet", TABLE, check=False) or '{"nftables": []}'
    objects = set()
    for item in json.loads(out)["nftables"]:
        for kind in ("chain", "set"):
            name = item.get(kind, {}).get("name", "")
            if name[:3] in ("eg-", "al-", "dn-") and name[3:] not in theirs:
                objects.add(name)
        if item.get("map", {}).get("name") == "egress":
            for element in item["map"].get("elem", []):
                if str(element[0]).strip('"')[len(VETH):] not in theirs:
                    objects.add(f"element {element[0]}")
    return ({n for n in namespaces if n.startswith(f"sl-{OWNER}.")},
            {n for n in links if n[len(VETH):] not in theirs}, objects)


@dataclass
class Internet:
    servers: list[Server]
    dnsmasq: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def internet() -> Iterator[Internet]:
    sh("ip", "netns", "add", INET_NS)
    servers: list[Server] = []
    dnsmasq = None
    try:
        sh("ip", "link", "add", INET_VETH, "type", "veth", "peer", "name", "eth0", "netns", INET_NS)
        sh("ip", "addr", "add", f"{INET_HOST}/24", "dev", INET_VETH)
        sh("ip", "link", "set", INET_VETH, "up")
        for cmd in (["addr", "add", f"{INET_A}/24", "dev", "eth0"],
                    ["addr", "add", f"{INET_B}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"]):
            sh("ip", "-n", INET_NS, *cmd)
        servers = [Server(INET_NS, INET_A, 80, "A"), Server(INET_NS, INET_B, 80, "B"),
                   Server(INET_NS, INET_B, 7, echo=True)]
        dnsmasq = subprocess.Popen(
            ["ip", "netns", "exec", INET_NS, "dnsmasq", "--no-daemon", "--conf-file=/dev/null",
             "--no-resolv", "--no-hosts", "--bind-interfaces", f"--listen-address={INET_A}",
             f"--address=/example.test/{INET_B}", "--pid-file=", "--user=root"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: f"{INET_A}:53 " in sh("ip", "netns", "exec", INET_NS, "ss",
                                                           "-lnu", "-H"))
        yield Internet(servers, dnsmasq)
    finally:
        if dnsmasq is not None:
            dnsmasq.terminate()
            dnsmasq.wait(5)
        for server in servers:
            server.stop()
        sh("ip", "link", "del", INET_VETH, check=False)
        sh("ip", "netns", "del", INET_NS, check=False)


@pytest.fixture(scope="module")
def manager() -> Iterator[NetworkManager]:
    yield NetworkManager(dns_servers=[INET_A], pool=POOL, owner=OWNER, table=TABLE)
    remove_net_table(TABLE)


@dataclass
class Guest:
    net: SandboxNetwork
    netns: str

    @property
    def id(self) -> str:
        return self.net.sandbox_id


@pytest.fixture
def sandbox(manager: NetworkManager, internet: Internet) -> Iterator[Callable[..., Guest]]:
    """Factory: a sandbox network whose guest is a namespace configured like the real guest."""
    made: list[Guest] = []
    counter = iter(range(100))

    def make(policy: NetworkPolicy = NetworkPolicy()) -> Guest:
        sandbox_id = f"sb-t{SFX}x{next(counter)}"
        gns = f"slt-g-{sandbox_id}"
        sh("ip", "netns", "add", gns)
        try:
            net = manager.setup(sandbox_id, policy, guest_netns=gns)
        except BaseException:
            sh("ip", "netns", "del", gns)
            raise
        guest = Guest(net, gns)
        made.append(guest)
        for cmd in (["link", "set", "lo", "up"],
                    ["addr", "add", f"{GUEST_ADDRESS}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"],
                    ["route", "add", "default", "via", GATEWAY_ADDRESS]):
            sh("ip", "-n", gns, *cmd)
        return guest

    yield make
    for guest in made:
        manager.teardown(guest.id)
        sh("ip", "netns", "del", guest.netns, check=False)


def test_outbound_is_masqueraded_and_dns_works(sandbox: Callable[..., Guest]) -> None:
    guest = sandbox()
    assert fetch(guest.netns, INET_A, 80) == f"A {INET_HOST}\n"
    assert fetch(guest.netns, INET_B, 80) == f"B {INET_HOST}\n"
    assert dns_query(guest.netns, "example.test") == [INET_B]
    assert dns_query(guest.netns, "example.test", tcp=True) == [INET_B]


def test_two_tables_on_one_host_filter_only_their_own(sandbox: Callable[..., Guest]) -> None:
    """Another deployment or test run (its own table, veths and owner) on the host: each
    table's rules match only its own veths, so neither drops the other's traffic or lets it in."""
    other = NetworkManager(dns_servers=[INET_A], pool=POOL, owner=f"u{SFX}",
                           table=f"sandlot_u{SFX[:5]}")
    gns = f"slt-g-sb-u{SFX}"
    sh("ip", "netns", "add", gns)
    try:
        theirs = Guest(other.setup(f"sb-u{SFX}", NetworkPolicy(), guest_netns=gns), gns)
        for cmd in (["link", "set", "lo", "up"],
                    ["addr", "add", f"{GUEST_ADDRESS}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"],
                    ["route", "add", "default", "via", GATEWAY_ADDRESS]):
            sh("ip", "-n", gns, *cmd)
        mine = sandbox()
        for guest in (mine, theirs):
            assert fetch(guest.netns, INET_A, 80) == f"A {INET_HOST}\n"
            assert dns_query(guest.netns, "example.test") == [INET_B]
        other.update_egress(theirs.id, NetworkPolicy(internet=False))
        assert not reachable(theirs.netns, INET_A, 80)
        assert fetch(mine.netns, INET_A, 80) == f"A {INET_HOST}\n"
        listener = Server(mine.net.namespace, "0.0.0.0", 0, "mine")
        try:  # nor does either reach the other's sandboxes
            assert reachable(mine.net.namespace, mine.net.namespace_address, listener.port)
            other.update_egress(theirs.id, NetworkPolicy())
            assert not reachable(theirs.netns, mine.net.namespace_address, listener.port,
                                 timeout=0.5)
        finally:
            listener.stop()
    finally:
        other.teardown(f"sb-u{SFX}")
        sh("ip", "netns", "del", gns, check=False)
        remove_net_table(f"sandlot_u{SFX[:5]}")


def test_no_internet(sandbox: Callable[..., Guest], manager: NetworkManager) -> None:
    guest = sandbox(NetworkPolicy(internet=False))
    assert not reachable(guest.netns, INET_A, 80)
    with pytest.raises(OSError):
        dns_query(guest.netns, "example.test", timeout=TIMEOUT)
    manager.update_egress(guest.id, NetworkPolicy())
    assert reachable(guest.netns, INET_A, 80)
    assert dns_query(guest.netns, "example.test") == [INET_B]
    manager.update_egress(guest.id, NetworkPolicy(internet=False))
    assert not reachable(guest.netns, INET_A, 80)


def test_host_is_unreachable(sandbox: Callable[..., Guest]) -> None:
    guest = sandbox()
    anywhere, loopback = Server(None, "0.0.0.0", 0, "host"), Server(None, "127.0.0.1", 0, "lo")
    in_namespace = Server(guest.net.namespace, "0.0.0.0", 0, "namespace")
    try:
        assert reachable(None, INET_HOST, anywhere.port)  # the listeners are real
        assert reachable(None, "127.0.0.1", loopback.port)
        assert reachable(guest.net.namespace, guest.net.namespace_address, in_namespace.port)
        for addr in (GATEWAY_ADDRESS, DNS_ADDRESS, guest.net.namespace_address):
            assert not reachable(guest.netns, addr, in_namespace.port, timeout=0.5), addr
        host_addrs = {a["local"] for link in json.loads(sh("ip", "-j", "-4", "addr"))
                      for a in link["addr_info"]}
        targets = host_addrs | {"127.0.0.1", GATEWAY_ADDRESS, DNS_ADDRESS,
                                guest.net.host_address, guest.net.namespace_address}
        for addr in sorted(targets):
            for port in (anywhere.port, loopback.port):
                assert not reachable(guest.netns, addr, port, timeout=0.5), (addr, port)
        assert reachable(guest.netns, INET_A, 80)
    finally:
        anywhere.stop()
        loopback.stop()
        in_namespace.stop()


def test_sandboxes_are_isolated(sandbox: Callable[..., Guest]) -> None:
    a, b = sandbox(), sandbox()
    in_guest = Server(b.netns, "0.0.0.0", 0, "guest b")
    in_namespace = Server(b.net.namespace, "0.0.0.0", 0, "namespace b")
    try:
        assert reachable(b.netns, GUEST_ADDRESS, in_guest.port)
        assert reachable(b.net.namespace, b.net.namespace_address, in_namespace.port)
        for addr in (b.net.namespace_address, b.net.host_address):
            for port in (in_guest.port, in_namespace.port):
                assert not reachable(a.netns, addr, port, timeout=0.5), (addr, port)
        assert reachable(a.netns, INET_A, 80) and reachable(b.netns, INET_A, 80)
    finally:
        in_guest.stop()
        in_namespace.stop()


def test_egress_rules(sandbox: Callable[..., Guest], manager: NetworkManager,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    guest = sandbox(NetworkPolicy(allow_out=(f"{INET_B}/32",)))
    assert reachable(guest.netns, INET_B, 80)
    assert not reachable(guest.netns, INET_A, 80)
    assert dns_query(guest.netns, "example.test") == [INET_B]  # DNS server is INET_A

    manager.update_egress(guest.id, NetworkPolicy(deny_out=(INET_B,)))
    assert reachable(guest.netns, INET_A, 80)
    assert not reachable(guest.netns, INET_B, 80)

    # Where they overlap, allow_out wins (E2B's rule): all denied but one address.
    manager.update_egress(guest.id, NetworkPolicy(allow_out=(f"{INET_A}/32",),
                                                  deny_out=("0.0.0.0/0",)))
    assert reachable(guest.netns, INET_A, 80)
    assert not reachable(guest.netns, INET_B, 80)
    manager.update_egress(guest.id, NetworkPolicy(allow_out=(str(INET),),
                                                  deny_out=(f"{INET_A}/31",)))
    assert reachable(guest.netns, INET_A, 80)
    assert reachable(guest.netns, INET_B, 80)

    real = socket.getaddrinfo

    def fake(host: str, *args: object, **kwargs: object) -> list:
        if host == "allowed.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (INET_A, 0))]
        return real(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(network.socket, "getaddrinfo", fake)
    manager.update_egress(guest.id, NetworkPolicy(allow_out=("allowed.test",)))
    assert reachable(guest.netns, INET_A, 80)
    assert not reachable(guest.netns, INET_B, 80)


def test_dns_servers_are_reached_whatever_is_denied(sandbox: Callable[..., Guest],
                                                   manager: NetworkManager) -> None:
    guest = sandbox(NetworkPolicy(deny_out=("0.0.0.0/0",), dns_servers=(INET_B,)))
    assert reachable(guest.netns, INET_B, 80)
    assert not reachable(guest.netns, INET_A, 80)
    assert dns_query(guest.netns, "example.test") == [INET_B]  # 10.0.2.3 answers still
    manager.update_egress(guest.id, NetworkPolicy(allow_out=(f"{INET_B}/32",),
                                                  dns_servers=(INET_A,)))
    assert reachable(guest.netns, INET_A, 80) and reachable(guest.netns, INET_B, 80)
    manager.update_egress(guest.id, NetworkPolicy(deny_out=("0.0.0.0/0",), dns_servers=()))
    assert not reachable(guest.netns, INET_A, 80)
    assert not reachable(guest.netns, INET_B, 80)
    manager.update_egress(guest.id, NetworkPolicy(internet=False, dns_servers=(INET_A,)))
    assert not reachable(guest.netns, INET_A, 80)  # no internet: nothing at all
    with pytest.raises(InvalidArgumentError):
        manager.update_egress(guest.id, NetworkPolicy(dns_servers=("example.test",)))


def test_deny_cuts_open_connections(sandbox: Callable[..., Guest],
                                    manager: NetworkManager) -> None:
    guest = sandbox()
    with new_socket(guest.netns) as s:
        s.settimeout(TIMEOUT)
        s.connect((INET_B, 7))
        s.sendall(b"one")
        assert s.recv(10) == b"one"
        manager.update_egress(guest.id, NetworkPolicy(deny_out=(INET_B,)))
        s.sendall(b"two")
        with pytest.raises(OSError):
            s.recv(10)


def test_policy_errors(manager: NetworkManager, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> list:
        raise socket.gaierror(socket.EAI_NONAME, "no such name")

    monkeypatch.setattr(network.socket, "getaddrinfo", fail)
    before = settled_state()
    with pytest.raises(InvalidArgumentError):
        manager.setup("sb-bad", NetworkPolicy(allow_out=("nowhere.test",)))
    with pytest.raises(InvalidArgumentError):
        manager.setup("bad id!")
    with pytest.raises(InvalidArgumentError):
        NetworkManager(dns_servers=["not-an-ip"])
    for table in ("other", "sandlot_", "sandlot_toolong7", "sandlot_a-b"):  # veths must fit
        with pytest.raises(InvalidArgumentError, match="nft table"):
            NetworkManager(dns_servers=[INET_A], table=table)
    with pytest.raises(InvalidStateError):
        manager.update_egress("sb-unknown", NetworkPolicy())
    assert host_state() == before


async def test_expose(sandbox: Callable[..., Guest], manager: NetworkManager) -> None:
    guest = sandbox(NetworkPolicy(internet=False))
    server = Server(guest.netns, "0.0.0.0", 8000, echo=True)
    try:
        host, port = await manager.expose(guest.id, 8000)
        assert host == "127.0.0.1"
        assert await manager.expose(guest.id, 8000) == (host, port)
        payload = os.urandom(1 << 20)
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 10) == payload
            writer.close()

        # nothing listens on that guest port: the connection is closed, not left hanging
        host2, port2 = await manager.expose(guest.id, 8001)
        reader, writer = await asyncio.open_connection(host2, port2)
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()

        reader, writer = await asyncio.open_connection(host, port)
        manager.teardown(guest.id)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        await asyncio.sleep(0)
        with pytest.raises(OSError):
            await asyncio.open_connection(host, port)
    finally:
        server.stop()


async def test_a_kept_port_waits_for_its_sandbox_or_is_refused(
        sandbox: Callable[..., Guest], manager: NetworkManager) -> None:
    """A port kept through a teardown (a pause): a connection makes its sandbox `wanted`
    and waits; `refuse` ends it (the port stays kept); the next setup of the sandbox adopts
    the port and the waiting connection is relayed to it."""
    guest = sandbox(NetworkPolicy(internet=False))
    server = Server(guest.netns, "0.0.0.0", 8000, echo=True)
    try:
        host, port = await manager.expose(guest.id, 8000)
        assert manager.park(guest.id) == {8000: (host, port)}
        manager.teardown(guest.id)
        # the namespace's veth goes with it in the kernel's own time (slower on a loaded
        # host), its guest end too: gone before the next setup puts a new `eth0` there
        assert wait_until(lambda: not sh("ip", "-n", guest.netns, "-o", "link", "show",
                                         "eth0", check=False), timeout=60)

        waiting, writer = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(manager.wanted(), 10) == guest.id
        manager.refuse(guest.id)
        assert await asyncio.wait_for(waiting.read(), 10) == b""  # ended, not left waiting
        writer.close()

        reader, writer = await asyncio.open_connection(host, port)  # kept: still listening
        assert await asyncio.wait_for(manager.wanted(), 10) == guest.id
        manager.setup(guest.id, NetworkPolicy(internet=False), guest_netns=guest.netns)
        for cmd in (["addr", "add", f"{GUEST_ADDRESS}/24", "dev", "eth0"],
                    ["link", "set", "eth0", "up"]):
            sh("ip", "-n", guest.netns, *cmd)
        writer.write(b"back")
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 10) == b"back"
        writer.close()
    finally:
        server.stop()


def test_teardown_and_cleanup_stale(manager: NetworkManager) -> None:
    before = host_state()
    ids = [f"sb-s{SFX}x{i}" for i in range(3)]
    try:
        nets = [manager.setup(i) for i in ids]
        namespaces, links, objects = host_state()
        assert {n.namespace for n in nets} <= namespaces
        assert {n.host_veth for n in nets} <= links
        assert {f"eg-{n.slot}" for n in nets} <= objects

        manager.teardown(ids[0])
        manager.teardown(ids[0])
        assert nets[0].namespace not in host_state()[0]
        assert wait_until(lambda: nets[0].host_veth not in host_state()[1])
        assert not {o for o in host_state()[2] if o.endswith(f"-{nets[0].slot}")
                    or o.endswith(f'"{nets[0].host_veth}"')}

        # a new process: ids[1] is gone, ids[2] is still running and gets adopted
        restarted = NetworkManager(dns_servers=[INET_A], pool=POOL, owner=OWNER, table=TABLE)
        existing = {n[len(f"sl-{OWNER}."):] for n in host_state()[0]} | {
            _alias(link)[len(f"{OWNER}."):] for link in host_state()[1]}
        restarted.cleanup_stale(existing - {ids[1]})
        assert nets[1].namespace not in host_state()[0]
        assert restarted.get(ids[2]) == nets[2]
        restarted.update_egress(ids[2], NetworkPolicy(internet=False))
        restarted.teardown(ids[2])
        manager.teardown(ids[1])
        manager.teardown(ids[2])
        assert wait_until(lambda: not _left_of(nets)), (before, host_state())
    finally:
        for i in ids:
            manager.teardown(i)


def test_failed_setup_leaves_nothing(manager: NetworkManager) -> None:
    before = settled_state()
    with pytest.raises(SandboxError):
        manager.setup(f"sb-f{SFX}", guest_netns="slt-no-such-namespace")
    assert manager.get(f"sb-f{SFX}") is None
    assert wait_until(lambda: host_state() == before)


def test_setup_twice_is_refused(manager: NetworkManager) -> None:
    sandbox_id = f"sb-d{SFX}"
    try:
        manager.setup(sandbox_id)
        with pytest.raises(InvalidStateError):
            manager.setup(sandbox_id)
    finally:
        manager.teardown(sandbox_id)


def test_begin_then_finish_or_abandon(manager: NetworkManager) -> None:
    """A restore starts QEMU after `begin` (namespace, veth, a tap owned by QEMU's uid) and
    sets addresses and rules meanwhile (`finish`); `abandon` removes a begun network."""
    before = host_state()
    kept, dropped = f"sb-b{SFX}", f"sb-a{SFX}"
    try:
        pending = manager.begin(kept, tap_owner=12345)
        assert manager.get(kept) is None
        tap = json.loads(sh("ip", "-n", pending.net.namespace, "-j", "-d", "link", "show",
                            "tap0"))[0]
        assert tap["linkinfo"]["info_data"] == {  # as `ip tuntap add tap0 mode tap user N`
            "type": "tap", "pi": False, "vnet_hdr": False, "multi_queue": False,
            "persist": True, "user": 12345}
        assert "UP" not in tap["flags"]
        net = manager.finish(pending)
        assert manager.get(kept) == net == pending.net
        tap = json.loads(sh("ip", "-n", net.namespace, "-j", "addr", "show", "tap0"))[0]
        assert "UP" in tap["flags"] and tap["address"] == network.GATEWAY_MAC
        assert {a["local"] for a in tap["addr_info"]} == {GATEWAY_ADDRESS, DNS_ADDRESS}
        assert f"eg-{net.slot}" in host_state()[2]

        other = manager.begin(dropped)
        assert other.net.slot != net.slot
        manager.abandon(other)
        assert manager.get(dropped) is None
        assert other.net.namespace not in host_state()[0]
        assert other.net.slot not in manager._reserved
        manager.teardown(kept)
        # Only this test's slots: an earlier test's veth may still be going (the kernel
        # removes a deleted namespace's links in the background).
        mine = {f"{kind}-{s}" for kind in ("eg", "al", "dn") for s in (net.slot, other.net.slot)}

        def gone() -> bool:
            namespaces, links, objects = host_state()
            return (not {net.namespace, other.net.namespace} & namespaces
                    and not {f"{VETH}{net.slot}", f"{VETH}{other.net.slot}"} & links
                    and not mine & objects)

        assert wait_until(gone), (before, host_state())
    finally:
        manager.teardown(kept)
        manager.teardown(dropped)
