"""A private sandlot server for the benchmark: its own data dir, instance tag and port, sharing
the images `make setup` built. Same approach as the test fixtures (tests/conftest.py)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

IMAGES_DIR = Path(os.environ.get("SANDLOT_IMAGES_DIR", "/var/lib/sandlot/images"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class BenchServer:
    """A `sandlot serve` subprocess; `close` stops it and removes everything it left."""

    root: Path
    instance: str
    port: int
    key: str
    proc: subprocess.Popen | None = None

    @classmethod
    def make(cls, root: Path) -> BenchServer:
        instance = f"b{os.getpid()}"
        root.mkdir(parents=True, exist_ok=True)
        return cls(root=root, instance=instance, port=free_port(),
                   key="sl_bench_" + secrets.token_hex(8))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    @property
    def run_root(self) -> Path:
        return Path(f"/run/sandlot-{self.instance}")

    @property
    def shm_root(self) -> Path:
        return Path(f"/dev/shm/sandlot-{self.instance}")

    def env(self) -> dict[str, str]:
        return {**os.environ, "SANDLOT_API_KEY": self.key, "SANDLOT_IMAGES_DIR": str(IMAGES_DIR),
                "SANDLOT_INSTANCE": self.instance, "SANDLOT_DATA_DIR": str(self.data_dir)}

    def start(self, timeout: float = 60) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandlot.cli", "serve", "--port", str(self.port),
                 "--data-dir", str(self.data_dir)],
                env=self.env(), stdout=log, stderr=log, start_new_session=True)
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

    def client_kwargs(self) -> dict[str, str]:
        return {"api_url": self.url, "api_key": self.key}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        for pid in qemu_pids(self.run_root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.run_root, ignore_errors=True)
        shutil.rmtree(self.shm_root, ignore_errors=True)


def qemu_pids(run_root: Path) -> list[int]:
    """QEMU processes whose sockets live under `run_root` (the ones this server started)."""
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
