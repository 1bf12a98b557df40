"""The benchmark's own sandlot server: `sandlot.testing.ServerProcess` in a work dir of its own,
sharing the images `make setup` built."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sandlot.testing import IMAGES_DIR, ServerProcess
from sandlot.vmm.processes import qemus_under as qemu_pids

__all__ = ["IMAGES_DIR", "BenchServer", "qemu_pids"]


@dataclass
class BenchServer(ServerProcess):
    @classmethod
    def make(cls, root: Path) -> BenchServer:
        return cls.in_dir(root, f"b{os.getpid()}", key="sl_bench_" + secrets.token_hex(8))

    @property
    def root(self) -> Path:
        return self.log_path.parent
