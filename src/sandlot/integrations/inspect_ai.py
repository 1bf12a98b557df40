"""sandlot as an Inspect AI sandbox provider: ``--sandbox sandlot`` (docs/integrations.md).

`task_init` prepares the task's environment once (a template or an OCI image, an optional
setup command) and snapshots it, memory included; every sample is a restore of that snapshot,
so it starts with the setup's files and processes in the time of a restore. `fork` gives a
solver copies of a sample's sandbox as it is now (best-of-n, tree search).

Thin over the public SDK (`AsyncSandlot`). Inspect is imported by this module only (Inspect
loads it through its ``inspect_ai`` entry point), so `sandlot` itself never needs it. The
server is ``SANDLOT_URL``/``SANDLOT_API_KEY`` (or the config's `api_url`); the key is never
part of the config, which Inspect writes into its logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import posixpath
import re
import secrets
import shlex
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    sandboxenv,
)
from pydantic import BaseModel, ConfigDict

from sandlot import AsyncSandbox, AsyncSandlot
from sandlot.errors import (
    CommandTimeoutError,
    HostUnavailableError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    PermissionDeniedError,
    SandlotError,
)

log = logging.getLogger(__name__)

TAG = "inspect_ai"  # metadata key of every sandbox this provider starts (cli_cleanup finds them)
SNAPSHOT_PREFIX = "inspect-"  # the names of the task snapshots
DOCKERFILE_PREFIX = "inspect-"  # the templates built of tasks' Dockerfiles
INLINE_STDIN = 256 * 1024  # bytes of stdin sent with the command; more goes through a file
INLINE_COMMAND = 64 * 1024  # bytes of command line sent as is; more goes through a file
SPILL_DIR = "/tmp"


class SandlotConfig(BaseModel):
    """``sandbox=("sandlot", SandlotConfig(...))``, or the same keys in a JSON/YAML file.

    `template` (or `image`, an OCI reference, or `dockerfile`, a one-stage Dockerfile built
    by the server into a template once, its COPYs from `context`, default the Dockerfile's
    folder; relative paths from the task's folder) is what the task starts from; `setup` a shell
    command run once, as root, before the task's snapshot (with `snapshot=False` it runs for
    every sample instead: no snapshot). `user`/`workdir`: who `exec` runs as and where
    relative paths resolve (default: the template's). `timeout`: each sandbox's lifetime (s).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    template: str = "base"
    image: str | None = None
    dockerfile: str | None = None
    context: str | None = None
    setup: str | None = None
    setup_timeout: int = 1800
    snapshot: bool = True
    user: str | None = None
    workdir: str | None = None
    env: dict[str, str] = {}
    memory_mb: int | None = None
    cpus: int | None = None
    internet: bool = True
    timeout: int = 4 * 3600
    api_url: str | None = None

    def __hash__(self) -> int:  # Inspect keys its sandbox caches by config (env is a dict)
        return hash(self.model_dump_json())


def load_config(config: SandboxEnvironmentConfigType | None) -> SandlotConfig:
    """The `SandlotConfig` of Inspect's `config`: None, a model, a ``.json``/``.yaml`` file,
    or a template name."""
    if config is None:
        return SandlotConfig()
    if isinstance(config, SandlotConfig):
        return config
    if isinstance(config, BaseModel):
        return SandlotConfig.model_validate(config.model_dump())
    if isinstance(config, str) and config.endswith((".json", ".yaml", ".yml")):
        text = Path(config).read_text()
        if config.endswith(".json"):
            return SandlotConfig.model_validate(json.loads(text))
        import yaml  # Inspect depends on PyYAML

        return SandlotConfig.model_validate(yaml.safe_load(text) or {})
    if isinstance(config, str) and _names_dockerfile(config):
        return SandlotConfig(dockerfile=config)
    if isinstance(config, str):
        return SandlotConfig(template=config)
    raise TypeError(f"sandlot: unsupported sandbox config {config!r}")


def _names_dockerfile(config: str) -> bool:
    """Whether a config string names a Dockerfile (``Dockerfile``, ``x.Dockerfile``,
    ``Dockerfile.x``), as Inspect's docker provider takes one."""
    name = posixpath.basename(config.replace("\\", "/")).lower()
    return name.endswith("dockerfile") or name.startswith("dockerfile.")


def _context_hash(dockerfile: Path, context: Path) -> str:
    """A hash of a Dockerfile and its context's files (paths, modes and contents)."""
    h = hashlib.sha256(dockerfile.read_bytes())
    for path in sorted(context.rglob("*")):
        if path.is_file() and not path.is_symlink():
            h.update(b"\0" + str(path.relative_to(context)).encode() + b"\0")
            h.update(str(path.stat().st_mode & 0o777).encode() + b"\0")
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:20]


