"""Template build steps as E2B's SDKs send them (COPY, ENV, RUN, WORKDIR, USER), checked;
core/builds.py runs them in a sandbox of the base image.

Every template gets E2B's `user` account (home /home/user, passwordless sudo where sudo is
installed) before its steps (`ENSURE_USER`, run as root), and the steps run as `user` in
/home/user unless they say otherwise, as on E2B. A COPY's files are the upload of its files
hash (a tar of paths relative to the client's context).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandlot.errors import InvalidArgumentError

KINDS = ("COPY", "ENV", "RUN", "WORKDIR", "USER")
DEFAULT_USER = "user"
DEFAULT_WORKDIR = "/home/user"
MAX_STEPS = 512
HASH_RE = re.compile(r"^[A-Za-z0-9_-]{16,128}$")
USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MODE_RE = re.compile(r"^0?[0-7]{3,4}$")
# E2B's `user`, made with whatever the image has (useradd, busybox adduser, or by hand).
ENSURE_USER = r"""set -e
if ! id user >/dev/null 2>&1; then
  sh=/bin/sh; [ -x /bin/bash ] && sh=/bin/bash
  if command -v useradd >/dev/null 2>&1; then useradd -m -s "$sh" user
  elif command -v adduser >/dev/null 2>&1; then adduser -D -s "$sh" user
  else
    grep -q '^user:' /etc/group 2>/dev/null || echo 'user:x:1000:' >> /etc/group
    echo "user:x:1000:1000::/home/user:$sh" >> /etc/passwd
  fi
fi
mkdir -p /home/user && chown user /home/user
if [ -d /etc/sudoers.d ]; then
  echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/user && chmod 440 /etc/sudoers.d/user
fi"""


@dataclass(frozen=True)
class Step:
    kind: str
    args: tuple[str, ...]
    files_hash: str | None = None


def parse_steps(raw: list) -> list[Step]:
    """E2B's steps (``{"type", "args", "filesHash", "force"}``), checked;
    InvalidArgumentError names the first bad one (1-based, as E2B's build errors do)."""
    if not isinstance(raw, list):
        raise InvalidArgumentError("steps must be a list")
    if len(raw) > MAX_STEPS:
        raise InvalidArgumentError(f"a template has at most {MAX_STEPS} steps")
    out = []
    for n, item in enumerate(raw, 1):
        if not isinstance(item, dict):
            raise InvalidArgumentError(f"step {n} must be an object")
        kind, args = item.get("type"), item.get("args") or []
        if kind not in KINDS:
            raise InvalidArgumentError(f"step {n}: unknown type {str(kind)[:32]!r}; sandlot "
                                       f"builds {', '.join(KINDS)}")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise InvalidArgumentError(f"step {n}: args must be a list of strings")
        files_hash = item.get("filesHash")
        step = Step(kind, tuple(args), files_hash if isinstance(files_hash, str) else None)
        _check(step, n)
        out.append(step)
    return out


def _check(step: Step, n: int) -> None:
    a = step.args
    where = f"step {n} ({step.kind})"
    if any("\x00" in x for x in a):
        raise InvalidArgumentError(f"{where}: arguments may not hold NUL")
    if step.kind == "RUN":
        if not 1 <= len(a) <= 2 or not a[0].strip():
            raise InvalidArgumentError(f"{where}: a command and an optional user")
        if len(a) == 2 and a[1] and not USER_RE.fullmatch(a[1]):
            raise InvalidArgumentError(f"{where}: invalid user {a[1][:40]!r}")
    elif step.kind == "ENV":
        if not a or len(a) % 2:
            raise InvalidArgumentError(f"{where}: name and value pairs")
        for key, value in zip(a[::2], a[1::2], strict=True):
            if not ENV_KEY_RE.fullmatch(key):
                raise InvalidArgumentError(f"{where}: invalid variable name {key[:40]!r}")
            if "\n" in value or "\r" in value:
                raise InvalidArgumentError(f"{where}: {key}'s value may not hold a newline")
    elif step.kind == "WORKDIR":
        if len(a) != 1 or not a[0].startswith("/") or "\n" in a[0]:
            raise InvalidArgumentError(f"{where}: one absolute path")
    elif step.kind == "USER":
        if len(a) != 1 or not USER_RE.fullmatch(a[0]):
            raise InvalidArgumentError(f"{where}: one user name")
    elif step.kind == "COPY":
        if not 2 <= len(a) <= 4:
            raise InvalidArgumentError(f"{where}: source, destination, user, mode")
        src, dest = a[0], a[1]
        parts = src.replace("\\", "/").split("/")
        if not src or src.startswith("/") or ".." in parts:
            raise InvalidArgumentError(f"{where}: the source must be a path inside the "
                                       "build context")
        if not dest or "\n" in dest or "\n" in src:
            raise InvalidArgumentError(f"{where}: a destination path is needed")
        if len(a) > 2 and a[2] and not USER_RE.fullmatch(a[2]):
            raise InvalidArgumentError(f"{where}: invalid user {a[2][:40]!r}")
        if len(a) > 3 and a[3] and not MODE_RE.fullmatch(a[3]):
            raise InvalidArgumentError(f"{where}: invalid mode {a[3][:8]!r}")
        if not step.files_hash or not HASH_RE.fullmatch(step.files_hash):
            raise InvalidArgumentError(f"{where}: filesHash is missing or invalid")
