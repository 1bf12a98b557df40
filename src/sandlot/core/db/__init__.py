"""The metadata store: API keys, sandboxes, snapshots, templates built through the API and
their builds, and the deployment's hosts.

SQLite under the data dir is the single-host default (`sqlite.py`); a PostgreSQL URL makes
every host of a deployment share one database (`postgres.py`). Records are JSON documents with
their indexed columns beside them. Both answer the same async calls (`MetadataStore`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Protocol, TypeVar

from sandlot.core.db.common import (
    HostRow,
    KeyRow,
    NameTaken,
    TemplateRow,
    hash_key,
    new_api_key,
    scoped_name,
)

T = TypeVar("T")


class MetadataStore(Protocol):
    """What core keeps about the deployment. Every call is one short transaction."""

    shared: bool  # several hosts use it (PostgreSQL): sandboxes of other hosts are in it

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def add_key(self, key: str, tenant: str, admin: bool = False) -> None: ...

    async def key_principal(self, key: str) -> tuple[str, bool] | None:
        """The key's (tenant, admin), or None if it is not a key of the deployment."""
        ...

    async def keys(self) -> list[KeyRow]: ...
    async def revoke_key(self, kid: str) -> bool: ...

    async def secret(self, name: str) -> str:
        """A random secret kept in the store, made on first use (the same for every host)."""
        ...

    async def put_sandbox(self, sandbox_id: str, state: str, host: str, doc: dict) -> None: ...
    async def get_sandbox(self, sandbox_id: str) -> dict | None: ...
    async def sandbox_host(self, sandbox_id: str) -> str | None: ...
    async def sandboxes(self, states: tuple[str, ...] | None = None,
                        host: str | None = None) -> list[dict]: ...

    async def put_snapshot(self, snapshot_id: str, name: str | None, state: str, host: str,
                           doc: dict, created_at: float) -> None:
        """Insert or update; raises NameTaken if `name` is another snapshot's."""
        ...

    async def get_snapshot(self, id_or_name: str) -> dict | None: ...
    async def snapshots(self, states: tuple[str, ...] | None = None,
                        host: str | None = None) -> list[dict]: ...
    async def name_taken(self, name: str, except_id: str | None = None) -> bool: ...

    async def put_template(self, name: str, doc: dict | None) -> None:
        """Point a template name at `doc` (its TemplateInfo); None: it was deleted."""
        ...

    async def get_template(self, name: str) -> TemplateRow | None: ...
    async def templates(self) -> list[TemplateRow]: ...

    async def put_build(self, build_id: str, state: str, host: str, doc: dict,
                        created_at: float) -> None: ...
    async def get_build(self, build_id: str) -> dict | None: ...
    async def builds(self, states: tuple[str, ...] | None = None,
                     host: str | None = None) -> list[dict]: ...

    async def add_build_logs(self, build_id: str, first: int, lines: list[dict]) -> None:
        """Log lines `first`, `first + 1`, ... of a build (a line already kept is kept)."""
        ...

    async def build_logs(self, build_id: str, offset: int, limit: int) -> list[dict]: ...

    async def drop_builds(self, states: tuple[str, ...], before: float) -> int:
        """Forget the builds in `states` made before `before` (a time), with their logs."""
        ...

    async def add_volume(self, volume_id: str, name: str, host: str, doc: dict,
                         created_at: float) -> None:
        """A new volume; raises NameTaken if `name` (tenant-scoped) is another's."""
        ...

    async def get_volume(self, id_or_name: str) -> dict | None: ...
    async def volumes(self) -> list[dict]: ...
    async def drop_volume(self, volume_id: str) -> bool: ...

    async def heartbeat(self, host_id: str, url: str, state: str, doc: dict) -> None:
        """Register or refresh a host (stamped with the store's clock)."""
        ...

    async def set_host_state(self, host_id: str, state: str) -> bool: ...
    async def hosts(self) -> list[HostRow]: ...

    async def mark_lost(self, timeout: float, reason: str) -> list[str]:
        """Hosts silent for `timeout` s become `lost`, with their running sandboxes (and their
        unfinished snapshots and template builds failed); returns the hosts that were marked now."""
        ...


def open_store(database_url: str | None, sqlite_path: Path) -> MetadataStore:
    """The store a server uses: PostgreSQL when `database_url` names one, else SQLite."""
    if database_url and database_url.startswith(("postgres://", "postgresql://")):
        from sandlot.core.db.postgres import PostgresStore

        return PostgresStore(database_url)
    if database_url:
        raise ValueError(f"SANDLOT_DATABASE_URL must be a postgresql:// URL, not {database_url!r}")
    from sandlot.core.db.sqlite import SqliteStore

    return SqliteStore(sqlite_path)


def run_sync(call: Awaitable[T]) -> T:
    """Run one store call from synchronous code (the CLI's offline commands)."""
    return asyncio.run(call)  # type: ignore[arg-type]


async def with_store(database_url: str | None, sqlite_path: Path, fn):
    """Open a store, run `await fn(store)`, close it."""
    store = open_store(database_url, sqlite_path)
    await store.open()
    try:
        return await fn(store)
    finally:
        await store.close()


__all__ = ["HostRow", "KeyRow", "MetadataStore", "NameTaken", "TemplateRow", "hash_key",
           "new_api_key", "open_store", "run_sync", "scoped_name", "with_store"]
