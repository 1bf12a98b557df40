"""Where image pulls may go: the registries the operator names, and by default any registry
whose every address is public, never loopback, link-local, private, shared (CGNAT) or
multicast ranges, in IPv4 or IPv6 (mapped, 6to4, NAT64 and Teredo addresses are judged by the
IPv4 address they carry).

`SANDLOT_REGISTRIES` (``host[:port],...``, in the server's environment) names the registries a
server may pull from at any address; a name without a port allows every port of that host.
The word ``public`` in the list keeps the default for every other registry; without it only
the named ones are reached. Unset, the list is ``public``. Registries named in
`SANDLOT_INSECURE_REGISTRIES` are named too (the operator chose to reach them).

A registry is checked after DNS resolution, and skopeo reaches registries only through
`Proxy`: a proxy on loopback, in this process, that checks every connection skopeo opens (the
registry, the hosts its redirects point at) the same way and connects to the very address it
checked, so a name that resolves differently the second time gains nothing. For a registry
the operator did not name, skopeo runs in a network namespace of its own (`run`, as root),
where the proxy is the only way out: Go never proxies loopback hosts (``127.0.0.1``,
``localhost``), and a redirect to one reaches nothing there.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import logging
import os
import select
import socket
import struct
import subprocess
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

ALLOW_ENV = "SANDLOT_REGISTRIES"
PUBLIC = "public"
DOCKER_HUB = "registry-1.docker.io"  # what skopeo reaches for a reference without a host
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CGNAT = ipaddress.ip_network("100.64.0.0/10")


class Refused(Exception):
    """A destination the policy does not allow (the caller words the error)."""


def public_address(address: str) -> bool:
    """Whether `address` is one a pull may reach without being named."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return public_address(str(embedded))
    return (ip.is_global and not ip.is_multicast and not ip.is_private
            and not ip.is_loopback and not ip.is_link_local and not ip.is_unspecified
            and not ip.is_reserved and ip not in _CGNAT)


def split_host(hostport: str, default_port: int = 443) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    host, port = hostport, default_port
    if hostport.startswith("["):
        end = hostport.find("]")
        host, rest = hostport[1:end], hostport[end + 1:]
        if rest.startswith(":") and rest[1:].isdigit():
            port = int(rest[1:])
    elif hostport.count(":") == 1:
        host, _, p = hostport.partition(":")
        if not p.isdigit():
            raise Refused(f"bad port in {hostport!r}")
        port = int(p)
    if not host or not 0 < port < 65536:
        raise Refused(f"bad destination {hostport!r}")
    return host.lower().rstrip("."), port


@dataclass(frozen=True)
class Policy:
    """Which registries pulls may reach (see the module's docstring)."""

    named: frozenset[str] = frozenset()  # host or host:port, lowercase
    public: bool = True

    @classmethod
    def parse(cls, raw: str | None, also_named: frozenset[str] | set[str] = frozenset()
              ) -> Policy:
        """The policy SANDLOT_REGISTRIES (`raw`; None: not set) gives, naming `also_named`
        too."""
        entries = {e.strip().lower() for e in (raw if raw is not None else PUBLIC).split(",")}
        entries.discard("")
        public = PUBLIC in entries or raw is None or not raw.strip()
        entries.discard(PUBLIC)
        return cls(frozenset(entries | {n.lower() for n in also_named}), public)

    def names(self, host: str, port: int) -> bool:
        """Whether the operator named this registry (any address is then allowed)."""
        shown = f"[{host}]" if ":" in host else host
        if host == DOCKER_HUB and "docker.io" in self.named:
            return True
        return host in self.named or shown in self.named or f"{shown}:{port}" in self.named

    def addresses(self, host: str, port: int) -> list[str]:
        """The addresses of `host` a connection may go to (all of them, or Refused)."""
        named = self.names(host, port)
        if not named and not self.public:
            raise Refused(f"{host}:{port} is not named in {ALLOW_ENV}")
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise Refused(f"{host}: {e}") from None
        found = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not found:
            raise Refused(f"{host} has no address")
        if named:
            return found
        private = [a for a in found if not public_address(a)]
        if private:
            raise Refused(f"{host}:{port} resolves to {', '.join(private)}, which is not "
                          f"public; name it in {ALLOW_ENV} to allow it")
        return found

    def check(self, hostport: str | None, default_port: int = 443) -> list[str]:
        """The addresses a registry (``host[:port]``; None: Docker Hub) may be reached at."""
        host, port = split_host(hostport or DOCKER_HUB, default_port)
        return self.addresses(host, port)


def connect(policy: Policy, host: str, port: int, timeout: float = 30) -> socket.socket:
    """A connection to `host`:`port` at one of the addresses the policy checked."""
    last: OSError | None = None
    for address in policy.addresses(host, port):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect((address, port))
            sock.settimeout(None)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise Refused(f"{host}:{port}: {last}")


