"""Everything the sync and async SDK share: configuration, request building, response parsing
and error mapping. Nothing here does network I/O, so `_async/` and the generated `_sync/` stay
thin wrappers that only send what these functions build."""

from __future__ import annotations

import base64
import contextlib
import gzip
import io
import json
import os
import re
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx

from sandlot.errors import (
    AuthenticationError,
    BuildError,
    BuildStepError,
    InvalidArgumentError,
    SandboxError,
    SandlotError,
    error_from_answer,
    error_from_payload,
)

from ._errors import CommandExitError, SnapshotFailedError, WaitTimeoutError
from ._models import CommandResult, SandboxInfo, SnapshotInfo, parse_list

DEFAULT_URL = "http://127.0.0.1:7070"
# Creating and restoring sandboxes boots or loads a VM, so plain calls get a generous read timeout.
DEFAULT_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
# Extra read time on top of a command's own timeout, so the server's timeout error arrives first.
COMMAND_TIMEOUT_SLACK = 30.0
IMAGE_BUILD_TIMEOUT = 1800.0  # s: a create from an image may pull and build it first
UPLOAD_CHUNK = 1 << 20
LONG_POLL = 30.0  # s a snapshot wait request may be held by the server
READ_FORMATS = ("text", "bytes", "stream")

OutputCallback = Callable[[str], object]
UploadData = str | bytes | BinaryIO | Iterable[bytes]

monotonic = time.monotonic


# -- configuration ---------------------------------------------------------------------------


