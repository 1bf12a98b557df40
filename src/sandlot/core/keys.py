"""API keys: created on the server host, stored hashed in the metadata store."""

from __future__ import annotations

from pathlib import Path

from sandlot.config import Settings
from sandlot.core.store import MetadataStore


def create_key(data_dir: Path | str | None = None) -> str:
    """Create, store (hashed) and return a new API key."""
    settings = Settings.from_env(data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = MetadataStore(settings.db_path)
    try:
        return db.new_key()
    finally:
        db.close()
