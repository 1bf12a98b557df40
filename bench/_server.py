"""The benchmark's own sandlot server: `sandlot.testing.ServerProcess` in a work dir of its own,
sharing the images `make setup` built."""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from sandlot.testing import IMAGES_DIR, S3Server, ServerProcess, base_only_images
from sandlot.vmm.processes import qemus_under as qemu_pids

__all__ = ["IMAGES_DIR", "BenchServer", "qemu_pids"]


@dataclass
class BenchServer(ServerProcess):
    @classmethod
    def make(cls, root: Path) -> BenchServer:
        return cls.in_dir(root, f"b{os.getpid()}", key="sl_bench_" + secrets.token_hex(8))

    @classmethod
    def on_store(cls, root: Path, name: str, s3: S3Server, instance: str | None = None,
                 **env: str) -> BenchServer:
        """A server in `root/name` whose store is `s3`, started once its templates are stored
        (a new store gets them at start, which a restore beside it would measure). Its images
        dir holds the base template alone (`base_only_images`): the shared one's other
        templates, seconds of hashing and uploading each, are used by no store step."""
        images = base_only_images(root / name / "images")
        server = cls.in_dir(root / name, instance or f"b{os.getpid()}{name}",
                            extra_env={"SANDLOT_STORE": s3.url("bench"), **s3.env,
                                       "SANDLOT_IMAGES_DIR": str(images), **env})
        server.start(timeout=120)
        deadline = time.monotonic() + 600
        while not httpx.get(f"{server.url}/health", timeout=10).json().get("templates_stored"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the templates were not stored within 600 s")
            time.sleep(0.5)
        return server

    @property
    def root(self) -> Path:
        return self.log_path.parent