def resolve_config(api_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """Arguments win over env ``SANDLOT_URL``/``SANDLOT_API_KEY``; the URL defaults to local."""
    url = api_url or os.environ.get("SANDLOT_URL") or DEFAULT_URL
    key = api_key if api_key is not None else os.environ.get("SANDLOT_API_KEY")
    return url.rstrip("/"), key or None


def client_kwargs(api_url: str, api_key: str | None, timeout: float | httpx.Timeout | None,
                  ) -> dict[str, Any]:
    """Keyword arguments for constructing the httpx client."""
    headers = {"User-Agent": "sandlot-python"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if timeout is not None and not isinstance(timeout, httpx.Timeout):
        timeout = httpx.Timeout(timeout, connect=min(float(timeout), 10.0))
    return {"base_url": api_url, "headers": headers, "timeout": timeout or DEFAULT_TIMEOUT}


# -- requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A REST call, independent of sync or async I/O."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    timeout: httpx.Timeout | None = None  # this call's own, when the client's is too short
    headers: dict[str, str] = field(default_factory=dict)


def epoch(when: Any) -> float | None:
    """A datetime or epoch seconds as epoch seconds."""
    if when is None or isinstance(when, int | float):
        return when
    return when.timestamp()


def _seg(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"expected a non-empty id, got {value!r}")
    return quote(value, safe="")


def _sb(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{_seg(sandbox_id)}"


def _snap(name_or_id: str) -> str:
    return f"/v1/snapshots/{_seg(name_or_id)}"


def _str_dict(value: dict[str, Any] | None, what: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what} must be a dict, got {type(value).__name__}")
    return {str(k): str(v) for k, v in value.items()}


def create_sandbox(template: str | None = "base", *, snapshot_id: str | None = None,
                   memory_mb: int | None = None, cpus: int | None = None,
                   env: dict[str, str] | None = None, timeout: int | None = 300,
                   metadata: dict[str, str] | None = None, internet: bool = True,
                   network: Any = None, on_timeout: str = "kill",
                   auto_resume: bool = False, image: str | None = None,
                   pause_memory: bool = True, disk_mb: int | None = None) -> Request:
    """``POST /v1/sandboxes``; with `snapshot_id` the sandbox is restored from that snapshot;
    with `image` it starts from that OCI image (built into a template on first use, which
    may take minutes: the read timeout is IMAGE_BUILD_TIMEOUT)."""
    body = {
        "template": None if snapshot_id or image else template, "snapshot_id": snapshot_id,
        "memory_mb": memory_mb, "cpus": cpus, "env": _str_dict(env, "env") or {},
        "timeout": timeout, "metadata": _str_dict(metadata, "metadata") or {},
        "internet": internet, "network": network, "on_timeout": on_timeout,
        "auto_resume": auto_resume, "pause_memory": pause_memory,
    }
    if disk_mb is not None:
        body["disk_mb"] = disk_mb
    if image is None:
        return Request("POST", "/v1/sandboxes", json=body)
    return Request("POST", "/v1/sandboxes", json={**body, "image": image},
                   timeout=httpx.Timeout(DEFAULT_TIMEOUT.write, connect=DEFAULT_TIMEOUT.connect,
                                         read=IMAGE_BUILD_TIMEOUT))


def list_sandboxes(metadata: dict[str, str] | None = None, *, include_stopped: bool = False,
                   ) -> Request:
    params: dict[str, Any] = {}
    if metadata:
        params["metadata"] = json.dumps(_str_dict(metadata, "metadata"), sort_keys=True)
    if include_stopped:
        params["all"] = "true"
    return Request("GET", "/v1/sandboxes", params=params)


def get_sandbox(sandbox_id: str) -> Request:
    return Request("GET", _sb(sandbox_id))


def kill_sandbox(sandbox_id: str) -> Request:
    return Request("DELETE", _sb(sandbox_id))


def set_timeout(sandbox_id: str, seconds: int) -> Request:
    if seconds is None or seconds < 0:
        raise InvalidArgumentError(f"timeout must be >= 0 seconds, got {seconds!r}")
    return Request("POST", _sb(sandbox_id) + "/timeout", json={"timeout": seconds})


def sandbox_metrics(sandbox_id: str, start: float | None = None,
                    end: float | None = None) -> Request:
    params = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    return Request("GET", _sb(sandbox_id) + "/metrics", params=params)


def expose_port(sandbox_id: str, port: int) -> Request:
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an integer in 1..65535, got {port!r}")
    return Request("POST", _sb(sandbox_id) + "/ports", json={"port": port})


def set_network(sandbox_id: str, *, internet: bool | None = None,
                allow_out: list[str] | None = None, deny_out: list[str] | None = None,
                dns_servers: list[str] | None = None) -> Request:
    return Request("PUT", _sb(sandbox_id) + "/network", json={
        "internet": internet,
        "allow_out": list(allow_out) if allow_out is not None else None,
        "deny_out": list(deny_out) if deny_out is not None else None,
        "dns_servers": list(dns_servers) if dns_servers is not None else None,
    })


def fork_sandbox(sandbox_id: str, count: int) -> Request:
    if not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"count must be a positive integer, got {count!r}")
    return Request("POST", _sb(sandbox_id) + "/fork", json={"count": count})


def pause_sandbox(sandbox_id: str, memory: bool | None = None) -> Request:
    return Request("POST", _sb(sandbox_id) + "/pause",
                   json=None if memory is None else {"memory": bool(memory)})


def resume_sandbox(sandbox_id: str, timeout: int | None = None, reboot: bool = False
                   ) -> Request:
    return Request("POST", _sb(sandbox_id) + "/resume",
                   json={"timeout": timeout, "reboot": bool(reboot)})


def rollback_sandbox(sandbox_id: str, snapshot_id: str) -> Request:
    return Request("POST", _sb(sandbox_id) + "/rollback", json={"snapshot_id": snapshot_id})


def create_snapshot(sandbox_id: str, name: str | None = None, memory: bool = True
                    ) -> Request:
    return Request("POST", _sb(sandbox_id) + "/snapshots",
                   json={"name": name, "memory": bool(memory)})


def run_command(sandbox_id: str, cmd: str, *, timeout: float | None, env: dict[str, str] | None,
                cwd: str | None, user: str | None, stdin: str | bytes | None, background: bool,
                pty: tuple[int, int] | None = None) -> Request:
    if not isinstance(cmd, str) or not cmd:
        raise InvalidArgumentError("cmd must be a non-empty string")
    if isinstance(stdin, bytes):
        stdin = stdin.decode("utf-8")
    body = {"cmd": cmd, "env": _str_dict(env, "env") or {}, "cwd": cwd, "user": user,
            "timeout": timeout or None, "stdin": stdin, "background": background}
    if pty is not None:
        body["pty"] = terminal_size(*pty)
    return Request("POST", _sb(sandbox_id) + "/commands", json=body)


def terminal_size(cols: int, rows: int) -> dict[str, int]:
    for name, value in (("cols", cols), ("rows", rows)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
            raise InvalidArgumentError(f"a terminal's {name} must be an integer from 1 to "
                                       f"4096, got {value!r}")
    return {"cols": cols, "rows": rows}


def resize_terminal(sandbox_id: str, pid: int, cols: int, rows: int) -> Request:
    return Request("POST", f"{_sb(sandbox_id)}/commands/{int(pid)}/resize",
                   json=terminal_size(cols, rows))


def list_commands(sandbox_id: str) -> Request:
    return Request("GET", _sb(sandbox_id) + "/commands")


def stream_command(sandbox_id: str, pid: int) -> Request:
    return Request("GET", f"{_sb(sandbox_id)}/commands/{int(pid)}/stream")


def send_stdin(sandbox_id: str, pid: int, data: str | bytes, eof: bool = False) -> Request:
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    return Request("POST", f"{_sb(sandbox_id)}/commands/{int(pid)}/stdin",
                   json={"data": data, "eof": eof})


def kill_command(sandbox_id: str, pid: int, signal: int = 9) -> Request:
    return Request("POST", f"{_sb(sandbox_id)}/commands/{int(pid)}/kill",
                   json={"signal": int(signal)})


def _path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgumentError(f"sandbox paths must be absolute, got {path!r}")
    return path


def read_file(sandbox_id: str, path: str, fmt: str = "bytes") -> Request:
    if fmt not in READ_FORMATS:
        raise InvalidArgumentError(f"format must be one of {', '.join(READ_FORMATS)}, got {fmt!r}")
    return Request("GET", _sb(sandbox_id) + "/files", params={"path": _path(path)})


# File metadata travels as `X-Metadata-<key>` headers: keys are tokens, values printable ASCII.
_METADATA_KEY = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_METADATA_VALUE = re.compile(r"^[\x20-\x7e]*$")


def write_file(sandbox_id: str, path: str, user: str = "root",
               metadata: dict[str, str] | None = None) -> Request:
    headers = {}
    for key, value in (_str_dict(metadata, "metadata") or {}).items():
        if not _METADATA_KEY.match(key) or not _METADATA_VALUE.match(value):
            raise InvalidArgumentError(
                f"file metadata {key[:100]!r}: keys are letters, digits and !#$%&'*+-.^_`|~; "
                "values printable US-ASCII")
        headers[f"X-Metadata-{key}"] = value
    return Request("PUT", _sb(sandbox_id) + "/files", params={"path": _path(path), "user": user},
                   headers=headers)


def list_files(sandbox_id: str, path: str, depth: int = 1) -> Request:
    return Request("GET", _sb(sandbox_id) + "/files/list",
                   params={"path": _path(path), "depth": int(depth)})


def stat_file(sandbox_id: str, path: str) -> Request:
    return Request("GET", _sb(sandbox_id) + "/files/stat", params={"path": _path(path)})


def file_exists(sandbox_id: str, path: str) -> Request:
    return Request("GET", _sb(sandbox_id) + "/files/exists", params={"path": _path(path)})


def remove_file(sandbox_id: str, path: str) -> Request:
    return Request("DELETE", _sb(sandbox_id) + "/files", params={"path": _path(path)})


def make_dir(sandbox_id: str, path: str, user: str = "root") -> Request:
    return Request("POST", _sb(sandbox_id) + "/files/mkdir",
                   json={"path": _path(path), "user": user})


def rename_file(sandbox_id: str, src: str, dst: str) -> Request:
    return Request("POST", _sb(sandbox_id) + "/files/rename",
                   json={"src": _path(src), "dst": _path(dst)})


def list_snapshots(sandbox_id: str | None = None) -> Request:
    return Request("GET", "/v1/snapshots", params={"sandbox_id": sandbox_id} if sandbox_id else {})


def get_snapshot(name_or_id: str) -> Request:
    return Request("GET", _snap(name_or_id))


def rename_snapshot(name_or_id: str, name: str) -> Request:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("snapshot name must be a non-empty string")
    return Request("PATCH", _snap(name_or_id), json={"name": name})


def delete_snapshot(name_or_id: str) -> Request:
    return Request("DELETE", _snap(name_or_id))


def restore_snapshot(name_or_id: str, *, name: str | None = None, memory_mb: int | None = None,
                     cpus: int | None = None, env: dict[str, str] | None = None,
                     timeout: int | None = None, metadata: dict[str, str] | None = None,
                     internet: bool = True) -> Request:
    return Request("POST", _snap(name_or_id) + "/restore", json={
        "name": name, "memory_mb": memory_mb, "cpus": cpus, "env": _str_dict(env, "env"),
        "timeout": timeout, "metadata": _str_dict(metadata, "metadata"), "internet": internet,
    })


def fork_snapshot(name_or_id: str, count: int, *, memory_mb: int | None = None,
                  cpus: int | None = None, env: dict[str, str] | None = None,
                  timeout: int | None = None, metadata: dict[str, str] | None = None
                  ) -> Request:
    if not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"count must be a positive integer, got {count!r}")
    body = {"count": count, "memory_mb": memory_mb, "cpus": cpus, "env": _str_dict(env, "env"),
            "timeout": timeout, "metadata": _str_dict(metadata, "metadata")}
    return Request("POST", _snap(name_or_id) + "/fork",
                   json={k: v for k, v in body.items() if v is not None})


def list_templates() -> Request:
    return Request("GET", "/v1/templates")


def get_template(name: str) -> Request:
    return Request("GET", f"/v1/templates/{_seg(name)}")


def build_template(name: str, dockerfile: str, context: bytes | None, *,
                   cpus: int | None = None, memory_mb: int | None = None) -> Request:
    body: dict[str, Any] = {"dockerfile": dockerfile, "cpus": cpus, "memory_mb": memory_mb}
    if context:
        body["context"] = base64.b64encode(context).decode()
    return Request("POST", f"/v1/templates/{_seg(name)}/builds", json=body)


def template_build(name: str, build_id: str, logs_offset: int = 0) -> Request:
    return Request("GET", f"/v1/templates/{_seg(name)}/builds/{_seg(build_id)}",
                   params={"logs_offset": logs_offset})


def build_context(context: str | os.PathLike | bytes | None) -> bytes | None:
    """A build context as the bytes of a tar.gz: a folder's files (packed), or a tar's
    bytes as they are."""
    if context is None or isinstance(context, bytes | bytearray):
        return bytes(context) if context is not None else None
    folder = os.fspath(context)
    if not os.path.isdir(folder):
        raise InvalidArgumentError(f"the build context {folder!r} is not a folder")
    def same(info: tarfile.TarInfo) -> tarfile.TarInfo:  # the same files: the same bytes
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        return info

    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(folder)):
            tar.add(os.path.join(folder, entry), arcname=entry, filter=same)
    return out.getvalue()


def dockerfile_text(dockerfile: str | os.PathLike) -> str:
    """A Dockerfile's text: a path to one, or the text (a string holding a newline)."""
    if isinstance(dockerfile, str) and "\n" in dockerfile:
        return dockerfile
    with open(dockerfile, encoding="utf-8") as f:
        return f.read()


def build_failed(status: dict[str, Any]) -> SandlotError:
    """The error of a failed template build (its reason ends with the step's output)."""
    reason = status.get("reason") or "the build failed"
    if status.get("error") == "BuildStepError":
        return BuildStepError(reason)
    return BuildError(reason)


def clock() -> float:
    return time.monotonic()


def build_waited(status: dict[str, Any], started: float, timeout: float | None) -> bool:
    """Whether a wait for a build is over: raises its error if it failed, WaitTimeoutError
    past `timeout` s from `started` (time.monotonic())."""
    if status.get("status") == "ready":
        return True
    if status.get("status") == "error":
        raise build_failed(status)
    if timeout is not None and time.monotonic() - started > timeout:
        raise WaitTimeoutError(f"the build of template {status.get('name')!r} is still "
                               f"{status.get('status')} after {timeout:g} s")
    return False


def list_hosts() -> Request:
    return Request("GET", "/v1/hosts")


def set_host_state(host_id: str, action: str) -> Request:
    return Request("POST", f"/v1/hosts/{_seg(host_id)}/{action}")


def health() -> Request:
    return Request("GET", "/health")


def command_timeout(timeout: float | None) -> httpx.Timeout:
    """HTTP timeouts for a streamed command: the read timeout outlives the command's own."""
    read = None if not timeout else float(timeout) + COMMAND_TIMEOUT_SLACK
    return httpx.Timeout(DEFAULT_TIMEOUT.write, connect=DEFAULT_TIMEOUT.connect, read=read)


STREAM_TIMEOUT = httpx.Timeout(DEFAULT_TIMEOUT.write, connect=DEFAULT_TIMEOUT.connect, read=None)


# -- errors ----------------------------------------------------------------------------------


def error_from_response(status: int, content: bytes, has_key: bool = True) -> SandlotError:
    """Turn an HTTP error answer into the sandlot error it names."""
    error = error_from_answer(status, content)
    if isinstance(error, AuthenticationError) and not has_key:
        error.message += " (no API key: pass api_key= or set SANDLOT_API_KEY)"
        error.args = (error.message,)
    return error


@contextlib.contextmanager
def map_transport_errors(api_url: str) -> Iterator[None]:
    """Re-raise httpx's connection and protocol errors as `SandlotError`, keeping the cause."""
    try:
        yield
    except httpx.ConnectError as exc:
        raise SandlotError(f"cannot connect to the sandlot server at {api_url}: {exc}",
                           cause=exc) from exc
    except httpx.TimeoutException as exc:
        raise SandlotError(f"request to the sandlot server at {api_url} timed out "
                           f"({type(exc).__name__})", cause=exc) from exc
    except httpx.RequestError as exc:
        raise SandlotError(f"connection to the sandlot server at {api_url} failed: "
                           f"{type(exc).__name__}: {exc}", cause=exc) from exc
    except httpx.InvalidURL as exc:
        raise InvalidArgumentError(f"invalid sandlot URL {api_url!r}: {exc}", cause=exc) from exc


# -- responses -------------------------------------------------------------------------------


def parse_json(content: bytes) -> Any:
    if not content:
        return None
    try:
        return json.loads(content)
    except ValueError as exc:
        raise SandlotError(f"server sent invalid JSON: {content[:100]!r}", cause=exc) from exc


def parse_fork(data: Any) -> tuple[list[SandboxInfo], list[SandlotError]]:
    """Split a fork answer into the children that started and the errors of those that didn't."""
    children = parse_list(SandboxInfo, data, "sandboxes")
    errors: list[SandlotError] = []
    for item in sorted((data or {}).get("errors", []), key=lambda e: e.get("index", 0)):
        error = error_from_payload(item.get("error"))
        error.message = f"fork child {item.get('index')}: {error.message}"
        error.args = (error.message,)
        errors.append(error)
    return children, errors


def check_fork(children: list[Any], errors: list[SandlotError]) -> None:
    """A fork where every child failed raises the first error; partial failure is returned."""
    if errors and not children:
        raise errors[0]


def snapshot_done(info: SnapshotInfo) -> bool:
    """True once the snapshot is ready; raises `SnapshotFailedError` if it can never be."""
    if info.state == "ready":
        return True
    if info.state in ("failed", "deleted"):
        detail = info.error or f"snapshot is {info.state}"
        raise SnapshotFailedError(f"snapshot {info.snapshot_id} failed: {detail}",
                                  snapshot_id=info.snapshot_id)
    return False


def check_wait(info: SnapshotInfo, deadline: float | None, timeout: float | None) -> float:
    """Raise `WaitTimeoutError` past `deadline`; else how long the server may hold the next
    wait request (it answers as soon as the snapshot is done)."""
    if deadline is not None and monotonic() >= deadline:
        raise WaitTimeoutError(f"snapshot {info.snapshot_id} still {info.state} after {timeout}s")
    if deadline is None:
        return LONG_POLL
    return max(0.0, min(LONG_POLL, deadline - monotonic()))


def wait_snapshot(name_or_id: str, seconds: float) -> Request:
    """``POST /v1/snapshots/{id}/wait``: answers when the snapshot is done, or after `seconds`."""
    return Request("POST", _snap(name_or_id) + "/wait", params={"timeout": round(seconds, 3)})


def wait_deadline(timeout: float | None) -> float | None:
    return None if timeout is None else monotonic() + timeout


def snapshot_ref(snapshot: Any) -> str:
    """Accept a snapshot object, a `SnapshotInfo`, or an id or name."""
    ref = getattr(snapshot, "snapshot_id", snapshot)
    if not isinstance(ref, str) or not ref:
        raise InvalidArgumentError(f"expected a snapshot, snapshot id or name, got {snapshot!r}")
    return ref


def check_restore_source(info: SnapshotInfo, sandbox_id: str | None) -> None:
    """Reject a restore whose snapshot does not come from `sandbox_id` (when one is given)."""
    if sandbox_id is not None and info.sandbox_id is not None and info.sandbox_id != sandbox_id:
        raise InvalidArgumentError(
            f"snapshot {info.snapshot_id} was taken from {info.sandbox_id}, not {sandbox_id}")


class CommandStream:
    """Folds the NDJSON events of a command into a `CommandResult`, calling the output
    callbacks with each chunk as it is fed."""

    def __init__(self, cmd: str = "", on_stdout: OutputCallback | None = None,
                 on_stderr: OutputCallback | None = None, check: bool = False) -> None:
        self.cmd = cmd
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.check = check
        self.pid: int | None = None
        self.exit_code: int | None = None
        self.error: SandlotError | None = None
        self._stdout: list[str] = []
        self._stderr: list[str] = []

    def feed(self, line: str) -> None:
        """Handle one NDJSON line."""
        line = line.strip()
        if not line:
            return
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise SandlotError(f"server sent a bad command event: {line[:100]!r}",
                               cause=exc) from exc
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "start":
            self.pid = event.get("pid")
        elif kind == "stdout":
            data = str(event.get("data", ""))
            self._stdout.append(data)
            if self.on_stdout is not None:
                self.on_stdout(data)
        elif kind == "stderr":
            data = str(event.get("data", ""))
            self._stderr.append(data)
            if self.on_stderr is not None:
                self.on_stderr(data)
        elif kind == "exit":
            self.exit_code = int(event.get("exit_code", -1))
        elif kind == "error":
            self.error = error_from_payload(event.get("error"))

    def result(self) -> CommandResult:
        """The finished result; raises the stream's error, or `CommandExitError` if checking."""
        if self.error is not None:
            raise self.error
        if self.exit_code is None:
            raise SandboxError("command output ended without an exit code")
        result = CommandResult("".join(self._stdout), "".join(self._stderr), self.exit_code)
        if self.check and not result.ok:
            raise CommandExitError(result, self.cmd)
        return result


def background_pid(data: Any) -> int:
    if not isinstance(data, dict) or not isinstance(data.get("pid"), int):
        raise SandlotError(f"server answered a background command without a pid: {data!r}")
    return data["pid"]


def decode_file(content: bytes, fmt: str) -> str | bytes:
    return content.decode("utf-8") if fmt == "text" else content


# -- uploads ---------------------------------------------------------------------------------


def _read_chunks(fileobj: BinaryIO) -> Iterator[bytes]:
    while True:
        chunk = fileobj.read(UPLOAD_CHUNK)
        if not chunk:
            return
        if isinstance(chunk, str):
            raise InvalidArgumentError("file objects must be opened in binary mode")
        yield chunk


def _iter_chunks(data: Iterable[bytes]) -> Iterator[bytes]:
    for chunk in data:
        if isinstance(chunk, str):
            chunk = chunk.encode("utf-8")
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise InvalidArgumentError(f"upload chunks must be bytes, got {type(chunk).__name__}")
        yield bytes(chunk)


def upload_content(data: UploadData) -> bytes | Iterator[bytes]:
    """Request content for an upload: small in-memory data as is, anything else as a generator
    of chunks so large files are never held whole in memory."""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(data)  # type: ignore[arg-type]
    if isinstance(data, Iterable):
        return _iter_chunks(data)
    raise InvalidArgumentError(
        f"cannot upload {type(data).__name__}: pass str, bytes, a binary file or bytes chunks")


async def _aiter_chunks(data: Any) -> AsyncIterator[bytes]:
    async for chunk in data:
        for piece in _iter_chunks([chunk]):
            yield piece


async def _sync_to_async(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    # Local file reads block briefly per 1 MiB chunk; that is acceptable on the event loop.
    for chunk in chunks:
        yield chunk


def aupload_content(data: UploadData | AsyncIterator[bytes]) -> bytes | AsyncIterator[bytes]:
    """Async twin of `upload_content`: also accepts async iterators of bytes."""
    if hasattr(data, "__aiter__"):
        return _aiter_chunks(data)
    content = upload_content(data)  # type: ignore[arg-type]
    return content if isinstance(content, bytes) else _sync_to_async(content)
