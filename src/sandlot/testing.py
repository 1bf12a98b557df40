"""A real sandlot server in a subprocess, for tests and benchmarks.

Each `ServerProcess` has its own data dir, port, API key and instance name (so its run
directory, tmpfs files and network namespaces are its own), and shares the images `make setup`
built. It can be stopped and started again (same data dir and port), e.g. to test recovery.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sandlot.vmm.processes import qemus_under

IMAGES_DIR = Path(os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`sandlot serve` in a subprocess. `start`, `stop` (a signal), `close` (stop + clean up)."""

    data_dir: Path
    instance: str
    log_path: Path
    port: int = field(default_factory=free_port)
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
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
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
        raise RuntimeError("the sandlot server did not come up")

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
        """Stop the server and remove everything it left: VMs, run dir, tmpfs files."""
        self.stop()
        for pid in qemus_under(self.run_root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.run_root, ignore_errors=True)
        shutil.rmtree(self.shm_root, ignore_errors=True)
        remove_networks(self.instance)


def remove_networks(instance: str) -> None:
    """Remove the network namespaces, veths and rules a server of `instance` left."""
    from sandlot.core.networking import network_owner
    from sandlot.vmm.network import NetworkManager

    if os.geteuid() != 0 or not shutil.which("nft"):
        return
    try:
        NetworkManager(dns_servers=["127.0.0.1"], owner=network_owner(instance)).cleanup_stale(
            set())
    except Exception:  # noqa: BLE001 - best effort: the next server of that name cleans too
        pass
