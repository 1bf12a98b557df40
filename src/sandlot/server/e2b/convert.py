"""Translation between sandlot's records and E2B's JSON shapes, users and paths."""

from __future__ import annotations

import base64
import binascii
import posixpath
import stat as statmod
from datetime import UTC, datetime, timedelta

from sandlot.core.models import FileInfo, SandboxRecord
from sandlot.errors import AuthenticationError, InvalidArgumentError

# The envd version sandlot reports: every feature the SDKs gate on at or below it is served
# (stdin, default user, close stdin, octet-stream upload, recursive watch, file metadata,
# entries in watch events, and watching with network mounts allowed: a sandbox has none).
ENVD_VERSION = "0.6.4"
CLIENT_ID = "sandlot"
DEFAULT_USER = "user"
# When a sandbox has no timeout, E2B's endAt still needs a time.
NO_END = timedelta(days=365 * 100)
# Why: Basic credentials come from API clients; a user name longer than this is not one.
MAX_USER = 64

FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
              "symlink": "FILE_TYPE_SYMLINK"}
TYPE_BITS = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}


def rfc3339(t: datetime | float) -> str:
    if not isinstance(t, datetime):
        t = datetime.fromtimestamp(t, UTC)
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


# ---- users and paths --------------------------------------------------------------------


def user_of(headers) -> str:
    """The user an envd call runs as: ``Authorization: Basic base64("<user>:")``, else 'user'."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() != "basic" or not value.strip():
        return DEFAULT_USER
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise AuthenticationError("malformed Basic authorization header") from None
    return check_user(user) if user else DEFAULT_USER


def check_user(user: str) -> str:
    if len(user) > MAX_USER or not all(c.isalnum() or c in "._-" for c in user):
        raise InvalidArgumentError(f"invalid user name {user[:MAX_USER]!r}")
    return user


def home_of(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def resolve(path: str | None, user: str) -> str:
    """E2B's path rules: '~' is the user's home, and relative paths start there."""
    home = home_of(user)
    if not path:
        return home
    if "\0" in path:
        raise InvalidArgumentError("paths may not contain NUL bytes")
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    elif not path.startswith("/"):
        path = posixpath.join(home, path)
    path = posixpath.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path


# ---- filesystem entries -----------------------------------------------------------------


def permissions(kind: str, mode: int) -> str:
    """Go's ``FileMode.String()``, which envd reports: e.g. ``drwxr-xr-x``, ``Lrwxrwxrwx``."""
    text = statmod.filemode(TYPE_BITS.get(kind, 0) | (mode & 0o7777))
    if kind == "symlink":
        text = "L" + text[1:]
    elif kind not in TYPE_BITS:
        text = "?" + text[1:]
    return text


def entry_info(entry: FileInfo, link: tuple[str, FileInfo | None] | None = None) -> dict:
    """A sandbox file entry as envd's ``filesystem.EntryInfo``. For a symlink, `link` is what
    it resolves to (the absolute path, and that entry or None when the link is broken): envd
    reports the type and mode of what the link points to and that path as its target (the
    link's own path, and an unspecified type, when it is broken)."""
    kind, mode = entry.type, entry.mode & 0o777
    if entry.type == "symlink" and link is not None:
        resolved, target = link
        kind = target.type if target is not None else "unknown"
        mode = target.mode & 0o777 if target is not None else 0
    out = {
        "name": entry.name,
        "type": FILE_TYPES.get(kind, "FILE_TYPE_UNSPECIFIED"),
        "path": entry.path,
        "size": str(entry.size),
        "mode": mode,
        "permissions": permissions(entry.type, entry.mode),
        "owner": entry.owner,
        # The agent reports no group; sandlot's guest users each have a group of their name.
        "group": entry.owner,
        "modifiedTime": rfc3339(entry.mtime),
    }
    if entry.type == "symlink":
        target_path = link[0] if link is not None else entry.target
        if target_path is not None:
            out["symlinkTarget"] = target_path
    if entry.metadata:
        out["metadata"] = entry.metadata
    return out


def write_info(path: str, entry: FileInfo | None = None) -> dict:
    """An upload's answer; its metadata as read back from the written file."""
    out = {"name": posixpath.basename(path), "type": "file", "path": path}
    if entry is not None and entry.metadata:
        out["metadata"] = entry.metadata
    return out


# ---- sandboxes ---------------------------------------------------------------------------


def template_id(rec: SandboxRecord) -> str:
    """The sandlot template the sandbox descends from (also when restored from a snapshot)."""
    return rec.template or rec.snapshot_id or ""


def created(rec: SandboxRecord, token: str) -> dict:
    """E2B's ``Sandbox``: the answer to create, connect, resume and fork."""
    return {
        "templateID": template_id(rec),
        "sandboxID": rec.sandbox_id,
        "alias": rec.template or template_id(rec),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "domain": None,
    }


def _end_at(rec: SandboxRecord) -> datetime:
    return rec.expires_at or (rec.created_at + NO_END)


def listed(rec: SandboxRecord, state: str, disk_mb: int) -> dict:
    """E2B's ``ListedSandbox``; `state` is 'running' or 'paused'."""
    return {
        "templateID": template_id(rec),
        "alias": rec.template or template_id(rec),
        "sandboxID": rec.sandbox_id,
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(rec.created_at),
        "endAt": rfc3339(_end_at(rec)),
        "cpuCount": rec.cpus,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": disk_mb,
        "metadata": rec.metadata,
        "state": state,
        "envdVersion": ENVD_VERSION,
        "volumeMounts": [{"name": m.name, "path": m.path} for m in rec.volume_mounts],
    }


def detail(rec: SandboxRecord, state: str, disk_mb: int, token: str) -> dict:
    """E2B's ``SandboxDetail``."""
    out = listed(rec, state, disk_mb) | {
        "envdAccessToken": token,
        "allowInternetAccess": rec.internet,
        "domain": None,
        "lifecycle": {"onTimeout": rec.on_timeout, "autoResume": rec.auto_resume},
    }
    if rec.network is not None:
        out["network"] = {"allowOut": rec.network.allow_out, "denyOut": rec.network.deny_out}
        if rec.network.dns_servers is not None:
            out["network"]["dnsServers"] = rec.network.dns_servers
    return out


def snapshot_name(name: str) -> str:
    """An E2B snapshot name (`[namespace/]name[:tag]`) as sandlot keeps it: sandlot has one
    namespace, so a namespace prefix is dropped; names are case-insensitive."""
    return name.rpartition("/")[2].lower()


def name_matches(wanted: str, name: str | None, snapshot_id: str) -> bool:
    """E2B's snapshot filter: an id, or a name (a name without a tag matches every tag)."""
    if wanted == snapshot_id:
        return True
    if not name:
        return False
    wanted = snapshot_name(wanted)
    return wanted == name or (":" not in wanted and name.partition(":")[0] == wanted)


def snapshot_info(snapshot_id: str, name: str | None) -> dict:
    return {"snapshotID": snapshot_id, "names": [name] if name else []}


def metric(m) -> dict:
    """A `core.usage.SandboxMetric` in E2B's SandboxMetric shape."""
    return {"timestamp": datetime.fromtimestamp(m.timestamp, UTC).isoformat(),
            "timestampUnix": int(m.timestamp), "cpuCount": m.cpu_count,
            "cpuUsedPct": m.cpu_used_pct, "memUsed": m.mem_used, "memTotal": m.mem_total,
            "memCache": 0, "diskUsed": m.disk_used, "diskTotal": m.disk_total}
