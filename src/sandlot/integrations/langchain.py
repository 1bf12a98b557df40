"""LangChain Deep Agents on sandlot: a sandbox backend and a provider of them.

    from deepagents import create_deep_agent
    from sandlot.integrations.langchain import SandlotProvider

    provider = SandlotProvider(snapshot="warmed")     # every sandbox starts from a snapshot
    backend = provider.create()
    agent = create_deep_agent(model=..., backend=backend)

`SandlotBackend` implements deepagents' `SandboxBackendProtocol` (through its `BaseSandbox`:
file tools run as shell and Python commands over `execute`) with sandlot's file API for
uploads and downloads. `SandlotProvider` gets, creates (from a template, an image or a
snapshot), lists, reconnects to and deletes them; `SandlotBackend.fork` branches a sandbox
with its memory. This module imports deepagents: ``pip install "sandlot[langchain]"``.
"""

from __future__ import annotations

import asyncio
import shlex
from typing import Any

from deepagents.backends.protocol import (
    ExecuteResponse,
    FileDownloadResponse,
    FileUploadResponse,
)
from deepagents.backends.sandbox import BaseSandbox

from sandlot import (
    CommandTimeoutError,
    InvalidArgumentError,
    NotFoundError,
    Sandbox,
    Sandlot,
    SandlotError,
)

DEFAULT_COMMAND_TIMEOUT = 30 * 60  # s, a command run without its own timeout
TIMEOUT_EXIT_CODE = 124  # as timeout(1)
TAG = "sandlot.integration"  # metadata key marking the provider's sandboxes
TAG_VALUE = "deepagents"

# One line per path: d(irectory), n(ot found), p(ermission denied) or f(ile, readable), as the
# backend's user sees it.
_PROBE = ('for p in "$@"; do if [ -d "$p" ]; then echo d; elif [ ! -e "$p" ]; then echo n; '
          'elif [ ! -r "$p" ]; then echo p; else echo f; fi; done')
_PROBE_ERRORS = {"d": "is_directory", "n": "file_not_found", "p": "permission_denied"}


def _file_error(exc: SandlotError) -> str:
    """deepagents' error code for a failed sandlot file call."""
    text = str(exc).lower()
    if isinstance(exc, NotFoundError) or "no such file" in text:
        return "file_not_found"
    if "permission denied" in text:
        return "permission_denied"
    if "is a directory" in text:
        return "is_directory"
    if isinstance(exc, InvalidArgumentError):
        return "invalid_path"
    return f"{type(exc).__name__}: {exc}"


