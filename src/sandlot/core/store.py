"""Metadata store: SQLite under the data dir. Records are JSON documents with indexed columns."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (hash TEXT PRIMARY KEY, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, doc TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY, name TEXT UNIQUE, state TEXT NOT NULL, doc TEXT NOT NULL,
    created_at REAL NOT NULL);
"""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class MetadataStore:
    """Thread-safe, synchronous; every call is one short transaction."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(f, 0o600)  # env and metadata of every sandbox: the server's only
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- API keys -------------------------------------------------------------------------

    def add_key(self, key: str) -> None:
        self._q("INSERT OR IGNORE INTO api_keys VALUES (?, ?)", (hash_key(key), time.time()))

    def new_key(self) -> str:
        key = "sl_" + secrets.token_urlsafe(24)
        self.add_key(key)
        return key

    def key_valid(self, key: str) -> bool:
        return bool(self._q("SELECT 1 FROM api_keys WHERE hash = ?", (hash_key(key),)))

    # ---- sandboxes ------------------------------------------------------------------------

    def put_sandbox(self, sandbox_id: str, state: str, doc: dict) -> None:
        self._q("INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?)",
                (sandbox_id, state, json.dumps(doc), time.time()))

    def get_sandbox(self, sandbox_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM sandboxes WHERE id = ?", (sandbox_id,))
        return json.loads(rows[0][0]) if rows else None

    def sandboxes(self, states: tuple[str, ...] | None = None) -> list[dict]:
        if states:
            marks = ",".join("?" * len(states))
            rows = self._q(f"SELECT doc FROM sandboxes WHERE state IN ({marks})", states)
        else:
            rows = self._q("SELECT doc FROM sandboxes")
        return [json.loads(r[0]) for r in rows]

    # ---- snapshots ------------------------------------------------------------------------

    def put_snapshot(self, snapshot_id: str, name: str | None, state: str, doc: dict,
                     created_at: float) -> None:
        """Insert or update; raises sqlite3.IntegrityError if `name` is taken by another."""
        self._q("INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?, ?, ?)",
                (snapshot_id, name, state, json.dumps(doc), created_at))

    def get_snapshot(self, id_or_name: str) -> dict | None:
        rows = self._q("SELECT doc FROM snapshots WHERE id = ? OR name = ? "
                       "ORDER BY id = ? DESC LIMIT 1", (id_or_name, id_or_name, id_or_name))
        return json.loads(rows[0][0]) if rows else None

    def snapshots(self, states: tuple[str, ...] | None = None) -> list[dict]:
        if states:
            marks = ",".join("?" * len(states))
            rows = self._q(f"SELECT doc FROM snapshots WHERE state IN ({marks}) "
                           "ORDER BY created_at", states)
        else:
            rows = self._q("SELECT doc FROM snapshots ORDER BY created_at")
        return [json.loads(r[0]) for r in rows]

    def name_taken(self, name: str, except_id: str | None = None) -> bool:
        rows = self._q("SELECT id FROM snapshots WHERE name = ?", (name,))
        return bool(rows) and rows[0][0] != except_id
