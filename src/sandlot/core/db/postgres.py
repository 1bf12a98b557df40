"""The deployment's metadata store: one PostgreSQL database shared by every host.

psycopg 3's async pool; migrations are applied at start under an advisory lock (every host
may start at once); a host marked lost is one transaction with row locks, so several hosts
noticing it at once mark it once; snapshot changes are announced with NOTIFY, so a host
waiting for another host's snapshot wakes when it changes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from sandlot.core.db.common import (
    KEEP_DRAINING,
    LIVE_SANDBOX_STATES,
    UNFINISHED_BUILD_STATES,
    UNFINISHED_SNAPSHOT_STATES,
    HostRow,
    KeyRow,
    NameTaken,
    TemplateRow,
    failed_build_doc,
    failed_snapshot_doc,
    hash_key,
    key_id,
    listing,
    lost_sandbox_doc,
    tenant_of_row,
)

log = logging.getLogger(__name__)
MIGRATION_LOCK = 0x5A4D_4C4F  # pg_advisory_xact_lock key of the schema
SNAPSHOT_CHANNEL = "sandlot_snapshots"
SANDBOX_CHANNEL = "sandlot_sandboxes"
NOW = "extract(epoch from clock_timestamp())"

# Append only: each entry is one schema version.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE api_keys (hash TEXT PRIMARY KEY, created_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY, state TEXT NOT NULL, host TEXT NOT NULL, doc TEXT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX sandboxes_state ON sandboxes (state);
    CREATE INDEX sandboxes_host ON sandboxes (host, state);
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY, name TEXT UNIQUE, state TEXT NOT NULL, host TEXT NOT NULL,
        doc TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX snapshots_state ON snapshots (state);
    CREATE TABLE hosts (
        id TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL,
        heartbeat_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    # tenants: a key's tenant and admin flag; snapshot names unique per tenant ("tenant/name")
    """
    ALTER TABLE api_keys ADD COLUMN tenant TEXT;
    ALTER TABLE api_keys ADD COLUMN admin BOOLEAN NOT NULL DEFAULT false;
    UPDATE snapshots SET name = 'operator/' || name
        WHERE name IS NOT NULL AND position('/' in name) = 0;
    """,
    # templates built through the API (doc NULL: deleted) and their builds, with their logs
    """
    CREATE TABLE templates (
        name TEXT PRIMARY KEY, doc TEXT, updated_at DOUBLE PRECISION NOT NULL);
    CREATE TABLE builds (
        id TEXT PRIMARY KEY, state TEXT NOT NULL, host TEXT NOT NULL, doc TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX builds_state ON builds (state, host);
    CREATE TABLE build_logs (
        build_id TEXT NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL,
        PRIMARY KEY (build_id, seq));
    """,
    # volumes (names unique per tenant: "tenant/name")
    """
    CREATE TABLE volumes (
        id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, host TEXT NOT NULL, doc TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL);
    """,
)


class PostgresStore:
    shared = True

    def __init__(self, url: str, min_size: int = 1, max_size: int = 8) -> None:
        self.url = url
        self._pool = AsyncConnectionPool(url, min_size=min_size, max_size=max_size, open=False,
                                         kwargs={"autocommit": True})
        self._listener: asyncio.Task | None = None
        self._snapshot_waiters: list[Callable[[str], None]] = []
        self._sandbox_waiters: list[Callable[[str], None]] = []

    async def open(self) -> None:
        try:
            await self._pool.open(wait=True, timeout=15)
        except psycopg.Error as e:
            raise ConnectionError(f"cannot reach the database: {e}") from e
        await self._migrate()
        self._listener = asyncio.create_task(self._listen())

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        await self._pool.close()

    async def _migrate(self) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_version "
                               "(version INTEGER NOT NULL)")
            row = await (await conn.execute("SELECT max(version) FROM schema_version")
                         ).fetchone()
            have = row[0] or 0
            for version, sql in enumerate(MIGRATIONS[have:], start=have + 1):
                log.info("database: applying schema version %d", version)
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_version VALUES (%s)", (version,))

    async def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        async with self._pool.connection() as conn:
            cur = await conn.execute(sql, args)
            return await cur.fetchall() if cur.description else []

    # ---- notifications --------------------------------------------------------------------

    def on_snapshot_change(self, callback: Callable[[str], None]) -> None:
        """Call `callback(snapshot_id)` when any host changes a snapshot."""
        self._snapshot_waiters.append(callback)

    def on_sandbox_change(self, callback: Callable[[str], None]) -> None:
        """Call `callback(sandbox_id)` when any host saves a sandbox."""
        self._sandbox_waiters.append(callback)

    async def _listen(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.url,
                                                                 autocommit=True) as conn:
                    await conn.execute(f"LISTEN {SNAPSHOT_CHANNEL}")
                    await conn.execute(f"LISTEN {SANDBOX_CHANNEL}")
                    async for note in conn.notifies():
                        waiters = (self._snapshot_waiters if note.channel == SNAPSHOT_CHANNEL
                                   else self._sandbox_waiters)
                        for cb in list(waiters):
                            cb(note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep listening across reconnects
                log.warning("database notifications: %s; reconnecting", e)
                await asyncio.sleep(1)

    # ---- API keys and secrets -------------------------------------------------------------

    async def add_key(self, key: str, tenant: str, admin: bool = False) -> None:
        # A key added again keeps its tenant (its objects); an admin's becomes an admin, and
        # one from before tenants (SANDLOT_API_KEY) takes the tenant given.
        await self._q("INSERT INTO api_keys (hash, created_at, tenant, admin) "
                      "VALUES (%s, %s, %s, %s) ON CONFLICT (hash) DO UPDATE SET "
                      "admin = api_keys.admin OR excluded.admin, "
                      "tenant = coalesce(api_keys.tenant, excluded.tenant)",
                      (hash_key(key), time.time(), tenant, admin))

    async def key_principal(self, key: str) -> tuple[str, bool] | None:
        h = hash_key(key)
        rows = await self._q("SELECT tenant, admin FROM api_keys WHERE hash = %s", (h,))
        return (tenant_of_row(h, rows[0][0]), bool(rows[0][1])) if rows else None

    async def keys(self) -> list[KeyRow]:
        return [KeyRow(key_id(h), tenant_of_row(h, t), bool(a), c) for h, t, a, c in
                await self._q("SELECT hash, tenant, admin, created_at FROM api_keys "
                              "ORDER BY created_at")]

    async def revoke_key(self, kid: str) -> bool:
        rows = await self._q("DELETE FROM api_keys WHERE 'key-' || substr(hash, 1, 16) = %s "
                             "RETURNING hash", (kid,))
        return bool(rows)

    async def secret(self, name: str) -> str:
        await self._q("INSERT INTO secrets VALUES (%s, %s) ON CONFLICT DO NOTHING",
                      (name, secrets.token_hex(32)))
        return (await self._q("SELECT value FROM secrets WHERE name = %s", (name,)))[0][0]

    # ---- sandboxes ------------------------------------------------------------------------

    async def put_sandbox(self, sandbox_id: str, state: str, host: str, doc: dict) -> None:
        # one statement, as before the notification (a save is on every call's path)
        await self._q(
            f"WITH saved AS (INSERT INTO sandboxes VALUES (%s, %s, %s, %s, {NOW}) "
            "ON CONFLICT (id) DO UPDATE SET state = excluded.state, host = excluded.host, "
            "doc = excluded.doc, updated_at = excluded.updated_at RETURNING id) "
            "SELECT pg_notify(%s, id) FROM saved",
            (sandbox_id, state, host, json.dumps(doc), SANDBOX_CHANNEL))

    async def get_sandbox(self, sandbox_id: str) -> dict | None:
        rows = await self._q("SELECT doc FROM sandboxes WHERE id = %s", (sandbox_id,))
        return json.loads(rows[0][0]) if rows else None

    async def sandbox_host(self, sandbox_id: str) -> str | None:
        rows = await self._q("SELECT host FROM sandboxes WHERE id = %s", (sandbox_id,))
        return rows[0][0] if rows else None

    async def sandboxes(self, states: tuple[str, ...] | None = None,
                        host: str | None = None) -> list[dict]:
        sql, args = listing("sandboxes", states, host, "%s")
        return [json.loads(r[0]) for r in await self._q(sql, args)]

    # ---- snapshots ------------------------------------------------------------------------

    async def put_snapshot(self, snapshot_id: str, name: str | None, state: str, host: str,
                           doc: dict, created_at: float) -> None:
        try:
            async with self._pool.connection() as conn, conn.transaction():
                await conn.execute(
                    "INSERT INTO snapshots VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (id) "
                    "DO UPDATE SET name = excluded.name, state = excluded.state, "
                    "host = excluded.host, doc = excluded.doc",
                    (snapshot_id, name, state, host, json.dumps(doc), created_at))
                await conn.execute("SELECT pg_notify(%s, %s)", (SNAPSHOT_CHANNEL, snapshot_id))
        except psycopg.errors.UniqueViolation:
            raise NameTaken(name) from None

    async def get_snapshot(self, id_or_name: str) -> dict | None:
        rows = await self._q("SELECT doc FROM snapshots WHERE id = %s OR name = %s "
                             "ORDER BY id = %s DESC LIMIT 1", (id_or_name, id_or_name, id_or_name))
        return json.loads(rows[0][0]) if rows else None

    async def snapshots(self, states: tuple[str, ...] | None = None,
                        host: str | None = None) -> list[dict]:
        sql, args = listing("snapshots", states, host, "%s")
        return [json.loads(r[0]) for r in await self._q(sql + " ORDER BY created_at", args)]

    async def name_taken(self, name: str, except_id: str | None = None) -> bool:
        rows = await self._q("SELECT id FROM snapshots WHERE name = %s", (name,))
        return bool(rows) and rows[0][0] != except_id

    # ---- volumes --------------------------------------------------------------------------

    async def add_volume(self, volume_id: str, name: str, host: str, doc: dict,
                         created_at: float) -> None:
        try:
            await self._q("INSERT INTO volumes VALUES (%s, %s, %s, %s, %s)",
                          (volume_id, name, host, json.dumps(doc), created_at))
        except psycopg.errors.UniqueViolation:
            raise NameTaken(name) from None

    async def get_volume(self, id_or_name: str) -> dict | None:
        rows = await self._q("SELECT doc FROM volumes WHERE id = %s OR name = %s "
                             "ORDER BY id = %s DESC LIMIT 1", (id_or_name, id_or_name, id_or_name))
        return json.loads(rows[0][0]) if rows else None

    async def volumes(self) -> list[dict]:
        return [json.loads(d) for (d,) in await self._q(
            "SELECT doc FROM volumes ORDER BY created_at")]

    async def drop_volume(self, volume_id: str) -> bool:
        async with self._pool.connection() as conn:
            cur = await conn.execute("DELETE FROM volumes WHERE id = %s", (volume_id,))
            return cur.rowcount > 0

    # ---- templates and their builds -------------------------------------------------------

    async def put_template(self, name: str, doc: dict | None) -> None:
        await self._q(f"INSERT INTO templates VALUES (%s, %s, {NOW}) ON CONFLICT (name) DO "
                      "UPDATE SET doc = excluded.doc, updated_at = excluded.updated_at",
                      (name, None if doc is None else json.dumps(doc)))

    async def get_template(self, name: str) -> TemplateRow | None:
        rows = await self._q("SELECT name, doc, updated_at FROM templates WHERE name = %s",
                             (name,))
        return _template_row(rows[0]) if rows else None

    async def templates(self) -> list[TemplateRow]:
        return [_template_row(r) for r in await self._q(
            "SELECT name, doc, updated_at FROM templates ORDER BY name")]

    async def put_build(self, build_id: str, state: str, host: str, doc: dict,
                        created_at: float) -> None:
        await self._q("INSERT INTO builds VALUES (%s, %s, %s, %s, %s) ON CONFLICT (id) DO "
                      "UPDATE SET state = excluded.state, host = excluded.host, "
                      "doc = excluded.doc", (build_id, state, host, json.dumps(doc), created_at))

    async def get_build(self, build_id: str) -> dict | None:
        rows = await self._q("SELECT doc FROM builds WHERE id = %s", (build_id,))
        return json.loads(rows[0][0]) if rows else None

    async def builds(self, states: tuple[str, ...] | None = None,
                     host: str | None = None) -> list[dict]:
        sql, args = listing("builds", states, host, "%s")
        return [json.loads(r[0]) for r in await self._q(sql + " ORDER BY created_at", args)]

    async def add_build_logs(self, build_id: str, first: int, lines: list[dict]) -> None:
        if not lines:
            return
        async with self._pool.connection() as conn:
            async with conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO build_logs VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    [(build_id, first + i, json.dumps(line)) for i, line in enumerate(lines)])

    async def build_logs(self, build_id: str, offset: int, limit: int) -> list[dict]:
        return [json.loads(r[0]) for r in await self._q(
            "SELECT doc FROM build_logs WHERE build_id = %s AND seq >= %s ORDER BY seq "
            "LIMIT %s", (build_id, offset, limit))]

    async def drop_builds(self, states: tuple[str, ...], before: float) -> int:
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute("DELETE FROM builds WHERE state = ANY(%s) AND "
                                     "created_at < %s RETURNING id", (list(states), before))
            ids = [r[0] for r in await cur.fetchall()]
            if ids:
                await conn.execute("DELETE FROM build_logs WHERE build_id = ANY(%s)", (ids,))
        return len(ids)

    # ---- hosts ----------------------------------------------------------------------------

    async def heartbeat(self, host_id: str, url: str, state: str, doc: dict) -> None:
        await self._q(
            f"INSERT INTO hosts VALUES (%s, %s, %s, %s, {NOW}) ON CONFLICT (id) DO UPDATE "
            f"SET url = excluded.url, state = {KEEP_DRAINING}, doc = excluded.doc, "
            "heartbeat_at = excluded.heartbeat_at", (host_id, url, state, json.dumps(doc)))

    async def set_host_state(self, host_id: str, state: str) -> bool:
        async with self._pool.connection() as conn:
            cur = await conn.execute("UPDATE hosts SET state = %s WHERE id = %s",
                                     (state, host_id))
            return cur.rowcount > 0

    async def hosts(self) -> list[HostRow]:
        rows = await self._q(f"SELECT id, url, state, doc, {NOW} - heartbeat_at FROM hosts "
                             "ORDER BY id")
        return [HostRow(r[0], r[1], r[2], json.loads(r[3]), max(0.0, r[4])) for r in rows]

    async def mark_lost(self, timeout: float, reason: str) -> list[str]:
        async with self._pool.connection() as conn, conn.transaction():
            conn.row_factory = tuple_row
            cur = await conn.execute(
                "SELECT id FROM hosts WHERE state IN ('active', 'draining') AND heartbeat_at < "
                f"{NOW} - %s FOR UPDATE SKIP LOCKED", (timeout,))
            lost = [r[0] for r in await cur.fetchall()]
            for host in lost:
                why = reason.format(host=host)
                await conn.execute("UPDATE hosts SET state = 'lost' WHERE id = %s", (host,))
                await _mark_records(conn, "sandboxes", host, LIVE_SANDBOX_STATES, "lost",
                                    lost_sandbox_doc, why, SANDBOX_CHANNEL)
                await _mark_records(conn, "snapshots", host, UNFINISHED_SNAPSHOT_STATES,
                                    "failed", failed_snapshot_doc, why, SNAPSHOT_CHANNEL)
                await _mark_records(conn, "builds", host, UNFINISHED_BUILD_STATES, "error",
                                    failed_build_doc, why, None)
        return lost


async def _mark_records(conn: psycopg.AsyncConnection, table: str, host: str,
                        states: tuple[str, ...], state: str,
                        doc_of: Callable[[str, str], str], reason: str,
                        channel: str | None) -> None:
    """A lost host's records of `table` in `states` move to `state`, their docs rewritten
    with the reason (and the change announced on `channel`)."""
    cur = await conn.execute(f"SELECT id, doc FROM {table} WHERE host = %s AND "
                             "state = ANY(%s) FOR UPDATE", (host, list(states)))
    stamp = f", updated_at = {NOW}" if table == "sandboxes" else ""
    for rid, doc in await cur.fetchall():
        await conn.execute(f"UPDATE {table} SET state = %s, doc = %s{stamp} WHERE id = %s",
                           (state, doc_of(doc, reason), rid))
        if channel:
            await conn.execute("SELECT pg_notify(%s, %s)", (channel, rid))


def _template_row(row: tuple) -> TemplateRow:
    return TemplateRow(row[0], None if row[1] is None else json.loads(row[1]), float(row[2]))
