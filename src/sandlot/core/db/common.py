"""What both metadata stores share: errors, key hashing, the host row, the lost-host rule."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass

# sandbox and snapshot states a lost host's records move out of (core/models.py names them)
LIVE_SANDBOX_STATES = ("starting", "running")
UNFINISHED_SNAPSHOT_STATES = ("creating", "uploading")
# template build states a lost host's builds move out of (core/builds.py names them)
UNFINISHED_BUILD_STATES = ("waiting", "building")
# An active or draining host's state is the operators' (drain, activate through any host): its
# heartbeat keeps it; a heartbeat only brings a lost or stopped host back.
KEEP_DRAINING = ("CASE WHEN hosts.state IN ('active', 'draining') THEN hosts.state "
                 "ELSE excluded.state END")


class NameTaken(Exception):
    """A snapshot name is another snapshot's."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return "sl_" + secrets.token_urlsafe(24)


def key_id(key_hash: str) -> str:
    """A key's public name (in `sandlot keys list`, for revoke): never the key itself."""
    return "key-" + key_hash[:16]


def tenant_of_row(key_hash: str, tenant: str | None) -> str:
    """A key's tenant; a key made before tenants is a tenant of its own, named as the
    records it made name their owner."""
    return tenant or key_id(key_hash)


def scoped_name(tenant: str, name: str | None) -> str | None:
    """A snapshot name as the store keeps it: unique within its tenant only."""
    return None if name is None else f"{tenant}/{name}"


@dataclass(frozen=True)
class KeyRow:
    """An API key as `sandlot keys list` shows it."""

    key_id: str
    tenant: str
    admin: bool
    created_at: float


def listing(table: str, states: tuple[str, ...] | None, host: str | None,
            mark: str) -> tuple[str, tuple]:
    """The query of a listing of `table`'s docs by state and host (`mark`: the driver's
    placeholder), and its arguments."""
    clauses, args = [], []
    if states:
        clauses.append(f"state IN ({', '.join([mark] * len(states))})")
        args += list(states)
    if host is not None:
        clauses.append(f"host = {mark}")
        args.append(host)
    where = " WHERE " + " AND ".join(clauses) if clauses else ""
    return f"SELECT doc FROM {table}{where}", tuple(args)


@dataclass(frozen=True)
class TemplateRow:
    """A template built through the API as the store has it: `doc` is its TemplateInfo,
    None once it was deleted (so a host that cached it learns it is gone)."""

    name: str
    doc: dict | None
    updated_at: float


@dataclass(frozen=True)
class HostRow:
    """A host as the store has it: `age` is the seconds since its last heartbeat."""

    host_id: str
    url: str
    state: str
    doc: dict
    age: float


def lost_sandbox_doc(doc_text: str, reason: str) -> str:
    doc = json.loads(doc_text)
    doc["state"] = "lost"
    doc["pid"] = None
    doc["error"] = reason
    return json.dumps(doc)


def failed_snapshot_doc(doc_text: str, reason: str) -> str:
    doc = json.loads(doc_text)
    doc["state"] = "failed"
    doc["error"] = reason
    return json.dumps(doc)


def failed_build_doc(doc_text: str, reason: str) -> str:
    doc = json.loads(doc_text)
    doc["status"] = "error"
    doc["reason"] = reason
    doc["error"] = "HostUnavailableError"
    return json.dumps(doc)