class SandlotBackend(BaseSandbox):
    """A deepagents sandbox backend on one sandlot sandbox.

    Commands run with ``/bin/sh -c`` as `user` (None: the template's user, root for the base
    template; the base template also has an unprivileged ``user``) in `workdir` (None: the
    user's home). `timeout` is the default of commands run without one.

    File operations keep deepagents 0.7's contract as `BaseSandbox` implements it, which its
    tools rely on: `glob` answers absolute paths of regular files (the glob tool shows them to
    the model and permission rules match absolute paths), `write` replaces an existing file
    (write_file). langchain-tests 1.1.9 still asserts deepagents 0.6's relative paths, listed
    directories and refused overwrite; the tests xfail those seven (docs/integrations.md).
    """

    def __init__(self, sandbox: Sandbox, *, user: str | None = None, workdir: str | None = None,
                 timeout: int = DEFAULT_COMMAND_TIMEOUT) -> None:
        self._sandbox = sandbox
        self._user = user
        self._workdir = workdir
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"SandlotBackend(id={self.id!r}, user={self._user!r})"

    @property
    def id(self) -> str:
        """The sandlot sandbox id (``sb-...``)."""
        return self._sandbox.sandbox_id

    @property
    def sandbox(self) -> Sandbox:
        """The sandlot `Sandbox` (for snapshots, pause, ports, ...)."""
        return self._sandbox

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        """Run `command`; its stdout and stderr in the order they came, its exit code.

        `timeout` in seconds (None: the backend's default; 0: none). A command past it is
        killed with its whole process group and answers exit code 124.
        """
        limit = self._timeout if timeout is None else timeout
        if limit < 0:
            raise ValueError(f"timeout must be non-negative, got {limit}")
        chunks: list[str] = []
        try:
            result = self._sandbox.commands.run(
                command, timeout=limit or None, cwd=self._workdir, user=self._user,
                on_stdout=chunks.append, on_stderr=chunks.append)
        except CommandTimeoutError:
            chunks.append(f"\nCommand timed out after {limit} seconds")
            return ExecuteResponse(output="".join(chunks), exit_code=TIMEOUT_EXIT_CODE)
        except SandlotError as exc:
            return ExecuteResponse(
                output=f"Error executing command ({type(exc).__name__}): {exc}", exit_code=1)
        return ExecuteResponse(output="".join(chunks), exit_code=result.exit_code)

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        """Write each file (parent directories created) as the backend's user; one response
        per file, in order, with deepagents' error codes."""
        return [FileUploadResponse(path=path, error=self._upload(path, content))
                for path, content in files]

    def _upload(self, path: str, content: bytes) -> str | None:
        if not path.startswith("/"):
            return "invalid_path"
        try:
            self._sandbox.files.write(path, content, user=self._user or "root")
        except SandlotError as exc:
            return _file_error(exc)
        return None

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        """Read each file; one response per path, in order. What the backend's user may not
        read, or is a directory or missing, gets its error code (one probe for all)."""
        kinds = self._probe([p for p in paths if p.startswith("/")])
        out = []
        for path in paths:
            if not path.startswith("/"):
                out.append(FileDownloadResponse(path=path, error="invalid_path"))
                continue
            kind = kinds.get(path, "f")
            if kind in _PROBE_ERRORS:
                out.append(FileDownloadResponse(path=path, error=_PROBE_ERRORS[kind]))
                continue
            try:
                content = self._sandbox.files.read(path, format="bytes")
            except SandlotError as exc:
                out.append(FileDownloadResponse(path=path, error=_file_error(exc)))
                continue
            out.append(FileDownloadResponse(path=path, content=content))
        return out

    def _probe(self, paths: list[str]) -> dict[str, str]:
        if not paths:
            return {}
        args = " ".join(shlex.quote(p) for p in paths)
        result = self._sandbox.commands.run(f"sh -c {shlex.quote(_PROBE)} sh {args}",
                                            user=self._user, timeout=60)
        return dict(zip(paths, result.stdout.split(), strict=False))

    def fork(self, count: int = 1) -> list[SandlotBackend]:
        """`count` new backends on copies of this sandbox as it is now (memory, processes,
        files), with this backend's settings."""
        return [SandlotBackend(child, user=self._user, workdir=self._workdir,
                               timeout=self._timeout) for child in self._sandbox.fork(count)]


