"""API keys and tenants, managed on a server host (`sandlot keys`): stored hashed in the
metadata store (the deployment's database when SANDLOT_DATABASE_URL names one)."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from sandlot.config import Settings
from sandlot.core.db import KeyRow, new_api_key, run_sync, with_store
from sandlot.errors import InvalidArgumentError, NotFoundError

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def _run(data_dir: Path | str | None, fn):
    settings = Settings.from_env(data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return run_sync(with_store(settings.database_url, settings.db_path, fn))


def check_tenant(name: str) -> str:
    if not TENANT_RE.match(name):
        raise InvalidArgumentError("tenant names are 1-63 lowercase letters, digits, '.', '_' "
                                   "or '-', starting with a letter or digit")
    return name


def create_key(data_dir: Path | str | None = None, *, tenant: str | None = None,
               admin: bool = False, e2b_format: bool = False) -> tuple[str, str]:
    """Create and store (hashed) a new API key of `tenant` (None: a new tenant of its own);
    returns (key, tenant). `admin`: the key sees every tenant's objects. `e2b_format`:
    ``e2b_`` and 40 hex digits, as E2B's SDKs check keys."""
    tenant = check_tenant(tenant) if tenant else "t-" + secrets.token_hex(4)
    key = "e2b_" + secrets.token_hex(20) if e2b_format else new_api_key()

    async def add(db) -> None:
        await db.add_key(key, tenant, admin)

    _run(data_dir, add)
    return key, tenant


def list_keys(data_dir: Path | str | None = None) -> list[KeyRow]:
    async def keys(db) -> list[KeyRow]:
        return await db.keys()

    return _run(data_dir, keys)


def revoke_key(key_id: str, data_dir: Path | str | None = None) -> None:
    """Revoke a key by its id (as `list_keys` shows it); servers refuse it within seconds."""
    async def revoke(db) -> bool:
        return await db.revoke_key(key_id)

    if not _run(data_dir, revoke):
        raise NotFoundError(f"no API key {key_id!r}")