@dataclass
class Proxy:
    """An HTTP proxy on loopback for one skopeo run: CONNECT (TLS registries) and absolute-URI
    requests (plain-HTTP ones), each destination checked by `policy` and reached at the
    address checked. Every refusal is logged; skopeo sees a 403 and fails. `sock`: a
    listening socket made elsewhere (in another network namespace, `run`); its connections
    out are made from the namespace of the thread that enters the proxy."""

    policy: Policy
    refused: list[str] = field(default_factory=list)
    _sock: socket.socket | None = None
    _closed: bool = False

    def __enter__(self) -> Proxy:
        if self._sock is None:
            self._sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True, name="egress-proxy").start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()

    @property
    def url(self) -> str:
        assert self._sock is not None
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def env(self) -> dict[str, str]:
        """skopeo's environment: every proxy variable set to this one, none bypassed."""
        env = {k: v for k, v in os.environ.items()
               if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
        env.update(HTTP_PROXY=self.url, HTTPS_PROXY=self.url, http_proxy=self.url,
                   https_proxy=self.url)
        return env

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        upstream = None
        try:
            client.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk or len(head) > 65536:
                    return
                head += chunk
            header, _, rest = head.partition(b"\r\n\r\n")
            lines = header.decode("latin-1").split("\r\n")
            method, target, version = (lines[0].split(" ") + ["", ""])[:3]
            if method == "CONNECT":
                host, port = split_host(target)
                upstream = connect(self.policy, host, port)
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
            else:
                if not target.startswith("http://"):
                    raise Refused(f"not a proxy request: {lines[0][:80]!r}")
                hostport, _, path = target[len("http://"):].partition("/")
                host, port = split_host(hostport, 80)
                upstream = connect(self.policy, host, port)
                kept = [h for h in lines[1:] if not h.lower().startswith(
                    ("proxy-connection:", "connection:", "proxy-authorization:"))]
                request = "\r\n".join([f"{method} /{path} {version}", *kept,
                                       "Connection: close", "", ""])
                upstream.sendall(request.encode("latin-1") + rest)
            client.settimeout(None)
            _relay(client, upstream)
        except (Refused, OSError, ValueError) as e:
            self.refused.append(str(e))
            log.info("image pull: connection refused by the registry policy: %s", e)
            with contextlib.suppress(OSError):
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n"
                               b"Connection: close\r\n\r\n")
        finally:
            client.close()
            if upstream is not None:
                upstream.close()


CLONE_NEWNET = 0x40000000
_isolation_failed = False


def _new_netns() -> None:
    """Move the calling thread (only) into a new network namespace, its loopback up."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, ifr))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))  # SIOCSIFFLAGS, UP


def run(cmd: list[str], policy: Policy, *, isolate: bool = True,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """`cmd` (skopeo) with every proxy variable set to a `Proxy` of `policy`. `isolate` (as
    root): in a network namespace of its own, where the proxy is all there is, so nothing
    reaches the network around it; Go programs go around a proxy for loopback hosts, which
    there reach nothing. Elsewhere (or if the namespace cannot be made): in this one."""
    global _isolation_failed
    made: dict = {}
    ready, go = threading.Event(), threading.Event()

    def confined() -> None:  # a thread of its own: a namespace is per thread
        try:
            if isolate and not _isolation_failed:
                try:
                    _new_netns()
                except OSError as e:
                    log.warning("image pulls run without a network namespace of their own: "
                                "%s", e)
                    made["unconfined"] = e
            made["sock"] = socket.create_server(("127.0.0.1", 0))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            made["error"] = e
        ready.set()
        if "error" in made:
            return
        go.wait()
        try:
            made["proc"] = subprocess.run(cmd, capture_output=True, env=made["env"],
                                          timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            made["error"] = e
        finally:
            made["sock"].close()

    thread = threading.Thread(target=confined, name="egress-run", daemon=True)
    thread.start()
    ready.wait()
    if "unconfined" in made:
        _isolation_failed = True
    if "error" in made:
        thread.join()
        raise made["error"]
    # The proxy's threads start here, in this thread's namespace: they reach the network.
    with Proxy(policy, _sock=made["sock"]) as proxy:
        made["env"] = proxy.env()
        go.set()
        thread.join()
    if "error" in made:
        raise made["error"]
    return made["proc"]


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    peers = {a: b, b: a}
    while True:
        readable, _, _ = select.select(list(peers), [], [], 600)
        if not readable:
            return
        for s in readable:
            data = s.recv(65536)
            if not data:
                return
            peers[s].sendall(data)


__all__ = ["ALLOW_ENV", "Policy", "Proxy", "Refused", "public_address", "run"]
