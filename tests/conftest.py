"""Test fixtures: a real sandlot server (uvicorn subprocess) with its own data dir, sharing the
images built by `make setup`; SDK clients pointed at it; a sandbox factory that cleans up.

Markers say what a test needs (`pytest_collection_modifyitems`): `vm` for every test under
tests/vm and tests/e2b and every test that starts a sandlot server (`-m "not vm"` starts no VM:
a test not marked `vm` that starts a server, or leaves a QEMU in a run of no `vm` test, fails),
`s3` and `postgres` for those that use the session's S3 server or PostgreSQL.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import harness
from harness import IMAGES_DIR, Server, cleanup, make_server  # noqa: F401
from sandlot import testing

pytest_plugins = ["cputime"]  # host CPU time by test module, at the end of the run


@pytest.fixture(scope="session", autouse=True)
def _net_table() -> Iterator[None]:
    """The run's nft table (harness.NET_TABLE, its servers'), removed once they are gone (the
    first session fixture set up, so the last torn down)."""
    yield
    testing.remove_net_table(harness.NET_TABLE)


@pytest.fixture(scope="session")
def registry(tmp_path_factory) -> Iterator[testing.RegistryServer]:
    """A real OCI registry on loopback (plain HTTP) for the session; the session's servers
    name it in SANDLOT_INSECURE_REGISTRIES."""
    srv = testing.RegistryServer(tmp_path_factory.mktemp("registry"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def oci_images(registry) -> dict[str, str | None]:
    """The test images (tests/imagekit.py), built once and pushed to the session's registry:
    name -> reference (None: this host cannot build it)."""
    import imagekit

    if imagekit.debian_layout(build=False) is None:  # its packages come from the network
        pytest.fail("the Debian test image is not built: run `make setup`")
    refs: dict[str, str | None] = {}
    for name, make in (("debian", imagekit.debian_layout), ("busybox", imagekit.busybox_layout),
                       ("musl", imagekit.musl_layout)):
        layout = make()
        refs[name] = imagekit.push(layout, registry, f"sandlot-test/{name}") if layout else None
    return refs


@pytest.fixture(scope="session")
def server(tmp_path_factory, registry) -> Iterator[Server]:
    """One sandlot server for the session (it may pull from the session's registry)."""
    if not (IMAGES_DIR / "templates" / "base.json").exists():
        pytest.fail("the base template is not built: run `make setup`")
    srv = make_server(tmp_path_factory.mktemp("sandlot"), "main")
    srv.extra_env.update(registry.env)
    try:
        srv.start()
        _session["server"] = srv
        os.environ.update(_server_env(srv))  # for the rest of this test only: see below
        yield srv
    finally:
        _session.pop("server", None)
        cleanup(srv)


_session: dict[str, Server] = {}
_server_modules: set = set()  # the paths of the modules with a test that uses `server`


def pytest_configure(config) -> None:
    """SIGTERM (a CI job cancelled, `timeout`) ends the run as Ctrl-C does: fixtures tear down
    and the servers they started stop (sandlot.testing stops the rest at exit)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def _server_env(srv: Server) -> dict[str, str]:
    """What points the SDK's defaults (`Sandbox.create()`) at `srv`."""
    return {"SANDLOT_URL": srv.url, "SANDLOT_API_KEY": srv.key}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The session server's SANDLOT_URL/SANDLOT_API_KEY are set for the tests of the modules
    that use it (their fixtures' set-up and teardown included) and for no other: each test
    ends with the environment as it found it."""
    saved = {k: os.environ.get(k) for k in ("SANDLOT_URL", "SANDLOT_API_KEY")}
    srv = _session.get("server")
    if srv is not None and item.path in _server_modules:
        os.environ.update(_server_env(srv))
    if item.get_closest_marker("vm") is None:
        harness.unmarked[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        harness.unmarked.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def own_server(tmp_path_factory) -> Iterator[Server]:
    """A server of the test's own, for restart and crash tests. No warm pool: these tests
    account for every QEMU process (tests/vm/test_pool.py covers the pool across restarts)."""
    srv = make_server(tmp_path_factory.mktemp("own"), secrets.token_hex(2))
    srv.extra_env["SANDLOT_POOL_SIZE"] = "0"
    try:
        srv.start()
        yield srv
    finally:
        cleanup(srv)


@pytest.fixture
def server_factory(tmp_path_factory) -> Iterator:
    """Make servers of the test's own with extra environment: `make(SANDLOT_X="...")`."""
    made: list[Server] = []

    def make(**extra_env: str) -> Server:
        srv = make_server(tmp_path_factory.mktemp("own"), secrets.token_hex(2))
        srv.extra_env.update(extra_env)
        made.append(srv)
        srv.start()
        return srv

    try:
        yield make
    finally:
        for srv in made:
            cleanup(srv)


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[testing.S3Server]:
    """A real S3 server (SeaweedFS) on loopback for the session."""
    srv = testing.S3Server(tmp_path_factory.mktemp("s3"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[testing.PostgresServer]:
    """A real PostgreSQL on loopback for the session (each test makes its own database)."""
    srv = testing.PostgresServer()
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def sandbox_factory(server):
    """Create sandboxes (SDK `Sandbox.create` kwargs); all are killed after the test."""
    from sandlot import Sandbox

    made = []

    def make(**kw):
        sbx = Sandbox.create(**{"timeout": 600, **kw})
        made.append(sbx)
        return sbx

    yield make
    for sbx in made:
        try:
            sbx.kill()
        except Exception:  # noqa: BLE001 - cleanup best effort
            pass


VM_DIRS = ("vm", "e2b")  # tests/vm, tests/e2b: every test there may start a VM
VM_FIXTURES = {"server", "own_server", "server_factory", "sandbox_factory", "sbx"}
NEEDS = ("s3", "postgres")  # fixtures named as their markers


@pytest.fixture(autouse=True)
def _no_vm_unless_marked(request) -> Iterator[None]:
    """In a run of no `vm` test (`-m "not vm"`), a QEMU of this run alive after a test fails
    that test (a server start in a test not marked `vm` fails at once: harness.make_server)."""
    yield
    if not _vm_run and request.node.get_closest_marker("vm") is None:
        if left := harness.own_qemus():
            pytest.fail(f"QEMU {left} started by a test not marked `vm`: give it the marker")


_vm_run = True  # a `vm` test is among the tests to run (pytest_collection_finish)


def pytest_collection_finish(session) -> None:
    global _vm_run
    _vm_run = any(item.get_closest_marker("vm") for item in session.items)


def pytest_collection_modifyitems(config, items):
    """Marks what a test needs: `vm` (a real QEMU VM: by directory, or by a fixture that
    starts a sandlot server), `s3`, `postgres` (the session's servers of those)."""
    tests = Path(__file__).resolve().parent
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        path = Path(str(item.path)).resolve()
        in_vm_dir = any(path.is_relative_to(tests / d) for d in VM_DIRS)
        if in_vm_dir or fixtures & VM_FIXTURES:
            item.add_marker(pytest.mark.vm)
        if "server" in fixtures:
            _server_modules.add(item.path)
        for marker in fixtures.intersection(NEEDS):
            item.add_marker(getattr(pytest.mark, marker))