async def _dockerfile_template(client: AsyncSandlot, cfg: SandlotConfig) -> str:
    """The template of the config's Dockerfile: `inspect-<hash>` of it and its context,
    built by the server (once: an unchanged build is served from its cache)."""
    if cfg.image:
        raise ValueError("sandlot: give `dockerfile` or `image`, not both")
    dockerfile = Path(cfg.dockerfile or "").resolve()
    if not dockerfile.is_file():
        raise FileNotFoundError(errno.ENOENT, "sandlot: no such Dockerfile", str(dockerfile))
    context = Path(cfg.context).resolve() if cfg.context else dockerfile.parent
    name = f"{DOCKERFILE_PREFIX}{_context_hash(dockerfile, context)}"
    for attempt in (name, f"{name}-{_tenant_suffix()}"):
        # always a build request: the server serves an unchanged one from its cache, and
        # rebuilds a template whose snapshot is gone
        log.info("sandlot: building %s from %s", attempt, dockerfile)
        try:
            await client.templates.build(attempt, dockerfile=str(dockerfile),
                                         context=str(context), timeout=cfg.setup_timeout + 600,
                                         cpus=cfg.cpus, memory_mb=cfg.memory_mb)
            return attempt
        except PermissionDeniedError:
            continue  # another tenant built the same files under this name
    raise PermissionDeniedError(f"sandlot: cannot build template {name!r} (not yours)")


