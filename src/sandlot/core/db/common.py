"""What both metadata stores share: errors, key hashing, the host row, the lost-host rule."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass

# sandbox and snapshot states a lost host's records move out of (core/models.py names them)
LIVE_SANDBOX_STATES = ("starting", "running")
UNFINISHED_SNAPSHOT_STATES = ("creating", "uploading")
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
