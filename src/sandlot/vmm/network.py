"""Host-side networking: one network namespace per sandbox, isolated with nftables.

Layout (the one Firecracker documents for clones; E2B uses it too). Every guest has the same
address, so snapshots and forks need no network reconfiguration::

    host netns                 netns sl-<id>                          guest (QEMU)
    uplink ─ slv<slot>  ═════  eth0 pool+4*slot+2/30
             pool+4*slot+1/30  tap0 10.0.2.2/24, 10.0.2.3/32 ───────  eth0 10.0.2.15/24
                                                                      gw 10.0.2.2, DNS 10.0.2.3

Inside the namespace (``table ip sandlot``): 10.0.2.3:53 is DNATed to the first DNS server,
guest traffic leaving through eth0 is masqueraded to the namespace's veth address, nothing
new may enter tap0 or the namespace from outside, and the guest may reach nothing of the
namespace itself except ping. ``internet=False`` also removes the namespace's default route.

In the host namespace this module owns ``table inet sandlot`` (the manager's ``table``:
``sandlot`` by default, ``sandlot_<tag>`` for another deployment or test run on the host, whose
veths are then slt<tag>v<slot> instead of slv<slot>, so neither table's rules match the other's
sandboxes; slots, and with them addresses, are host-wide whatever the table):

    input        from slv*: replies and DNS to a configured server only; the rest is rejected,
                 so no host address (including 127.0.0.0/8) is reachable from a sandbox
    forward      nothing new into slv* (so sandboxes can't reach each other); packets from
                 slv<slot> jump through map ``egress`` to chain ``eg-<slot>``; unknown slv* drop
    postrouting  masquerade what comes from slv* and leaves through any other interface
    eg-<slot>, al-<slot>, dn-<slot>   per-sandbox egress chain, allow set and deny set;
                 rewritten atomically by one ``nft -f -`` batch

The sandbox id of a slot is the alias of its host veth, so :meth:`NetworkManager.cleanup_stale`
can find what a previous process left behind.

Exposed guest ports are relayed by `vmm.port_relay.PortForwarder`, which this module keeps
per sandbox (and parks through a pause).

Errors: a failing host command raises ``SandboxError`` carrying its stderr; a bad sandbox id,
policy or address raises ``InvalidArgumentError``; setting up a sandbox twice raises
``InvalidStateError``. A failed setup removes whatever it had created.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import re
import socket
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from sandlot import filelock
from sandlot.errors import InvalidArgumentError, InvalidStateError, SandboxError
from sandlot.vmm.netns import NETNS_DIR, run_in_netns
from sandlot.vmm.port_relay import PortForwarder

__all__ = [
    "DNS_ADDRESS", "GATEWAY_ADDRESS", "GUEST_ADDRESS", "GUEST_PREFIX", "NetworkManager",
    "NetworkPolicy", "PendingNetwork", "SandboxNetwork", "host_dns_servers",
]

log = logging.getLogger(__name__)

GUEST_ADDRESS = "10.0.2.15"
GATEWAY_ADDRESS = "10.0.2.2"
DNS_ADDRESS = "10.0.2.3"
GUEST_PREFIX = 24
TAP = "tap0"
HOST_LOCK = "/run/sandlot-net/slots.lock"
# The gateway's MAC is the one QEMU's user-mode network uses for 10.0.2.2, so a guest snapshotted
# on either backend keeps a valid ARP entry for its gateway after a restore.
GATEWAY_MAC = "52:55:0a:00:02:02"
NETNS_PREFIX = "sl-"
VETH_PREFIX = "slv"  # the default table's; another's is slt<tag>v
TABLE = "sandlot"  # the default table (Settings.net_table): `inet sandlot`

_SYS_NET = "/sys/class/net"
# What a network's name may be (the runtime names it after its VM, whose id core made: the
# format of an id is core's, core/ids.py): safe in a namespace's name and a veth's alias.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}")
_TABLE_RE = re.compile(r"sandlot(?:_([a-z0-9]{1,6}))?")  # tag: the veths fit IFNAMSIZ
_SLOT_RE = re.compile(r"(?:slv|slt[a-z0-9]{1,6}v)(\d+)")  # a sandbox veth of any table
_REJECT = "reject with icmpx type admin-prohibited"
_COMMAND_TIMEOUT = 30.0
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class NetworkPolicy:
    """What a sandbox may reach.

    ``allow_out`` and ``deny_out`` hold IPv4 addresses, CIDRs or host names; names are
    resolved to their IPv4 addresses when the policy is applied. A non-empty ``allow_out``
    allows only those destinations; where the two overlap ``allow_out`` wins (as E2B's rules
    do: ``deny_out=["0.0.0.0/0"]`` with a few ``allow_out`` entries opens just those). DNS through
    10.0.2.3 stays allowed unless ``internet`` is False. ``dns_servers`` (IPv4 addresses, E2B's
    DNS servers) are reachable, all traffic to them, whatever the two lists say, unless
    ``internet`` is False; the guest's nameserver stays 10.0.2.3. IPv6 entries are ignored:
    sandboxes have no IPv6 route at all.
    """

    internet: bool = True
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    dns_servers: tuple[str, ...] = ()


@dataclass(frozen=True)
class SandboxNetwork:
    """The network of one sandbox, as QEMU and the rest of vmm need to see it."""

    sandbox_id: str
    slot: int
    namespace: str
    host_veth: str
    host_address: str
    namespace_address: str
    tap: str = TAP

    def qemu_netdev(self) -> list[str]:
        """The ``-netdev`` arguments; pair them with ``-device virtio-net-pci,netdev=net0``."""
        return ["-netdev", f"tap,id=net0,ifname={self.tap},script=no,downscript=no,vnet_hdr=off"]

    def netns_exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the sandbox's namespace."""
        return ["ip", "netns", "exec", self.namespace]


