"""Test fixtures: a real sandlot server (uvicorn subprocess) with its own data dir, sharing the
images built by `make setup`; SDK clients pointed at it; a sandbox factory that cleans up.

Tests under tests/ that use `server` or `sandbox_factory` drive real QEMU VMs and are marked `vm`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

IMAGES_DIR = Path(os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A sandlot server process; restartable (same data dir, same port)."""

    data_dir: Path
    port: int
    key: str
    instance: str
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)
    extra_env: dict = field(default_factory=dict)  # set before start(); kept across restarts

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> None:
        self.env = {**os.environ, "SANDLOT_API_KEY": self.key,
                    "SANDLOT_IMAGES_DIR": str(IMAGES_DIR),
                    "SANDLOT_INSTANCE": self.instance, "SANDLOT_DATA_DIR": str(self.data_dir),
                    **self.extra_env}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandlot.cli", "serve", "--port", str(self.port),
             "--data-dir", str(self.data_dir)],
            env=self.env, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not come up")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client_kwargs(self) -> dict:
        return {"api_url": self.url, "api_key": self.key}

    @property
    def run_root(self) -> Path:
        return Path(f"/run/sandlot-{self.instance}")

    @property
    def shm_root(self) -> Path:
        return Path(f"/dev/shm/sandlot-{self.instance}")


def qemu_pids(run_root: Path) -> list[int]:
    """QEMU processes whose sockets live under `run_root`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "qemu-system" in cmd and f"unix:{run_root}/" in cmd:
            pids.append(int(entry.name))
    return pids


def _make_server(tmp_root: Path, name: str) -> Server:
    instance = f"t{os.getpid()}{name}"
    data = tmp_root / f"data-{name}"
    data.mkdir(parents=True, exist_ok=True)
    return Server(data_dir=data, port=free_port(), key="sl_test_" + secrets.token_hex(8),
                  instance=instance, log_path=tmp_root / f"server-{name}.log")


def _cleanup(server: Server) -> None:
    server.stop()
    for pid in qemu_pids(server.run_root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(server.run_root, ignore_errors=True)
    shutil.rmtree(server.shm_root, ignore_errors=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[Server]:
    """One sandlot server for the session."""
    if not (IMAGES_DIR / "templates" / "base.json").exists():
        pytest.fail("the base template is not built: run `make setup`")
    srv = _make_server(tmp_path_factory.mktemp("sandlot"), "main")
    srv.start()
    os.environ["SANDLOT_URL"] = srv.url
    os.environ["SANDLOT_API_KEY"] = srv.key
    yield srv
    _cleanup(srv)


@pytest.fixture
def own_server(tmp_path_factory) -> Iterator[Server]:
    """A server of the test's own, for restart and crash tests."""
    srv = _make_server(tmp_path_factory.mktemp("own"), secrets.token_hex(2))
    srv.start()
    yield srv
    _cleanup(srv)


@pytest.fixture
def server_factory(tmp_path_factory) -> Iterator:
    """Make servers of the test's own with extra environment: `make(SANDLOT_X="...")`."""
    made: list[Server] = []

    def make(**extra_env: str) -> Server:
        srv = _make_server(tmp_path_factory.mktemp("own"), secrets.token_hex(2))
        srv.extra_env = dict(extra_env)
        made.append(srv)
        srv.start()
        return srv

    yield make
    for srv in made:
        _cleanup(srv)


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"server", "own_server", "server_factory", "sandbox_factory", "sbx"}:
            item.add_marker(pytest.mark.vm)
