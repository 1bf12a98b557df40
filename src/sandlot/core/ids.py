"""The ids core mints, and their shapes: sandboxes (also the warm pool's VMs, so a claimed VM
is the sandbox of its id), snapshots, restore generations. Nothing below core makes one."""

from __future__ import annotations

import re
import secrets

SNAPSHOT_ID_RE = re.compile(r"snap-[0-9a-f]{10}")  # what new_snapshot_id makes
# Why: a name may start with 'snap-' (E2B accepts any), so only the exact shape of an id
# (and of a sandbox's) is one; a name of that shape is refused, so each string is one or other.
SANDBOX_ID_RE = re.compile(r"^sb-[0-9a-f]{10}$")


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(5)


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(5)


def new_generation() -> str:
    return "g-" + secrets.token_hex(6)


def is_snapshot_id(text: str) -> bool:
    return SNAPSHOT_ID_RE.fullmatch(text) is not None