class SandlotProvider:
    """Creates, finds and deletes `SandlotBackend`s on a sandlot server.

    New sandboxes start from `snapshot` (id or name: a restore, so a warmed environment with
    its running processes), else from the OCI `image`, else from `template`. They are tagged
    in their metadata, so `list` answers this provider's kind only. `user`, `workdir` and
    `command_timeout` go to each backend; `timeout` is each sandbox's lifetime in seconds.
    The server is `api_url`/`api_key` (default env ``SANDLOT_URL``/``SANDLOT_API_KEY``).
    """

    def __init__(self, *, template: str = "base", image: str | None = None,
                 snapshot: str | None = None, user: str | None = None,
                 workdir: str | None = None, timeout: int = 3600,
                 command_timeout: int = DEFAULT_COMMAND_TIMEOUT,
                 metadata: dict[str, str] | None = None, api_url: str | None = None,
                 api_key: str | None = None) -> None:
        self._client = Sandlot(api_url, api_key)
        self._template = template
        self._image = image
        self._snapshot = snapshot
        self._user = user
        self._workdir = workdir
        self._timeout = timeout
        self._command_timeout = command_timeout
        self._metadata = {**(metadata or {}), TAG: TAG_VALUE}

    @property
    def client(self) -> Sandlot:
        """The sandlot client the provider uses."""
        return self._client

    def _backend(self, sandbox: Sandbox) -> SandlotBackend:
        return SandlotBackend(sandbox, user=self._user, workdir=self._workdir,
                              timeout=self._command_timeout)

    def create(self, *, metadata: dict[str, str] | None = None,
               timeout: int | None = None) -> SandlotBackend:
        """A backend on a new sandbox (from the provider's snapshot, image or template)."""
        meta = {**self._metadata, **(metadata or {})}
        life = timeout or self._timeout
        sandbox = self._client.sandboxes.create(
            self._template, snapshot_id=self._snapshot,
            image=None if self._snapshot else self._image, timeout=life, metadata=meta)
        return self._backend(sandbox)

    def get(self, *, sandbox_id: str) -> SandlotBackend:
        """Reconnect to a running sandbox; `NotFoundError` if there is none by that id."""
        try:
            sandbox = self._client.sandboxes.connect(sandbox_id)
        except InvalidArgumentError as exc:  # not even a sandbox id
            raise NotFoundError(f"sandbox {sandbox_id} not found") from exc
        if sandbox.info.state not in ("running", "starting", "paused"):
            raise NotFoundError(f"sandbox {sandbox_id} is {sandbox.info.state}")
        return self._backend(sandbox)

    def get_or_create(self, *, sandbox_id: str | None = None, **kwargs: Any) -> SandlotBackend:
        """`get` when given a `sandbox_id`, else `create`."""
        if sandbox_id is None:
            return self.create(**kwargs)
        if kwargs:
            raise ValueError(f"get() takes no options, got {sorted(kwargs)}")
        return self.get(sandbox_id=sandbox_id)

    def list(self, *, cursor: str | None = None, metadata: dict[str, str] | None = None,
             ) -> dict[str, Any]:
        """This provider's running sandboxes: ``{"items": [{"sandbox_id", "metadata",
        "state", ...}], "cursor": None}`` (one page: sandlot does not paginate)."""
        del cursor
        infos = self._client.sandboxes.list({**(metadata or {}), TAG: TAG_VALUE})
        return {"items": [{"sandbox_id": i.sandbox_id, "metadata": i.metadata,
                           "state": i.state, "template": i.template,
                           "created_at": i.created_at} for i in infos],
                "cursor": None}

    def delete(self, *, sandbox_id: str) -> None:
        """Kill the sandbox; nothing happens if it is already gone (or never was)."""
        try:
            self._client.sandboxes.kill(sandbox_id)
        except (NotFoundError, InvalidArgumentError):
            pass

    async def acreate(self, **kwargs: Any) -> SandlotBackend:
        return await asyncio.to_thread(self.create, **kwargs)

    async def aget(self, *, sandbox_id: str) -> SandlotBackend:
        return await asyncio.to_thread(self.get, sandbox_id=sandbox_id)

    async def aget_or_create(self, *, sandbox_id: str | None = None,
                             **kwargs: Any) -> SandlotBackend:
        return await asyncio.to_thread(self.get_or_create, sandbox_id=sandbox_id, **kwargs)

    async def alist(self, *, cursor: str | None = None,
                    metadata: dict[str, str] | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(self.list, cursor=cursor, metadata=metadata)

    async def adelete(self, *, sandbox_id: str) -> None:
        await asyncio.to_thread(self.delete, sandbox_id=sandbox_id)

    def close(self) -> None:
        """Close the provider's connections (its sandboxes keep running)."""
        self._client.close()
