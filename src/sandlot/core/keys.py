"""API keys: created on the server host, stored hashed in the metadata store (the
deployment's database when SANDLOT_DATABASE_URL names one)."""

from __future__ import annotations

from pathlib import Path

from sandlot.config import Settings
from sandlot.core.db import new_api_key, run_sync, with_store


def create_key(data_dir: Path | str | None = None) -> str:
    """Create, store (hashed) and return a new API key."""
    settings = Settings.from_env(data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key = new_api_key()

    async def add(db) -> None:
        await db.add_key(key)

    run_sync(with_store(settings.database_url, settings.db_path, add))
    return key
