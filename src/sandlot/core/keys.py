"""API keys: created on the server host, stored hashed in the metadata store (the
deployment's database when SANDLOT_DATABASE_URL names one)."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from sandlot.config import Settings
from sandlot.core.db import new_api_key, run_sync, with_store


def create_key(data_dir: Path | str | None = None, e2b_format: bool = False) -> str:
    """Create, store (hashed) and return a new API key (`e2b_format`: ``e2b_`` and 40 hex
    digits, as E2B's SDKs check keys)."""
    settings = Settings.from_env(data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key = "e2b_" + secrets.token_hex(20) if e2b_format else new_api_key()

    async def add(db) -> None:
        await db.add_key(key)

    run_sync(with_store(settings.database_url, settings.db_path, add))
    return key


def owner_of(key: str) -> str:
    """Who a request's API key is, as records keep it (a digest: never the key itself)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