@dataclass(frozen=True)
class _Egress:
    internet: bool
    allow: tuple[ipaddress.IPv4Network, ...]
    deny: tuple[ipaddress.IPv4Network, ...]
    servers: tuple[str, ...] = ()  # always reachable (NetworkPolicy.dns_servers)


@dataclass(frozen=True)
class PendingNetwork:
    """A sandbox network `NetworkManager.begin` made and `finish` has not configured yet."""

    net: SandboxNetwork
    egress: _Egress
    tap: bool  # its tap is made


def host_dns_servers(
    paths: Iterable[str] = ("/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"),
) -> list[str]:
    """IPv4 nameservers of the host that a namespace can reach (loopback ones can't be)."""
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        servers = []
        for line in lines:
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "nameserver":
                try:
                    addr = ipaddress.ip_address(fields[1])
                except ValueError:
                    continue
                if addr.version == 4 and not addr.is_loopback and not addr.is_unspecified:
                    servers.append(str(addr))
        if servers:
            return servers
    return []


_TUNSETIFF = 0x400454CA
_TUNSETPERSIST = 0x400454CB
_TUNSETOWNER = 0x400454CC
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_TUN_EXCL = 0x8000


def _create_tap(name: str, owner: int | None) -> None:
    """Make a persistent tap (as `ip tuntap add NAME mode tap user OWNER`, without starting
    ip) in the calling thread's network namespace."""
    import fcntl
    import struct

    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(),
                                                 _IFF_TAP | _IFF_NO_PI | _IFF_TUN_EXCL))
        if owner is not None:
            fcntl.ioctl(fd, _TUNSETOWNER, owner)
        fcntl.ioctl(fd, _TUNSETPERSIST, 1)
    except OSError as e:
        raise SandboxError(f"cannot create tap {name}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def open_tap(netns: str, name: str = TAP) -> int:
    """Open the sandbox's tap (no packet info, no vnet header) inside its namespace, for a
    QEMU that may not open /dev/net/tun itself (``-netdev tap,fd=N``)."""
    import fcntl
    import struct

    def opener() -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        try:
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(),
                                                     _IFF_TAP | _IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
        return fd

    try:
        return run_in_netns(netns, opener)
    except OSError as e:
        raise SandboxError(f"cannot open the tap of {netns}: {e.strerror or e}") from e


def _run(argv: list[str], script: str = "") -> str:
    return _run_all([(argv, script)])[0]


def _run_all(commands: list[tuple[list[str], str]]) -> list[str]:
    """Run the commands concurrently; raise the first failure once all have finished."""
    procs: list[tuple[list[str], str, subprocess.Popen[str]]] = []
    try:
        for argv, script in commands:
            procs.append((argv, script, subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)))
    except OSError as e:
        for _, _, proc in procs:
            proc.kill()
            proc.wait()
        raise SandboxError(f"{commands[len(procs)][0][0]} failed: {e}", cause=e) from e
    outputs, failure = [], None
    for argv, script, proc in procs:
        try:
            out, err = proc.communicate(script, timeout=_COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.wait()
            failure = failure or SandboxError(f"{' '.join(argv)} timed out", cause=e)
            outputs.append("")
            continue
        if proc.returncode != 0 and failure is None:
            detail = err.strip() or out.strip()
            failure = SandboxError(f"{' '.join(argv)} failed: {detail}\n{script}".rstrip())
        outputs.append(out)
    if failure is not None:
        raise failure
    return outputs


def _ip_batch(lines: list[str]) -> tuple[list[str], str]:
    return ["ip", "-batch", "-"], "\n".join(lines) + "\n"


def _nft_batch(lines: list[str]) -> tuple[list[str], str]:
    return ["nft", "-f", "-"], "\n".join(lines) + "\n"


def _write_sysctl(key: str, value: str, *, missing_ok: bool = False) -> None:
    try:
        with open(f"/proc/sys/{key}", "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not missing_ok:
            raise
    except OSError as e:
        raise SandboxError(f"sysctl {key}={value}: {e}", cause=e) from e


def _ipv4_list(values: Iterable[str], what: str) -> list[str]:
    out = []
    for value in values:
        try:
            out.append(str(ipaddress.IPv4Address(value)))
        except ValueError as e:
            raise InvalidArgumentError(f"{what}: {value!r} is not an IPv4 address") from e
    return out


def _networks(entries: Iterable[str]) -> tuple[ipaddress.IPv4Network, ...]:
    nets: list[ipaddress.IPv4Network] = []
    for entry in entries:
        entry = entry.strip()
        try:
            net = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            net = None
        if net is not None:
            if net.version == 4:
                nets.append(net)  # type: ignore[arg-type]
            continue
        try:
            infos = socket.getaddrinfo(entry, None, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise InvalidArgumentError(f"cannot resolve {entry!r}: {e}") from e
        nets.extend(ipaddress.IPv4Network(info[4][0]) for info in infos)
    return tuple(ipaddress.collapse_addresses(nets))


def _resolve(policy: NetworkPolicy) -> _Egress:
    if any(isinstance(v, str) for v in (policy.allow_out, policy.deny_out,
                                         policy.dns_servers)):
        raise InvalidArgumentError("allow_out, deny_out and dns_servers take a sequence of "
                                   "strings")
    return _Egress(policy.internet, _networks(policy.allow_out), _networks(policy.deny_out),
                   tuple(dict.fromkeys(_ipv4_list(policy.dns_servers, "dns_servers"))))


def _check_id(sandbox_id: str) -> None:
    if not _ID_RE.fullmatch(sandbox_id):
        raise InvalidArgumentError(f"bad sandbox id {sandbox_id!r}")


def _existing_slots(prefix: str | None = None) -> dict[int, str | None]:
    """Slot -> sandbox id (the veth alias) of every sandbox veth in the host namespace (of any
    table; with `prefix`, only those named `prefix`<slot>)."""
    slots: dict[int, str | None] = {}
    for name in os.listdir(_SYS_NET):
        m = _SLOT_RE.fullmatch(name)
        if not m or (prefix is not None and name != f"{prefix}{m.group(1)}"):
            continue
        try:
            with open(os.path.join(_SYS_NET, name, "ifalias")) as f:
                alias = f.read().strip() or None
        except OSError:
            alias = None
        slots[int(m.group(1))] = alias
    return slots


def _owned_id(rest: str) -> bool:
    """`rest` is a bare sandbox id: another owner's names carry '<owner>.' first."""
    return "." not in rest and bool(_ID_RE.fullmatch(rest))


def _existing_namespaces(prefix: str = NETNS_PREFIX) -> set[str]:
    """Sandbox ids of the namespaces named `prefix` + id (another owner's do not match)."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return set()
    return {n[len(prefix):] for n in names
            if n.startswith(prefix) and _owned_id(n[len(prefix):])}


class NetworkManager:
    """Creates, changes and removes sandbox networks. One per host process.

    Methods are synchronous (each runs a few short host commands: ~20 ms for setup, ~15 ms
    for teardown) and thread-safe, except :meth:`expose`, which must run in the event loop
    that will serve the forwarded connections. Call :meth:`cleanup_stale` once at startup.
    ``nft flush ruleset`` on the host (e.g. restarting nftables.service) removes the table and
    with it the isolation of running sandboxes; run :meth:`cleanup_stale` and
    :meth:`update_egress` again after a host firewall reload.
    """

    def __init__(self, dns_servers: list[str] | None = None,
                 pool: str = "10.200.0.0/16", owner: str = "", table: str = TABLE) -> None:
        # Several servers may share a host: each only sees and cleans up its own sandboxes.
        if owner and not re.fullmatch(r"[a-z0-9]{1,16}", owner):
            raise InvalidArgumentError(f"network owner {owner!r}: 1-16 of [a-z0-9]")
        named = _TABLE_RE.fullmatch(table)
        if not named:
            raise InvalidArgumentError(f"nft table {table!r}: sandlot or sandlot_<1-6 of [a-z0-9]>")
        self._table = f"inet {table}"
        self._veth = f"slt{named.group(1)}v" if named.group(1) else VETH_PREFIX
        self._alias_prefix = f"{owner}." if owner else ""
        self._ns_prefix = f"{NETNS_PREFIX}{self._alias_prefix}"
        servers = host_dns_servers() if dns_servers is None else dns_servers
        self._dns = _ipv4_list(servers, "dns_servers")
        if not self._dns:
            log.warning("no usable DNS server: guests will have no DNS")
        try:
            self._pool = ipaddress.IPv4Network(pool)
        except ValueError as e:
            raise InvalidArgumentError(f"bad pool {pool!r}: {e}") from e
        if self._pool.prefixlen > 30:
            raise InvalidArgumentError(f"pool {pool} is too small")
        self._nets: dict[str, SandboxNetwork] = {}
        self._reserved: set[int] = set()
        self._forwarders: dict[str, PortForwarder] = {}
        self._parked: dict[str, PortForwarder] = {}  # ports kept listening while paused
        # Sandboxes whose parked ports a connection waits on, in order (see `wanted`).
        self._wanted: asyncio.Queue[str] = asyncio.Queue()
        self._lock = threading.Lock()
        self._base_ready = False

    def remove_table(self) -> bool:
        """Delete this manager's host table (a test run's own, once its servers are gone)
        unless a veth of it is left, whose sandbox would lose its isolation; whether it is
        gone."""
        if _existing_slots(self._veth):
            return False
        try:
            _run(["nft", "delete", "table", *self._table.split()])
        except SandboxError as e:
            if "No such file or directory" not in str(e):
                raise
        return True

    def get(self, sandbox_id: str) -> SandboxNetwork | None:
        return self._nets.get(sandbox_id)

    def setup(self, sandbox_id: str, policy: NetworkPolicy = NetworkPolicy(), *,
              guest_netns: str | None = None, tap_owner: int | None = None) -> SandboxNetwork:
        """Create the sandbox's namespace, veth, tap and rules.

        ``guest_netns`` replaces the tap with a veth whose other end, ``eth0``, is moved into
        that existing namespace, which then plays the guest (tests; no QEMU needed).
        ``tap_owner``: the uid of a confined QEMU, which may then open the tap unprivileged.
        """
        pending = self.begin(sandbox_id, policy, tap=guest_netns is None, tap_owner=tap_owner)
        return self.finish(pending, guest_netns)

    def begin(self, sandbox_id: str, policy: NetworkPolicy = NetworkPolicy(), *,
              tap: bool = True, tap_owner: int | None = None) -> PendingNetwork:
        """The first part of `setup`, what a QEMU needs to start in the sandbox's namespace:
        the namespace, its veth pair (which takes the address slot) and (``tap``) its tap,
        not yet configured. Then `finish` (addresses, routes, rules: before the guest runs)
        or `abandon`. A failure removes what it had made."""
        _check_id(sandbox_id)
        egress = _resolve(policy)
        if sandbox_id in self._nets:
            raise InvalidStateError(f"network of {sandbox_id} is already set up")
        if sandbox_id in _existing_namespaces(self._ns_prefix):
            self._remove([(sandbox_id, None)])  # left over by a crashed process
        # Slots are host-wide (veth names, and the pool when servers share it): the host veth
        # that marks a slot taken is created under a lock every sandlot process takes.
        with self._lock, filelock.exclusive(HOST_LOCK):
            if sandbox_id in self._nets:
                raise InvalidStateError(f"network of {sandbox_id} is already set up")
            taken = set(_existing_slots()) | self._reserved
            taken |= {n.slot for n in self._nets.values()}
            slot = next((s for s in range(self._pool.num_addresses // 4) if s not in taken), None)
            if slot is None:
                raise SandboxError(f"address pool {self._pool} is exhausted")
            self._reserved.add(slot)
            net = self._describe(sandbox_id, slot)
            try:
                self._create_links(net)
            except BaseException:
                self._reserved.discard(slot)
                raise
        pending = PendingNetwork(net, egress, tap)
        if tap:
            try:
                run_in_netns(net.namespace, lambda: _create_tap(TAP, tap_owner))
            except BaseException:
                self.abandon(pending)
                raise
        return pending

    def finish(self, pending: PendingNetwork, guest_netns: str | None = None) -> SandboxNetwork:
        """Configure what `begin` made (its addresses, routes and rules) and register it; a
        failure removes all of it."""
        net, egress, sandbox_id = pending.net, pending.egress, pending.net.sandbox_id
        try:
            self._create(net, egress, guest_netns, tap_made=pending.tap)
        except BaseException:
            self.abandon(pending)
            raise
        with self._lock:
            self._reserved.discard(net.slot)
            self._nets[sandbox_id] = net
            parked = self._parked.pop(sandbox_id, None)
            if parked is not None:  # its exposed ports outlived a pause: they relay here again
                self._forwarders[sandbox_id] = parked
        if parked is not None:
            parked.unpark(net.namespace)
        return net

    def abandon(self, pending: PendingNetwork) -> None:
        """Remove what `begin` made, for a sandbox that will not `finish` it."""
        try:
            self._remove([(pending.net.sandbox_id, pending.net.slot)])
        except SandboxError as e:
            log.error("rolling back network of %s: %s", pending.net.sandbox_id, e)
        finally:
            with self._lock:
                self._reserved.discard(pending.net.slot)

    def park(self, sandbox_id: str) -> dict[int, tuple[str, int]]:
        """Keep the sandbox's exposed ports listening through its coming teardown (a pause):
        a connection to one of them waits until the sandbox is back (the next `setup` of it
        adopts them, and the connection is relayed as usual) or `refuse` ends it; its sandbox
        is then `wanted`. Returns the ports kept (guest port -> host address)."""
        with self._lock:
            forwarder = self._forwarders.pop(sandbox_id, None)
            if forwarder is None or not forwarder.ports():
                if forwarder is not None:
                    self._forwarders[sandbox_id] = forwarder
                return {}
            forwarder.park(lambda: self._wanted.put_nowait(sandbox_id))
            self._parked[sandbox_id] = forwarder
            return forwarder.ports()

    async def wanted(self) -> str:
        """The next sandbox whose parked ports got a connection (once per wait: connections
        that arrive while one waits join it)."""
        return await self._wanted.get()

    def refuse(self, sandbox_id: str) -> None:
        """End the connections waiting on the sandbox's parked ports (it is not coming back
        here now); its ports stay parked for the next."""
        with self._lock:
            forwarder = self._parked.get(sandbox_id)
        if forwarder is not None:
            forwarder.refuse()

    def unpark(self, sandbox_id: str) -> None:
        """Close the ports kept by `park` (the sandbox will not come back)."""
        with self._lock:
            forwarder = self._parked.pop(sandbox_id, None)
        if forwarder is not None:
            forwarder.close()

    def update_egress(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Replace the sandbox's egress rules atomically; existing connections are affected too."""
        net = self._require(sandbox_id)
        egress = _resolve(policy)
        if egress.internet:
            self._set_default_route(net, True)
        _run(*_nft_batch(self._egress_script(net.slot, egress)))
        if not egress.internet:
            self._set_default_route(net, False)

    async def expose(self, sandbox_id: str, guest_port: int) -> tuple[str, int]:
        """A 127.0.0.1 address and port on the host that reaches ``guest_port`` of the guest."""
        net = self._require(sandbox_id)
        with self._lock:
            forwarder = self._forwarders.get(sandbox_id)
            if forwarder is None:
                forwarder = PortForwarder(net.namespace, GUEST_ADDRESS)
                self._forwarders[sandbox_id] = forwarder
        return await forwarder.expose(guest_port)

    def teardown(self, sandbox_id: str) -> None:
        """Remove everything of the sandbox's network. Idempotent.

        Stop QEMU first: the namespace, and with it the veth pair and the tap, goes away when
        the last process in it exits. Until then the sandbox's traffic is dropped, since its
        egress chain is gone; calling teardown again then deletes the host veth explicitly.
        """
        _check_id(sandbox_id)
        with self._lock:
            net = self._nets.pop(sandbox_id, None)
            forwarder = self._forwarders.pop(sandbox_id, None)
        if forwarder is not None:
            forwarder.close()
        slots = [net.slot] if net else [s for s, a in self._links().items() if a == sandbox_id]
        self._remove([(sandbox_id, s) for s in slots] or [(sandbox_id, None)])

    def cleanup_stale(self, keep: set[str]) -> None:
        """Remove the networks of every sandbox not in ``keep``; adopt the kept ones.

        Also rewrites the table's base chains. Policies are not persisted: call
        :meth:`update_egress` for each kept sandbox (its egress chain is reused as is, or is
        missing and its traffic dropped if the host ruleset was flushed). Use the same pool
        as the process that set them up.
        """
        links = self._links()
        namespaces = _existing_namespaces(self._ns_prefix)
        chain_slots = self._chain_slots()
        with self._lock:
            for sandbox_id in [i for i in self._forwarders if i not in keep]:
                self._forwarders.pop(sandbox_id).close()
            for sandbox_id in [i for i in self._nets if i not in keep]:
                del self._nets[sandbox_id]
            for slot, alias in links.items():
                if alias in keep and alias in namespaces and alias not in self._nets:
                    self._nets[alias] = self._describe(alias, slot)
            live = {n.slot for n in self._nets.values()} | self._reserved
        doomed: list[tuple[str | None, int | None]] = []
        doomed += [(a, s) for s, a in links.items() if s not in live]
        doomed += [(None, s) for s in chain_slots - live - set(_existing_slots())]
        doomed += [(i, None) for i in namespaces - keep]
        self._remove(doomed)
        _run(*_nft_batch(self._base_script()))
        self._base_ready = True

    def _require(self, sandbox_id: str) -> SandboxNetwork:
        net = self._nets.get(sandbox_id)
        if net is None:
            raise InvalidStateError(f"network of {sandbox_id} is not set up")
        return net

    def _describe(self, sandbox_id: str, slot: int) -> SandboxNetwork:
        base = self._pool.network_address + 4 * slot
        return SandboxNetwork(
            sandbox_id=sandbox_id, slot=slot, namespace=self._ns_prefix + sandbox_id,
            host_veth=f"{self._veth}{slot}", host_address=str(base + 1),
            namespace_address=str(base + 2),
        )

    def _create_links(self, net: SandboxNetwork) -> None:
        veth = net.host_veth
        _run(*_ip_batch([
            f"netns add {net.namespace}",
            f"link add {veth} type veth peer name eth0 netns {net.namespace}",
            f"link set {veth} alias {self._alias_prefix}{net.sandbox_id}",
            f"addr add {net.host_address}/30 dev {veth}",
            f"link set {veth} up",
        ]))

    def _create(self, net: SandboxNetwork, egress: _Egress, guest_netns: str | None,
                tap_made: bool) -> None:
        _write_sysctl("net/ipv4/ip_forward", "1")
        veth = net.host_veth
        _write_sysctl(f"net/ipv6/conf/{veth}/disable_ipv6", "1", missing_ok=True)
        _write_sysctl(f"net/ipv4/conf/{veth}/route_localnet", "0")
        guest_link = []
        if guest_netns is not None:
            guest_link = [f"link add {TAP} type veth peer name eth0 netns {guest_netns}"]
        elif not tap_made:
            raise InvalidArgumentError("a sandbox network needs its tap or a guest namespace")
        ns_ip = [
            "link set lo up",
            *guest_link,
            f"link set {TAP} address {GATEWAY_MAC}",
            f"addr add {GATEWAY_ADDRESS}/{GUEST_PREFIX} dev {TAP}",
            f"addr add {DNS_ADDRESS}/32 dev {TAP}",
            f"link set {TAP} up",
            f"addr add {net.namespace_address}/30 dev eth0",
            "link set eth0 up",
        ]
        if egress.internet:
            ns_ip.append(f"route add default via {net.host_address}")
        ns_nft = self._namespace_script()

        def configure() -> None:
            _write_sysctl("net/ipv6/conf/all/disable_ipv6", "1", missing_ok=True)
            _write_sysctl("net/ipv6/conf/default/disable_ipv6", "1", missing_ok=True)
            _write_sysctl("net/ipv4/conf/all/route_localnet", "0")
            _write_sysctl("net/ipv4/ip_forward", "1")
            _run_all([_ip_batch(ns_ip), _nft_batch(ns_nft)])

        run_in_netns(net.namespace, configure)
        base = [] if self._base_ready else self._base_script()
        _run(*_nft_batch(base + self._egress_script(net.slot, egress)))
        self._base_ready = True

    def _namespace_script(self) -> list[str]:
        t = "ip sandlot"
        lines = [
            f"add table {t}",
            f"add chain {t} prerouting {{ type nat hook prerouting priority dstnat; }}",
            f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; }}",
            f"add chain {t} input {{ type filter hook input priority filter; policy accept; }}",
            f"add chain {t} forward {{ type filter hook forward priority filter; policy drop; }}",
        ]
        if self._dns:
            for proto in ("udp", "tcp"):
                lines.append(f'add rule {t} prerouting iifname "{TAP}" ip daddr {DNS_ADDRESS} '
                             f"{proto} dport 53 dnat to {self._dns[0]}")
        lines += [
            f'add rule {t} postrouting oifname "eth0" masquerade',
            f'add rule {t} input iifname "{TAP}" ct state established,related accept',
            f'add rule {t} input iifname "{TAP}" icmp type echo-request accept',
            f'add rule {t} input iifname "{TAP}" reject with icmp type admin-prohibited',
            f'add rule {t} input iifname "eth0" ct state established,related accept',
            f'add rule {t} input iifname "eth0" drop',
            f'add rule {t} forward iifname "{TAP}" oifname "eth0" accept',
            f'add rule {t} forward iifname "eth0" oifname "{TAP}" ct state established,related '
            "accept",
        ]
        return lines

    def _base_script(self) -> list[str]:
        t, v = self._table, f'"{self._veth}*"'
        lines = [
            f"add table {t}",
            f"add chain {t} input {{ type filter hook input priority filter - 10; }}",
            f"add chain {t} forward {{ type filter hook forward priority filter - 10; }}",
            f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; }}",
            f"add map {t} egress {{ type ifname : verdict; }}",
            f"add set {t} dns {{ type ipv4_addr; }}",
            f"flush chain {t} input",
            f"flush chain {t} forward",
            f"flush chain {t} postrouting",
        ]
        if self._dns:
            lines.append(f"add element {t} dns {{ {', '.join(self._dns)} }}")
        lines += [
            f"add rule {t} input iifname {v} ct state established,related accept",
            f"add rule {t} input iifname {v} ip daddr @dns meta l4proto {{ tcp, udp }} "
            "th dport 53 accept",
            f"add rule {t} input iifname {v} {_REJECT}",
            f"add rule {t} forward oifname {v} ct state established,related accept",
            f"add rule {t} forward oifname {v} drop",
            f"add rule {t} forward iifname vmap @egress",
            f"add rule {t} forward iifname {v} drop",
            f"add rule {t} postrouting iifname {v} oifname != {v} masquerade",
        ]
        return lines

    def _egress_script(self, slot: int, egress: _Egress) -> list[str]:
        t, chain, allow, deny = self._table, f"eg-{slot}", f"al-{slot}", f"dn-{slot}"
        lines = [f"add table {t}", f"add map {t} egress {{ type ifname : verdict; }}"]
        lines += self._slot_objects(slot)
        lines += [f"flush chain {t} {chain}", f"flush set {t} {allow}",
                  f"flush set {t} {deny}"]
        for name, nets in ((allow, egress.allow), (deny, egress.deny)):
            if nets:
                lines.append(f"add element {t} {name} {{ {', '.join(map(str, nets))} }}")
        rules = ["meta nfproto != ipv4 drop"]
        if not egress.internet:
            rules.append(_REJECT)
        else:
            if self._dns:
                rules.append(f"ip daddr {{ {', '.join(self._dns)} }} meta l4proto {{ tcp, udp }} "
                             "th dport 53 accept")
            if egress.servers:
                rules.append(f"ip daddr {{ {', '.join(egress.servers)} }} accept")
            rules += [f"ip daddr @{allow} accept", f"ip daddr @{deny} {_REJECT}"]
            rules.append(_REJECT if egress.allow else "accept")
        lines += [f"add rule {t} {chain} {rule}" for rule in rules]
        lines.append(f'add element {t} egress {{ "{self._veth}{slot}" : jump {chain} }}')
        return lines

    def _slot_objects(self, slot: int) -> list[str]:
        t = self._table
        return [
            f"add chain {t} eg-{slot}",
            f"add set {t} al-{slot} {{ type ipv4_addr; flags interval; }}",
            f"add set {t} dn-{slot} {{ type ipv4_addr; flags interval; }}",
        ]

    def _chain_slots(self) -> set[int]:
        try:
            out = _run(["nft", "-j", "list", "table", *self._table.split()])
        except SandboxError as e:
            if "No such file or directory" in str(e):
                return set()
            raise
        slots = set()
        for item in json.loads(out).get("nftables", []):
            m = re.fullmatch(r"eg-(\d+)", item.get("chain", {}).get("name", ""))
            if m:
                slots.add(int(m.group(1)))
        return slots

    @staticmethod
    def _set_default_route(net: SandboxNetwork, present: bool) -> None:
        if present:
            _run(["ip", "-n", net.namespace, "route", "replace", "default", "via",
                  net.host_address])
        elif _run(["ip", "-n", net.namespace, "route", "show", "default"]).strip():
            _run(["ip", "-n", net.namespace, "route", "del", "default"])

    def _links(self) -> dict[int, str | None]:
        """Slot -> sandbox id of this owner's host veths."""
        out: dict[int, str | None] = {}
        for slot, alias in _existing_slots(self._veth).items():
            if alias and alias.startswith(self._alias_prefix):
                sandbox_id = alias[len(self._alias_prefix):]
                if _owned_id(sandbox_id):
                    out[slot] = sandbox_id
        return out

    def _remove(self, targets: list[tuple[str | None, int | None]]) -> None:
        """Remove the namespaces (by id), veths and nft objects (by slot) given.

        A veth whose namespace is deleted here goes with it (a little later, or when the last
        process in the namespace exits); deleting it explicitly would cost ~30 ms.
        """
        namespaces = _existing_namespaces(self._ns_prefix)
        links = _existing_slots(self._veth)
        doomed_ns = {i for i, _ in targets if i is not None and i in namespaces}
        ip_lines = [f"netns del {self._ns_prefix}{i}" for i in sorted(doomed_ns)]
        link_lines = []
        nft_lines = []
        t = self._table
        for slot in sorted({s for _, s in targets if s is not None}):
            if slot in links and (links[slot] or "")[len(self._alias_prefix):] not in doomed_ns:
                link_lines.append(f"link del {self._veth}{slot}")
            element = f'{{ "{self._veth}{slot}" : jump eg-{slot} }}'
            nft_lines += self._slot_objects(slot) + [
                f"add element {t} egress {element}",
                f"delete element {t} egress {element}",
                f"flush chain {t} eg-{slot}",
                f"delete chain {t} eg-{slot}",
                f"delete set {t} al-{slot}",
                f"delete set {t} dn-{slot}",
            ]
        commands = []
        if ip_lines:
            commands.append(_ip_batch(ip_lines))
        for line in link_lines:
            # The veth may vanish on its own meanwhile (its namespace is going away): fine.
            with contextlib.suppress(SandboxError):
                _run(["ip", *line.split()])
        if nft_lines:
            commands.append(_nft_batch([
                f"add table {t}", f"add map {t} egress {{ type ifname : verdict; }}",
                *nft_lines]))
        _run_all(commands)