def _tenant_suffix() -> str:
    """A name part of this key's own (not the key: a hash of it)."""
    key = os.environ.get("SANDLOT_API_KEY", "")
    return hashlib.sha256(b"sandlot-inspect " + key.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class _Prepared:
    """What `task_init` made: the snapshot samples restore (None: samples set up their own)
    and the default user and working directory."""

    snapshot_id: str | None
    workdir: str
    user: str
    template: str  # what samples without a snapshot start from


# Prepared environments by config: Inspect calls `task_init("startup", config)` and
# `task_cleanup("shutdown", config)`, and `sample_init` with the task's own name, so only the
# config names an environment (tasks with one config share it).
_TASKS: dict[str, _Prepared] = {}
_LOCKS: dict[str, asyncio.Lock] = {}


def _task_key(cfg: SandlotConfig) -> str:
    return cfg.model_dump_json()


def _tags(task_name: str | None, role: str) -> dict[str, str]:
    tags = {TAG: role}
    if task_name:
        tags["inspect_task"] = task_name[:200]
    return tags


def _snapshot_name(cfg: SandlotConfig) -> str:
    source = cfg.image or cfg.template
    slug = re.sub(r"[^a-z0-9._-]+", "-", source.lower()).strip("-._")[:40]
    return f"{SNAPSHOT_PREFIX}{slug or 'task'}-{secrets.token_hex(4)}"


async def _create(client: AsyncSandlot, cfg: SandlotConfig, task_name: str | None, role: str,
                  timeout: int) -> tuple[AsyncSandbox, str, str]:
    """A sandbox from the config's template or image, set up: (sandbox, workdir, user)."""
    sbx = await client.sandboxes.create(
        cfg.template, image=cfg.image, memory_mb=cfg.memory_mb, cpus=cfg.cpus, env=cfg.env,
        timeout=timeout, metadata=_tags(task_name, role), internet=cfg.internet)
    try:
        if cfg.workdir:
            await sbx.files.make_dir(cfg.workdir, user=cfg.user or "root")
        if cfg.setup:
            result = await sbx.commands.run(cfg.setup, timeout=cfg.setup_timeout, user="root",
                                            cwd=cfg.workdir)
            if not result.ok:
                tail = (result.stderr or result.stdout).strip()[-2000:]
                raise RuntimeError(
                    f"sandlot: the setup command exited with {result.exit_code}: {tail}")
        probe = await sbx.commands.run('printf "%s\\n" "$PWD"; id -un', user=cfg.user,
                                       cwd=cfg.workdir, timeout=60)
        lines = probe.stdout.splitlines()
        workdir = cfg.workdir or (lines[0] if lines and lines[0].startswith("/") else "/")
        user = cfg.user or (lines[1].strip() if len(lines) > 1 and probe.ok else "root")
    except BaseException:
        with contextlib.suppress(Exception):
            await sbx.kill()
        raise
    return sbx, workdir, user


async def _prepare(cfg: SandlotConfig) -> _Prepared:
    """The config's environment, made once (by `task_init`, or the first sample's init)."""
    key = _task_key(cfg)
    lock = _LOCKS.setdefault(key, asyncio.Lock())
    async with lock:
        if key in _TASKS:
            return _TASKS[key]
        # without a snapshot every sample runs the setup itself: this sandbox only finds the
        # workdir and user
        probe_cfg = cfg if cfg.snapshot else cfg.model_copy(update={"setup": None})
        async with AsyncSandlot(cfg.api_url) as client:
            if cfg.dockerfile:
                probe_cfg = probe_cfg.model_copy(update={
                    "template": await _dockerfile_template(client, cfg), "dockerfile": None})
            sbx, workdir, user = await _create(client, probe_cfg, None, "setup",
                                               cfg.setup_timeout + 600)
            try:
                snapshot_id = None
                if cfg.snapshot:
                    snap = await sbx.create_snapshot(_snapshot_name(probe_cfg))
                    await snap.wait(timeout=900)
                    snapshot_id = snap.snapshot_id
            finally:
                with contextlib.suppress(Exception):
                    await sbx.kill()
        _TASKS[key] = prepared = _Prepared(snapshot_id, workdir, user, probe_cfg.template)
        return prepared


class _Tail:
    """The last `limit` bytes (UTF-8) of a stream of text chunks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: deque[str] = deque()
        self.size = 0

    def add(self, text: str) -> None:
        self.chunks.append(text)
        self.size += len(text.encode())
        while self.size > self.limit and self.chunks:
            head = self.chunks[0].encode()
            excess = self.size - self.limit
            if len(head) <= excess:
                self.chunks.popleft()
                self.size -= len(head)
            else:
                kept = head[excess:].decode(errors="ignore")  # never half a character
                self.chunks[0] = kept
                self.size -= len(head) - len(kept.encode())

    def text(self) -> str:
        return "".join(self.chunks)


def _os_error(exc: SandlotError, file: str) -> Exception:
    """The Python error Inspect expects for a failed file operation on `file`."""
    message = str(exc).lower()
    if isinstance(exc, NotFoundError) and "sandbox" not in message or "no such file" in message:
        return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
    if "is a directory" in message:
        return IsADirectoryError(errno.EISDIR, "Is a directory", file)
    if "not a directory" in message:
        return NotADirectoryError(errno.ENOTDIR, "Not a directory", file)
    if "permission denied" in message or "read-only" in message:
        return PermissionError(errno.EACCES, "Permission denied", file)
    return _unavailable(exc) or exc


def _unavailable(exc: SandlotError) -> Exception | None:
    """`SandboxUnavailableError` if `exc` says the sandbox itself is gone or unreachable."""
    gone = isinstance(exc, InvalidStateError | HostUnavailableError) or (
        isinstance(exc, NotFoundError) and "sandbox" in str(exc).lower())
    return SandboxUnavailableError(f"sandlot: {exc}") if gone else None


@sandboxenv(name="sandlot")
class SandlotSandboxEnvironment(SandboxEnvironment):
    """One sample's sandlot sandbox (`sandlot` is the SDK's `AsyncSandbox`, for anything
    beyond Inspect's interface: snapshots, ports, metrics)."""

    def __init__(self, sandbox: AsyncSandbox, client: AsyncSandlot | None, workdir: str,
                 user: str, api_url: str | None = None) -> None:
        super().__init__()
        self._api_url = api_url
        self.sandlot = sandbox
        self._client = client  # None for fork children: they share their parent's
        self._workdir = workdir
        self._user = user
        self._children: list[SandlotSandboxEnvironment] = []

    def __repr__(self) -> str:
        return f"SandlotSandboxEnvironment({self.sandlot.sandbox_id!r})"

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SandlotConfig.model_validate(config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None
                        ) -> None:
        await _prepare(load_config(config))

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        cfg = load_config(config)
        prepared = await _prepare(cfg)
        client = AsyncSandlot(cfg.api_url)
        try:
            if prepared.snapshot_id is not None:
                sbx = await client.sandboxes.create(
                    snapshot_id=prepared.snapshot_id, timeout=cfg.timeout,
                    metadata=_tags(task_name, "sample"), internet=cfg.internet)
            else:
                cfg = cfg.model_copy(update={"template": prepared.template, "dockerfile": None})
                sbx, _, _ = await _create(client, cfg, task_name, "sample", cfg.timeout)
        except BaseException:
            await client.aclose()
            raise
        return {"default": cls(sbx, client, prepared.workdir, prepared.user, cfg.api_url)}

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool
                             ) -> None:
        for env in environments.values():
            if isinstance(env, SandlotSandboxEnvironment):
                await env.close()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                           cleanup: bool) -> None:
        cfg = load_config(config)
        prepared = _TASKS.pop(_task_key(cfg), None)
        _LOCKS.pop(_task_key(cfg), None)
        if cleanup and prepared is not None and prepared.snapshot_id is not None:
            async with AsyncSandlot(cfg.api_url) as client:
                await client.snapshots.delete(prepared.snapshot_id)

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup sandlot [ID]``: kill sandbox `ID`, or every sandbox this
        provider started and delete its task snapshots."""
        async with AsyncSandlot() as client:
            if id is not None:
                await client.sandboxes.kill(id)
                return
            killed = 0
            for role in ("setup", "sample"):
                for info in await client.sandboxes.list({TAG: role}):
                    killed += await client.sandboxes.kill(info.sandbox_id)
            # the task snapshots: taken of this provider's setup sandboxes (a user's own
            # snapshot named alike stays)
            setups = {info.sandbox_id for info in await client.sandboxes.list(
                {TAG: "setup"}, include_stopped=True)}
            deleted = 0
            for snap in await client.snapshots.list():
                if snap.sandbox_id in setups and (snap.name or "").startswith(SNAPSHOT_PREFIX):
                    deleted += await client.snapshots.delete(snap.snapshot_id)
        print(f"sandlot: killed {killed} sandboxes, deleted {deleted} snapshots")

    async def close(self) -> None:
        """Kill this sandbox and its fork children (sample cleanup does this)."""
        for child in self._children:
            await child.close()
        self._children.clear()
        try:
            await self.sandlot.kill()
        except SandlotError as exc:
            log.warning("sandlot: could not kill %s: %s", self.sandlot.sandbox_id, exc)
        finally:
            if self._client is not None:
                await self._client.aclose()

    # -- fork --------------------------------------------------------------------------------

    async def fork(self, n: int = 1) -> list[SandlotSandboxEnvironment]:
        """`n` new sandboxes, each a copy of this one as it is now (memory, processes, files).

        They live until the sample's cleanup (or `close`)."""
        children = await self.sandlot.fork(n)
        envs = [SandlotSandboxEnvironment(child, None, self._workdir, self._user,
                                          self._api_url)
                for child in children]
        self._children.extend(envs)
        for exc in children.errors:
            log.warning("sandlot: a fork child of %s did not start: %s",
                        self.sandlot.sandbox_id, exc)
        return envs

    # -- exec --------------------------------------------------------------------------------

    async def exec(self, cmd: list[str], input: str | bytes | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None,
                   user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        if not cmd:
            raise ValueError("exec: cmd must not be empty")
        user = user or self._user
        script = shlex.join(cmd)
        run_cwd: str | None = self._path(cwd) if cwd is not None else self._workdir
        spilled: list[str] = []
        stdout = _Tail(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE)
        stderr = _Tail(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE)
        try:
            if len(script.encode()) > INLINE_COMMAND:
                path = await self._spill(script.encode() + b"\n", user)
                spilled.append(path)
                script = f"/bin/sh {shlex.quote(path)}"
            stdin = None
            if input is not None:
                stdin, path = await self._stdin(input, user)
                if path is not None:
                    spilled.append(path)
                    script = f"{script} < {shlex.quote(path)}"
            if user != self._user and cwd is None:
                # the working directory may be closed to this user (/root): start in it if
                # they may enter it, else in their home
                script = f"cd -- {shlex.quote(self._workdir)} 2>/dev/null; {script}"
                run_cwd = None
            result = await self.sandlot.commands.run(
                script, timeout=timeout or None, env=env, cwd=run_cwd, user=user, stdin=stdin,
                on_stdout=stdout.add, on_stderr=stderr.add)
        except CommandTimeoutError as exc:
            error = TimeoutError(f"Command timed out after {timeout} seconds")
            if partial := stdout.text() + stderr.text():
                error.truncated_output = partial  # type: ignore[attr-defined]
            raise error from exc
        except InvalidArgumentError as exc:
            if re.search(r"no such user|cwd|not a directory", str(exc)):
                return ExecResult(False, 126, "", f"{exc}\n")
            raise ValueError(f"sandlot: {exc}") from exc
        except SandlotError as exc:
            raise _unavailable(exc) or exc from exc
        finally:
            for path in spilled:
                with contextlib.suppress(Exception):
                    await self.sandlot.files.remove(path)
        code = result.exit_code if result.exit_code >= 0 else 128 - result.exit_code
        out, err = stdout.text(), stderr.text()
        lines = err.strip().splitlines()
        if (code == 126 and not out.strip() and len(lines) == 1
                and lines[0].lower().endswith(f"{cmd[0]}: permission denied".lower())):
            raise PermissionError(errno.EACCES, "Permission denied executing command", cmd[0])
        return ExecResult(code == 0, code, out, err)

    async def _spill(self, data: bytes, user: str) -> str:
        """Write `data` to a new file the command reads (removed after it)."""
        path = f"{SPILL_DIR}/.sandlot-inspect-{secrets.token_hex(8)}"
        await self.sandlot.files.write(path, data, user=user)
        return path

    async def _stdin(self, data: str | bytes, user: str) -> tuple[str | None, str | None]:
        """(text sent with the command, or the path of a file holding the bytes)."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if len(raw) <= INLINE_STDIN and b"\0" not in raw:
            with contextlib.suppress(UnicodeDecodeError):
                return raw.decode("utf-8"), None
        return None, await self._spill(raw, user)

    # -- files -------------------------------------------------------------------------------

    def _path(self, file: str) -> str:
        return posixpath.join(self._workdir, file)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        path = self._path(file)
        try:
            info = await self.sandlot.files.stat(path)
        except NotFoundError:
            info = None
        except SandlotError as exc:
            raise _os_error(exc, file) from exc
        if info is not None and info.type == "dir":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        if info is not None and info.type == "file" and info.mode is not None \
                and not info.mode & 0o200:
            # as Inspect's docker provider reads: a file its owner may not write is read-only
            raise PermissionError(errno.EACCES, "Permission denied", file)
        # an overwrite keeps the file's owner and mode (as `tee` into it would)
        owner = info.owner if info is not None and info.owner and not info.owner.isdigit() \
            else self._user
        try:
            written = await self.sandlot.files.write(path, contents, user=owner)
            if info is not None and info.type == "file" and info.mode is not None \
                    and written.mode != info.mode:
                mode = format(info.mode & 0o7777, "o")
                await self.sandlot.commands.run(f"/bin/chmod {mode} -- {shlex.quote(path)}",
                                                user="root", timeout=60, check=True)
        except SandlotError as exc:
            raise _os_error(exc, file) from exc

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        if posixpath.basename(file.rstrip("/")) in (".", ".."):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        path = self._path(file)
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        too_big = OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        try:
            info = await self.sandlot.files.stat(path)
            if info.type == "dir":
                raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
            if info.type == "file" and info.size > limit:
                raise too_big
            if info.type == "file" and info.mode is not None and not info.mode & 0o400:
                # as Inspect's docker provider: a file its owner may not read is unreadable
                raise PermissionError(errno.EACCES, "Permission denied", file)
            data = await self.sandlot.files.read(path, format="bytes")
        except SandlotError as exc:
            raise _os_error(exc, file) from exc
        if len(data) > limit:
            raise too_big
        return data.decode("utf-8") if text else data

    # -- connection --------------------------------------------------------------------------

    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        if not await self.sandlot.is_running():
            raise ConnectionError(f"sandbox {self.sandlot.sandbox_id} is not running")
        command = shlex.join(["sandlot", "sandbox", "shell", "--user", user or self._user,
                              self.sandlot.sandbox_id])
        if self._api_url and self._api_url != os.environ.get("SANDLOT_URL"):
            command = f"SANDLOT_URL={shlex.quote(self._api_url)} {command}"
        return SandboxConnection(type="sandlot", command=command)

    def default_polling_interval(self) -> float:
        return 0.5


async def fork(n: int = 1, name: str | None = None) -> list[SandlotSandboxEnvironment]:
    """`n` copies of the current sample's sandlot sandbox (`name`: which of its sandboxes;
    default the default one) as it is now, for a solver to try things from this state::

        from sandlot.integrations.inspect_ai import fork

        copies = await fork(4)
        results = [await c.exec(["python", "attempt.py", str(i)]) for i, c in enumerate(copies)]

    They are killed with the sample (or earlier with ``await copy.close()``)."""
    from inspect_ai.util import sandbox

    return await sandbox(name).as_type(SandlotSandboxEnvironment).fork(n)
