"""Where sandlot keeps things, and the knobs the server runs with.

Environment: SANDLOT_DATA_DIR (metadata, disks, snapshot store; default /var/lib/sandlot),
SANDLOT_IMAGES_DIR (templates; default <data>/images), SANDLOT_STORE_DIR (snapshot blobs;
default <data>/store), SANDLOT_INSTANCE (suffix for /run/sandlot and /dev/shm/sandlot, so
several servers can share a host), SANDLOT_ACCEL (kvm|tcg), SANDLOT_POOL_SIZE and
SANDLOT_POOL_TEMPLATES (the warm pool, core/pool.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sandlot.vmm.accel import detect_accel

DEFAULT_DATA_DIR = Path("/var/lib/sandlot")


def default_data_dir() -> Path:
    return Path(os.environ.get("SANDLOT_DATA_DIR") or DEFAULT_DATA_DIR)


def _int_env(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, default)))
    except ValueError:
        return default


@dataclass(frozen=True)
class Settings:
    """Paths and defaults. `images_dir` may be shared by several data dirs (tests do this)."""

    data_dir: Path = field(default_factory=default_data_dir)
    images_dir: Path | None = None
    store_path: Path | None = None  # snapshot blob store; default <data_dir>/store
    run_root: Path = Path("/run/sandlot")
    shm_root: Path = Path("/dev/shm/sandlot")
    accel: str = field(default_factory=detect_accel)
    default_timeout: int = 300
    max_timeout: int = 24 * 3600
    reap_interval: float = 1.0
    pool_size: int = 2  # warm pool: sandboxes kept restored per template (core/pool.py); 0: off
    pool_templates: tuple[str, ...] = ("base",)

    @classmethod
    def from_env(cls, data_dir: Path | str | None = None) -> Settings:
        data = Path(data_dir) if data_dir else default_data_dir()
        images = os.environ.get("SANDLOT_IMAGES_DIR")
        tag = os.environ.get("SANDLOT_INSTANCE", "")
        run_root = Path("/run/sandlot" + (f"-{tag}" if tag else ""))
        shm_root = Path("/dev/shm/sandlot" + (f"-{tag}" if tag else ""))
        store = os.environ.get("SANDLOT_STORE_DIR")
        pool = os.environ.get("SANDLOT_POOL_TEMPLATES", "base")
        return cls(data_dir=data, images_dir=Path(images) if images else None,
                   store_path=Path(store) if store else None, run_root=run_root,
                   shm_root=shm_root, pool_size=_int_env("SANDLOT_POOL_SIZE", 2),
                   pool_templates=tuple(n.strip() for n in pool.split(",") if n.strip()))

    @property
    def images(self) -> Path:
        return self.images_dir or (self.data_dir / "images")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "sandlot.db"

    @property
    def store_dir(self) -> Path:
        return self.store_path or (self.data_dir / "store")

    @property
    def disks_dir(self) -> Path:
        return self.data_dir / "disks"

    @property
    def hot_dir(self) -> Path:
        """Uncompressed snapshot files restores map: RAM must be on tmpfs to share pages."""
        return self.shm_root / "hot"

    def ensure(self) -> None:
        for d in (self.data_dir, self.images, self.store_dir, self.disks_dir, self.run_root,
                  self.hot_dir):
            d.mkdir(parents=True, exist_ok=True)
