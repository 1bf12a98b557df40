"""The single-host metadata store: SQLite under the data dir (WAL, one connection, a lock).

Calls are local and take microseconds, so they run inline on the event loop."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path

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
from sandlot.core.tenancy import OPERATOR_TENANT

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (hash TEXT PRIMARY KEY, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY, name TEXT UNIQUE, state TEXT NOT NULL, doc TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS hosts (
    id TEXT PRIMARY KEY, url TEXT NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL,
    heartbeat_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY, doc TEXT, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS builds (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, host TEXT NOT NULL, doc TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS build_logs (
    build_id TEXT NOT NULL, seq INTEGER NOT NULL, doc TEXT NOT NULL,
    PRIMARY KEY (build_id, seq));
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, host TEXT NOT NULL, doc TEXT NOT NULL,
    created_at REAL NOT NULL);
"""
# columns added after the first release: (table, column, definition)
ADDED_COLUMNS = (("sandboxes", "host", "TEXT NOT NULL DEFAULT ''"),
                 ("snapshots", "host", "TEXT NOT NULL DEFAULT ''"),
                 ("api_keys", "tenant", "TEXT"),
                 ("api_keys", "admin", "INTEGER NOT NULL DEFAULT 0"))


class SqliteStore:
    shared = False

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for table, column, definition in ADDED_COLUMNS:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        # Snapshot names are unique per tenant: the column holds "tenant/name"; names given
        # before tenants are the operator's.
        self._db.execute("UPDATE snapshots SET name = ? || '/' || name "
                         "WHERE name IS NOT NULL AND instr(name, '/') = 0", (OPERATOR_TENANT,))
        for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f, 0o600)  # env and metadata of every sandbox: the server's only
        self._lock = threading.Lock()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- API keys and secrets -------------------------------------------------------------

    async def add_key(self, key: str, tenant: str, admin: bool = False) -> None:
        # A key added again keeps its tenant (its objects); an admin's becomes an admin, and
        # one from before tenants (SANDLOT_API_KEY) takes the tenant given.
        self._q("INSERT INTO api_keys (hash, created_at, tenant, admin) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (hash) DO UPDATE SET admin = max(admin, excluded.admin), "
                "tenant = coalesce(tenant, excluded.tenant)",
                (hash_key(key), time.time(), tenant, int(admin)))

    async def key_principal(self, key: str) -> tuple[str, bool] | None:
        h = hash_key(key)
        rows = self._q("SELECT tenant, admin FROM api_keys WHERE hash = ?", (h,))
        return (tenant_of_row(h, rows[0][0]), bool(rows[0][1])) if rows else None

    async def keys(self) -> list[KeyRow]:
        return [KeyRow(key_id(h), tenant_of_row(h, t), bool(a), c) for h, t, a, c in self._q(
            "SELECT hash, tenant, admin, created_at FROM api_keys ORDER BY created_at")]

    async def revoke_key(self, kid: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM api_keys WHERE 'key-' || substr(hash, 1, 16) = ?",
                                   (kid,))
            return cur.rowcount > 0

    async def secret(self, name: str) -> str:
        self._q("INSERT OR IGNORE INTO secrets VALUES (?, ?)", (name, secrets.token_hex(32)))
        return self._q("SELECT value FROM secrets WHERE name = ?", (name,))[0][0]

    # ---- sandboxes ------------------------------------------------------------------------

    async def put_sandbox(self, sandbox_id: str, state: str, host: str, doc: dict) -> None:
        self._q("INSERT OR REPLACE INTO sandboxes (id, state, doc, updated_at, host) "
                "VALUES (?, ?, ?, ?, ?)", (sandbox_id, state, json.dumps(doc), time.time(), host))

    async def get_sandbox(self, sandbox_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM sandboxes WHERE id = ?", (sandbox_id,))
        return json.loads(rows[0][0]) if rows else None

    async def sandbox_host(self, sandbox_id: str) -> str | None:
        rows = self._q("SELECT host FROM sandboxes WHERE id = ?", (sandbox_id,))
        return rows[0][0] if rows else None

    async def sandboxes(self, states: tuple[str, ...] | None = None,
                        host: str | None = None) -> list[dict]:
        sql, args = listing("sandboxes", states, host, "?")
        return [json.loads(r[0]) for r in self._q(sql, args)]

    # ---- snapshots ------------------------------------------------------------------------

    async def put_snapshot(self, snapshot_id: str, name: str | None, state: str, host: str,
                           doc: dict, created_at: float) -> None:
        try:
            # an upsert, not INSERT OR REPLACE: that would delete the row holding the name
            self._q("INSERT INTO snapshots (id, name, state, doc, created_at, host) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                    "name = excluded.name, state = excluded.state, doc = excluded.doc, "
                    "host = excluded.host",
                    (snapshot_id, name, state, json.dumps(doc), created_at, host))
        except sqlite3.IntegrityError:
            raise NameTaken(name) from None

    async def get_snapshot(self, id_or_name: str) -> dict | None:
        rows = self._q("SELECT doc FROM snapshots WHERE id = ? OR name = ? "
                       "ORDER BY id = ? DESC LIMIT 1", (id_or_name, id_or_name, id_or_name))
        return json.loads(rows[0][0]) if rows else None

    async def snapshots(self, states: tuple[str, ...] | None = None,
                        host: str | None = None) -> list[dict]:
        sql, args = listing("snapshots", states, host, "?")
        return [json.loads(r[0]) for r in self._q(sql + " ORDER BY created_at", args)]

    async def name_taken(self, name: str, except_id: str | None = None) -> bool:
        rows = self._q("SELECT id FROM snapshots WHERE name = ?", (name,))
        return bool(rows) and rows[0][0] != except_id

    # ---- volumes --------------------------------------------------------------------------

    async def add_volume(self, volume_id: str, name: str, host: str, doc: dict,
                         created_at: float) -> None:
        try:
            self._q("INSERT INTO volumes VALUES (?, ?, ?, ?, ?)",
                    (volume_id, name, host, json.dumps(doc), created_at))
        except sqlite3.IntegrityError:
            raise NameTaken(name) from None

    async def get_volume(self, id_or_name: str) -> dict | None:
        rows = self._q("SELECT doc FROM volumes WHERE id = ? OR name = ? "
                       "ORDER BY id = ? DESC LIMIT 1", (id_or_name, id_or_name, id_or_name))
        return json.loads(rows[0][0]) if rows else None

    async def volumes(self) -> list[dict]:
        return [json.loads(d) for (d,) in self._q("SELECT doc FROM volumes ORDER BY created_at")]

    async def drop_volume(self, volume_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM volumes WHERE id = ?",
                                    (volume_id,)).rowcount > 0

    # ---- templates and their builds -------------------------------------------------------

    async def put_template(self, name: str, doc: dict | None) -> None:
        self._q("INSERT OR REPLACE INTO templates VALUES (?, ?, ?)",
                (name, None if doc is None else json.dumps(doc), time.time()))

    async def get_template(self, name: str) -> TemplateRow | None:
        rows = self._q("SELECT name, doc, updated_at FROM templates WHERE name = ?", (name,))
        return _template_row(rows[0]) if rows else None

    async def templates(self) -> list[TemplateRow]:
        return [_template_row(r) for r in self._q("SELECT name, doc, updated_at FROM templates "
                                                  "ORDER BY name")]

    async def put_build(self, build_id: str, state: str, host: str, doc: dict,
                        created_at: float) -> None:
        self._q("INSERT OR REPLACE INTO builds VALUES (?, ?, ?, ?, ?)",
                (build_id, state, host, json.dumps(doc), created_at))

    async def get_build(self, build_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM builds WHERE id = ?", (build_id,))
        return json.loads(rows[0][0]) if rows else None

    async def builds(self, states: tuple[str, ...] | None = None,
                     host: str | None = None) -> list[dict]:
        sql, args = listing("builds", states, host, "?")
        return [json.loads(r[0]) for r in self._q(sql + " ORDER BY created_at", args)]

    async def add_build_logs(self, build_id: str, first: int, lines: list[dict]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR IGNORE INTO build_logs VALUES (?, ?, ?)",
                                 [(build_id, first + i, json.dumps(line))
                                  for i, line in enumerate(lines)])

    async def build_logs(self, build_id: str, offset: int, limit: int) -> list[dict]:
        return [json.loads(r[0]) for r in self._q(
            "SELECT doc FROM build_logs WHERE build_id = ? AND seq >= ? ORDER BY seq LIMIT ?",
            (build_id, offset, limit))]

    async def drop_builds(self, states: tuple[str, ...], before: float) -> int:
        marks = ",".join("?" * len(states))
        with self._lock:
            ids = [r[0] for r in self._db.execute(
                f"SELECT id FROM builds WHERE state IN ({marks}) AND created_at < ?",
                (*states, before))]
            for bid in ids:
                self._db.execute("DELETE FROM build_logs WHERE build_id = ?", (bid,))
                self._db.execute("DELETE FROM builds WHERE id = ?", (bid,))
        return len(ids)

    # ---- hosts ----------------------------------------------------------------------------

    async def heartbeat(self, host_id: str, url: str, state: str, doc: dict) -> None:
        self._q("INSERT INTO hosts VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                f"url = excluded.url, state = {KEEP_DRAINING}, doc = excluded.doc, "
                "heartbeat_at = excluded.heartbeat_at",
                (host_id, url, state, json.dumps(doc), time.time()))

    async def set_host_state(self, host_id: str, state: str) -> bool:
        with self._lock:
            cur = self._db.execute("UPDATE hosts SET state = ? WHERE id = ?", (state, host_id))
            return cur.rowcount > 0

    async def hosts(self) -> list[HostRow]:
        t = time.time()
        return [HostRow(r[0], r[1], r[2], json.loads(r[3]), max(0.0, t - r[4]))
                for r in self._q("SELECT id, url, state, doc, heartbeat_at FROM hosts "
                                 "ORDER BY id")]

    async def mark_lost(self, timeout: float, reason: str) -> list[str]:
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                lost = [r[0] for r in db.execute(
                    "SELECT id FROM hosts WHERE state IN ('active', 'draining') "
                    "AND heartbeat_at < ?", (time.time() - timeout,))]
                for host in lost:
                    _mark_host_lost(db, host, reason.format(host=host))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return lost


def _mark_host_lost(db: sqlite3.Connection, host: str, reason: str) -> None:
    db.execute("UPDATE hosts SET state = 'lost' WHERE id = ?", (host,))
    marks = ",".join("?" * len(LIVE_SANDBOX_STATES))
    for sid, doc in db.execute(f"SELECT id, doc FROM sandboxes WHERE host = ? AND state IN "
                               f"({marks})", (host, *LIVE_SANDBOX_STATES)).fetchall():
        db.execute("UPDATE sandboxes SET state = 'lost', doc = ?, updated_at = ? WHERE id = ?",
                   (lost_sandbox_doc(doc, reason), time.time(), sid))
    marks = ",".join("?" * len(UNFINISHED_SNAPSHOT_STATES))
    for sid, doc in db.execute(f"SELECT id, doc FROM snapshots WHERE host = ? AND state IN "
                               f"({marks})", (host, *UNFINISHED_SNAPSHOT_STATES)).fetchall():
        db.execute("UPDATE snapshots SET state = 'failed', doc = ? WHERE id = ?",
                   (failed_snapshot_doc(doc, reason), sid))
    marks = ",".join("?" * len(UNFINISHED_BUILD_STATES))
    for bid, doc in db.execute(f"SELECT id, doc FROM builds WHERE host = ? AND state IN "
                               f"({marks})", (host, *UNFINISHED_BUILD_STATES)).fetchall():
        db.execute("UPDATE builds SET state = 'error', doc = ? WHERE id = ?",
                   (failed_build_doc(doc, reason), bid))


def _template_row(row: tuple) -> TemplateRow:
    return TemplateRow(row[0], None if row[1] is None else json.loads(row[1]), row[2])
