"""Inputs checked at the edge: sizes within `config.Limits`, no NUL bytes, env names a shell
accepts. Everything a caller sends that reaches a guest or a record passes here first, so a
request that the guest agent could not carry (its frames are capped, guest/wire.py) or that
would make every later answer huge (metadata in lists) is refused with a 400 and a message,
before a VM is touched.
"""

from __future__ import annotations

import ipaddress
import json
import re

from sandlot.config import Limits
from sandlot.errors import InvalidArgumentError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _no_nul(what: str, text: str) -> None:
    if "\0" in text:
        raise InvalidArgumentError(f"{what} must not contain a NUL byte")


def check_text(what: str, text: str, limit: int) -> None:
    """A string sent to the guest: no NUL byte, at most `limit` bytes (UTF-8)."""
    _no_nul(what, text)
    if _size(text) > limit:
        raise InvalidArgumentError(f"{what} is {_size(text)} bytes; the limit is {limit}")


def check_disk(limits: Limits, disk_mb: int | None) -> None:
    """A sandbox's disk (its quota) within the server's SANDLOT_MAX_DISK_MB."""
    if disk_mb is not None and disk_mb > limits.disk_mb:
        raise InvalidArgumentError(f"disk_mb is {disk_mb}; the limit is {limits.disk_mb} MiB "
                                   "(SANDLOT_MAX_DISK_MB)")


def check_env(limits: Limits, env: dict[str, str] | None, what: str = "env") -> None:
    """Names a shell accepts (letters, digits, _; not starting with a digit), values with no
    NUL byte, and the whole map within its limits: its size is counted as the agent is sent
    it (JSON, where a control character takes six bytes)."""
    if not env:
        return
    if len(env) > limits.env_keys:
        raise InvalidArgumentError(f"{what} has {len(env)} variables; the limit is "
                                   f"{limits.env_keys}")
    total = 0
    for key, value in env.items():
        if not ENV_NAME.match(key):
            raise InvalidArgumentError(
                f"{what}: {key[:64]!r} is not a valid variable name (letters, digits and _, "
                "not starting with a digit)")
        check_text(f"{what}[{key}]", value, limits.env_value_bytes)
        total += len(key) + len(json.dumps(value)) + 4
    if total > limits.env_bytes:
        raise InvalidArgumentError(f"{what} is {total} bytes; the limit is {limits.env_bytes}")


def check_metadata(limits: Limits, metadata: dict[str, str] | None) -> None:
    """Metadata is returned by every list: its count and sizes are bounded."""
    if not metadata:
        return
    if len(metadata) > limits.metadata_keys:
        raise InvalidArgumentError(f"metadata has {len(metadata)} keys; the limit is "
                                   f"{limits.metadata_keys}")
    total = 0
    for key, value in metadata.items():
        if not key:
            raise InvalidArgumentError("metadata keys must not be empty")
        check_text("a metadata key", key, limits.metadata_key_bytes)
        check_text(f"metadata[{key}]", value, limits.metadata_value_bytes)
        total += _size(key) + _size(value)
    if total > limits.metadata_bytes:
        raise InvalidArgumentError(f"metadata is {total} bytes; the limit is "
                                   f"{limits.metadata_bytes}")


# What an HTTP header carries (E2B sends file metadata as `X-Metadata-<key>` headers): keys
# are tokens, values printable US-ASCII.
_FILE_METADATA_KEY = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_FILE_METADATA_VALUE = re.compile(r"^[\x20-\x7e]*$")


def check_file_metadata(limits: Limits, metadata: dict[str, str] | None) -> None:
    """A file's user metadata (kept as `user.e2b.<key>` extended attributes in the guest)."""
    check_metadata(limits, metadata)
    for key, value in (metadata or {}).items():
        if not _FILE_METADATA_KEY.match(key):
            raise InvalidArgumentError(f"file metadata key {key[:100]!r}: use letters, digits "
                                       "and !#$%&'*+-.^_`|~ only")
        if not _FILE_METADATA_VALUE.match(value):
            raise InvalidArgumentError(f"file metadata value of {key!r}: printable US-ASCII "
                                       "only")


MAX_DNS_SERVERS = 10  # E2B's


def check_egress(limits: Limits, allow_out: list[str], deny_out: list[str],
                 dns_servers: list[str] | None = None) -> None:
    count = len(allow_out) + len(deny_out)
    if count > limits.egress_rules:
        raise InvalidArgumentError(f"{count} egress rules; the limit is {limits.egress_rules}")
    for rule in (*allow_out, *deny_out):
        check_text("an egress rule", rule, 256)
    if dns_servers is None:
        return
    if len(dns_servers) > MAX_DNS_SERVERS:
        raise InvalidArgumentError(f"{len(dns_servers)} dns_servers; at most "
                                   f"{MAX_DNS_SERVERS}")
    for server in dns_servers:
        try:
            ipaddress.IPv4Address(server)
        except ValueError:
            raise InvalidArgumentError(f"dns_servers: {str(server)[:64]!r} is not an IPv4 "
                                       "address") from None


def check_path(limits: Limits, path: str, what: str = "path") -> None:
    """An absolute guest path with no NUL byte, within the path limit."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgumentError(f"{what} must be absolute, got {str(path)[:200]!r}")
    check_text(what, path, limits.path_bytes)


def check_user(user: str | None) -> None:
    if user is not None:
        check_text("user", user, 256)
        if not user:
            raise InvalidArgumentError("user must not be empty")


def check_command(limits: Limits, cmd: str, env: dict[str, str] | None, cwd: str | None,
                  user: str | None, stdin: str | bytes | None) -> None:
    """What a command sends to the guest."""
    check_text("cmd", cmd, limits.command_bytes)
    check_env(limits, env)
    if cwd is not None:
        check_path(limits, cwd, "cwd")
    check_user(user)
    if stdin is not None:
        check_stdin(limits, stdin)


def check_stdin(limits: Limits, data: str | bytes) -> None:
    size = len(data) if isinstance(data, bytes) else _size(data)
    if size > limits.stdin_bytes:
        raise InvalidArgumentError(
            f"stdin is {size} bytes; the limit is {limits.stdin_bytes} per request (start the "
            "command in the background and send its input in several stdin writes)")
