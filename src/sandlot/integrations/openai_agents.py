"""The OpenAI Agents SDK on sandlot: a sandbox client and session.

    from agents import Runner
    from agents.run_config import RunConfig, SandboxRunConfig
    from sandlot.integrations.openai_agents import SandlotSandboxClient

    client = SandlotSandboxClient()
    result = await Runner.run(agent, "...", run_config=RunConfig(
        sandbox=SandboxRunConfig(client=client)))

`SandlotSandboxSession` runs commands, reads and writes files, starts processes on
terminals (the SDK's PTY tools) and resolves exposed ports, all through sandlot's Python SDK.
Its workspace persistence is a sandlot snapshot with memory: ``persist_workspace`` snapshots
the whole sandbox (RAM, processes, disk) and hands the SDK a small reference to store; a
resumed session whose sandbox is gone is restored from that snapshot, so the processes it had
are still running. `SandlotSandboxClient.fork` branches a session into independent copies.
This module imports the Agents SDK: ``pip install "sandlot[openai-agents]"``.
"""

from __future__ import annotations

import asyncio
import io
import json
import shlex
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    ExposedPortUnavailableError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
    WorkspaceWriteTypeError,
)
from agents.sandbox.manifest import Manifest
from agents.sandbox.session import SandboxSession, SandboxSessionState
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.dependencies import Dependencies
from agents.sandbox.session.manager import Instrumentation
from agents.sandbox.session.pty_output import collect_pty_output
from agents.sandbox.session.pty_types import (
    PTY_PROCESSES_MAX,
    PtyExecUpdate,
    allocate_pty_process_id,
    clamp_pty_yield_time_ms,
    process_id_to_prune_from_meta,
    resolve_pty_write_yield_time_ms,
)
from agents.sandbox.session.runtime_helpers import (
    RESOLVE_WORKSPACE_PATH_HELPER,
    RuntimeHelperScript,
)
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, ExposedPortEndpoint, User
from agents.sandbox.util.tar_utils import UnsafeTarMemberError, validate_tar_bytes
from agents.sandbox.workspace_paths import sandbox_path_str
from pydantic import Field

from sandlot import (
    AsyncCommandHandle,
    AsyncSandbox,
    AsyncSandlot,
    AsyncTerminal,
    CommandTimeoutError,
    InvalidStateError,
    NotFoundError,
    SandlotError,
)

BACKEND_ID = "sandlot"
# What `persist_workspace` hands the SDK: this line, then {"snapshot_id": ...}. Anything else
# given to `hydrate_workspace` is taken as a tar of the workspace (another provider's).
SNAPSHOT_MAGIC = b"SANDLOT_SNAPSHOT_V1\n"
TIMEOUT_EXIT_CODE = 124
# A session keeps its newest snapshots: the one its stored reference names and, in case storing
# that reference failed, the one before.
KEEP_SNAPSHOTS = 2


def encode_snapshot_ref(snapshot_id: str) -> bytes:
    """The bytes the SDK stores for a workspace persisted as sandlot snapshot `snapshot_id`."""
    return SNAPSHOT_MAGIC + json.dumps({"snapshot_id": snapshot_id}).encode()


def decode_snapshot_ref(raw: bytes) -> str | None:
    """The snapshot id in `raw`, or None if `raw` is not a sandlot snapshot reference."""
    if not raw.startswith(SNAPSHOT_MAGIC):
        return None
    try:
        obj = json.loads(raw[len(SNAPSHOT_MAGIC):].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    value = obj.get("snapshot_id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) and value else None


class SandlotSandboxClientOptions(BaseSandboxClientOptions):
    """Where a session's sandbox comes from and how it lives.

    `snapshot` (a sandlot snapshot id or name) restores every session from a warmed state;
    else `image` (an OCI reference) or `template`. `timeout` is the sandbox's lifetime in
    seconds; `pause_on_exit` pauses it (memory kept) at shutdown instead of killing it, so a
    resume reattaches to it. `exposed_ports` may be resolved with `resolve_exposed_port`.
    """

    type: Literal["sandlot"] = "sandlot"
    template: str = "base"
    image: str | None = None
    snapshot: str | None = None
    timeout: int | None = 3600
    memory_mb: int | None = None
    cpus: int | None = None
    env: dict[str, str] | None = None
    metadata: dict[str, str] | None = None
    internet: bool = True
    exposed_ports: tuple[int, ...] = ()
    pause_on_exit: bool = False


class SandlotSandboxSessionState(SandboxSessionState):
    """A sandlot session's serializable state: its sandbox and how to make another."""

    type: Literal["sandlot"] = "sandlot"
    sandbox_id: str
    template: str = "base"
    image: str | None = None
    source_snapshot: str | None = None
    sandbox_timeout: int | None = 3600
    memory_mb: int | None = None
    cpus: int | None = None
    base_env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    internet: bool = True
    pause_on_exit: bool = False
    # The snapshots this session persisted, oldest first: the last KEEP_SNAPSHOTS are kept.
    persisted_snapshots: list[str] = Field(default_factory=list)


@dataclass
class _Process:
    """A process started by `pty_exec_start` and the output not yet collected."""

    handle: AsyncCommandHandle
    tty: bool
    chunks: deque[bytes] = field(default_factory=deque)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int | None = None
    waiter: asyncio.Task[None] | None = None
    last_used: float = 0.0

    def append(self, text: str) -> None:
        self.chunks.append(text.encode("utf-8", errors="replace"))
        self.notify.set()


class SandlotSandboxSession(BaseSandboxSession):
    """An Agents SDK sandbox session on one sandlot sandbox."""

    state: SandlotSandboxSessionState

    def __init__(self, *, state: SandlotSandboxSessionState, sandbox: AsyncSandbox,
                 client: AsyncSandlot) -> None:
        self.state = state
        self._sandbox = sandbox
        self._client = client
        self._root_ready = state.workspace_root_ready
        self._pty_lock = asyncio.Lock()
        self._processes: dict[int, _Process] = {}

    @property
    def sandbox(self) -> AsyncSandbox:
        """The sandlot `AsyncSandbox` the session runs in."""
        return self._sandbox

    @property
    def sandbox_id(self) -> str:
        return self.state.sandbox_id

    def _adopt(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox
        self.state.sandbox_id = sandbox.sandbox_id

    # -- workspace and helpers ---------------------------------------------------------------

    async def _validate_path_access(self, path: Path | str, *, for_write: bool = False) -> Path:
        return await self._validate_remote_path_access(path, for_write=for_write)

    def _runtime_helpers(self) -> tuple[RuntimeHelperScript, ...]:
        return (RESOLVE_WORKSPACE_PATH_HELPER,)

    def _current_runtime_helper_cache_key(self) -> object | None:
        return self.state.sandbox_id

    async def _env(self) -> dict[str, str]:
        return {**self.state.base_env, **await self.state.manifest.environment.resolve()}

    async def _prepare_backend_workspace(self) -> None:
        root = sandbox_path_str(self._workspace_root_path())
        result = await self._run(f"mkdir -p -- {shlex.quote(root)}", cwd="/", timeout=60)
        if not result.ok():
            raise WorkspaceArchiveWriteError(path=self._workspace_root_path(),
                                             context={"reason": "root_make_failed",
                                                      "stderr": result.stderr.decode()})
        self._root_ready = True

    def _mark_workspace_root_ready_from_probe(self) -> None:
        super()._mark_workspace_root_ready_from_probe()
        self._root_ready = True

    async def _after_start(self) -> None:
        # A hydrate may have swapped the sandbox: its runtime helpers are installed anew.
        if self._runtime_helper_cache_key != self._current_runtime_helper_cache_key():
            await self._ensure_runtime_helpers()

    # -- commands -----------------------------------------------------------------------------

    async def _run(self, cmd: str, *, cwd: str | None, timeout: float | None,
                   user: str | None = None) -> ExecResult:
        result = await self._sandbox.commands.run(cmd, timeout=timeout, cwd=cwd, user=user,
                                                  env=await self._env())
        return ExecResult(stdout=result.stdout.encode(), stderr=result.stderr.encode(),
                          exit_code=result.exit_code)

    @staticmethod
    def _split_user(command: list[str]) -> tuple[list[str], str | None]:
        # SandboxSession.exec puts `sudo -u USER --` in front; sandlot runs as a user itself.
        if len(command) >= 4 and command[:2] == ["sudo", "-u"] and command[3] == "--":
            return command[4:], command[2]
        return command, None

    def _cwd(self) -> str | None:
        return self.state.manifest.root if self._root_ready else "/"

    async def _exec_internal(self, *command: str | Path,
                             timeout: float | None = None) -> ExecResult:
        argv, user = self._split_user([str(c) for c in command])
        cmd = shlex.join(argv)
        try:
            return await self._run(cmd, cwd=self._cwd(), timeout=timeout, user=user)
        except CommandTimeoutError as exc:
            raise ExecTimeoutError(command=argv, timeout_s=timeout, cause=exc) from exc
        except SandlotError as exc:
            raise ExecTransportError(command=argv, cause=exc,
                                     context={"backend": BACKEND_ID,
                                              "sandbox_id": self.sandbox_id}) from exc

    async def running(self) -> bool:
        if not self._root_ready:
            return False
        try:
            return await self._sandbox.is_running()
        except SandlotError:
            return False

    async def _resolve_exposed_port(self, port: int) -> ExposedPortEndpoint:
        try:
            address = await self._sandbox.get_host(port)
        except SandlotError as exc:
            raise ExposedPortUnavailableError(
                port=port, exposed_ports=self.state.exposed_ports,
                reason="backend_unavailable", context={"backend": BACKEND_ID},
                cause=exc) from exc
        host, _, number = address.rpartition(":")
        return ExposedPortEndpoint(host=host.strip("[]"), port=int(number))

    # -- files --------------------------------------------------------------------------------

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        if user is not None:
            await self._check_read_with_exec(path, user=user)
        target = await self._validate_path_access(path)
        try:
            data = await self._sandbox.files.read(sandbox_path_str(target), format="bytes")
        except NotFoundError as exc:
            raise WorkspaceReadNotFoundError(path=path, cause=exc) from exc
        except SandlotError as exc:
            raise WorkspaceArchiveReadError(path=path, cause=exc) from exc
        return io.BytesIO(data)

    async def write(self, path: Path, data: io.IOBase, *,
                    user: str | User | None = None) -> None:
        if user is not None:
            await self._check_write_with_exec(path, user=user)
        payload = data.read()
        if isinstance(payload, str):
            payload = payload.encode()
        if not isinstance(payload, bytes | bytearray):
            raise WorkspaceWriteTypeError(path=path, actual_type=type(payload).__name__)
        target = await self._validate_path_access(path, for_write=True)
        owner = user.name if isinstance(user, User) else (user or "root")
        try:
            await self._sandbox.files.write(sandbox_path_str(target), bytes(payload), user=owner)
        except SandlotError as exc:
            raise WorkspaceArchiveWriteError(path=target, cause=exc) from exc

    # -- persistence: a snapshot with memory ----------------------------------------------------

    async def persist_workspace(self) -> io.IOBase:
        """Snapshot the whole sandbox (memory, processes, disk) and return its reference; the
        session's snapshots older than its last `KEEP_SNAPSHOTS` are deleted."""
        root = self._workspace_root_path()
        try:
            snap = await self._sandbox.create_snapshot(memory=True)
            await snap.wait(timeout=600)
        except SandlotError as exc:
            raise WorkspaceArchiveReadError(path=root, context={"reason": "snapshot_failed"},
                                            cause=exc) from exc
        kept = self.state.persisted_snapshots + [snap.snapshot_id]
        for old in kept[:-KEEP_SNAPSHOTS]:
            try:
                await self._client.snapshots.delete(old)
            except SandlotError:
                pass
        self.state.persisted_snapshots = kept[-KEEP_SNAPSHOTS:]
        return io.BytesIO(encode_snapshot_ref(snap.snapshot_id))

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        """Restore a sandlot snapshot reference (the session moves to the restored sandbox,
        its processes running), or extract another provider's workspace tar."""
        raw = data.read()
        if isinstance(raw, str):
            raw = raw.encode()
        root = self._workspace_root_path()
        snapshot_id = decode_snapshot_ref(bytes(raw))
        if snapshot_id is not None:
            try:
                restored = await _start(self._client, self.state, self.state.base_env,
                                        snapshot_id)
            except SandlotError as exc:
                raise WorkspaceArchiveWriteError(
                    path=root, context={"reason": "snapshot_restore_failed",
                                        "snapshot_id": snapshot_id}, cause=exc) from exc
            old = self._sandbox
            self._adopt(restored)
            self._root_ready = True
            try:
                await old.kill()
            except SandlotError:
                pass
            return
        try:
            validate_tar_bytes(bytes(raw), allow_external_symlink_targets=False)
        except UnsafeTarMemberError as exc:
            raise WorkspaceArchiveWriteError(
                path=root, context={"reason": "unsafe_or_invalid_tar", "member": exc.member},
                cause=exc) from exc
        tar_path = f"/tmp/sandbox-hydrate-{self.state.session_id.hex}.tar"
        try:
            await self._sandbox.files.write(tar_path, bytes(raw))
            result = await self._run(
                f"mkdir -p -- {shlex.quote(root.as_posix())} && tar -C "
                f"{shlex.quote(root.as_posix())} -xf {shlex.quote(tar_path)}; "
                f"rc=$?; rm -f -- {shlex.quote(tar_path)}; exit $rc", cwd="/", timeout=600)
        except SandlotError as exc:
            raise WorkspaceArchiveWriteError(path=root, cause=exc) from exc
        if not result.ok():
            raise WorkspaceArchiveWriteError(
                path=root, context={"reason": "hydrate_nonzero_exit",
                                    "exit_code": result.exit_code,
                                    "stderr": result.stderr.decode()})
        self._root_ready = True

    # -- teardown -------------------------------------------------------------------------------

    async def _shutdown_backend(self) -> None:
        try:
            if self.state.pause_on_exit:
                await self._sandbox.pause()
            else:
                await self._sandbox.kill()
        except SandlotError:
            if self.state.pause_on_exit:
                try:
                    await self._sandbox.kill()
                except SandlotError:
                    pass

    # -- terminals (the SDK's PTY tools) --------------------------------------------------------

    def supports_pty(self) -> bool:
        return True

    async def pty_exec_start(self, *command: str | Path, timeout: float | None = None,
                             shell: bool | list[str] = True, user: str | User | None = None,
                             tty: bool = False, yield_time_s: float | None = None,
                             max_output_tokens: int | None = None) -> PtyExecUpdate:
        argv, as_user = self._split_user(self._prepare_exec_command(
            *command, shell=shell, user=user))
        cmd = shlex.join(argv)
        env = await self._env()
        try:
            if tty:
                handle: AsyncCommandHandle = await self._sandbox.pty.create(
                    cmd=cmd, cwd=self._cwd(), env=env, user=as_user or "root",
                    timeout=timeout)
            else:
                handle = await self._sandbox.commands.start(
                    cmd, cwd=self._cwd(), env=env, user=as_user, timeout=timeout)
        except SandlotError as exc:
            raise ExecTransportError(command=argv, cause=exc,
                                     context={"backend": BACKEND_ID}) from exc
        proc = _Process(handle=handle, tty=tty, last_used=asyncio.get_running_loop().time())
        proc.waiter = asyncio.create_task(self._follow(proc))
        async with self._pty_lock:
            process_id = allocate_pty_process_id(set(self._processes))
            pruned = self._prune()
            self._processes[process_id] = proc
        if pruned is not None:
            await self._terminate(pruned)
        wait_ms = 10_000 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._collect(process_id, proc, clamp_pty_yield_time_ms(wait_ms),
                                   max_output_tokens)

    async def pty_write_stdin(self, *, session_id: int, chars: str,
                              yield_time_s: float | None = None,
                              max_output_tokens: int | None = None) -> PtyExecUpdate:
        async with self._pty_lock:
            proc = self._resolve_pty_session_entry(pty_processes=self._processes,
                                                   session_id=session_id)
        if chars:
            await proc.handle.send_stdin(chars)
        proc.last_used = asyncio.get_running_loop().time()
        wait_ms = 250 if yield_time_s is None else int(yield_time_s * 1000)
        return await self._collect(
            session_id, proc,
            resolve_pty_write_yield_time_ms(yield_time_ms=wait_ms, input_empty=chars == ""),
            max_output_tokens)

    async def pty_terminate_all(self) -> None:
        async with self._pty_lock:
            procs = list(self._processes.values())
            self._processes.clear()
        for proc in procs:
            await self._terminate(proc)

    async def _follow(self, proc: _Process) -> None:
        try:
            if isinstance(proc.handle, AsyncTerminal):
                result = await proc.handle.wait(on_data=proc.append)
            else:
                result = await proc.handle.wait(on_stdout=proc.append, on_stderr=proc.append)
            proc.exit_code = result.exit_code
        except CommandTimeoutError:
            proc.exit_code = TIMEOUT_EXIT_CODE
        except SandlotError:
            proc.exit_code = -1
        async with proc.lock:
            pass
        proc.closed.set()
        proc.notify.set()

    async def _collect(self, process_id: int, proc: _Process, yield_time_ms: int,
                       max_output_tokens: int | None) -> PtyExecUpdate:
        output, tokens, closed = await collect_pty_output(
            output_chunks=proc.chunks, output_lock=proc.lock, output_notify=proc.notify,
            is_done=proc.closed.is_set, yield_time_ms=yield_time_ms,
            max_output_tokens=max_output_tokens)
        live: int | None = process_id
        exit_code = proc.exit_code if closed else None
        if exit_code is not None:
            async with self._pty_lock:
                self._processes.pop(process_id, None)
            live = None
        return PtyExecUpdate(process_id=live, output=output, exit_code=exit_code,
                             original_token_count=tokens)

    def _prune(self) -> _Process | None:
        if len(self._processes) < PTY_PROCESSES_MAX:
            return None
        victim = process_id_to_prune_from_meta(
            [(pid, p.last_used, p.closed.is_set()) for pid, p in self._processes.items()])
        return None if victim is None else self._processes.pop(victim, None)

    async def _terminate(self, proc: _Process) -> None:
        if not proc.closed.is_set():
            try:
                await proc.handle.kill()
            except SandlotError:
                pass
        if proc.waiter is not None:
            if not proc.waiter.done():
                proc.waiter.cancel()
            await asyncio.gather(proc.waiter, return_exceptions=True)


async def _start(client: AsyncSandlot, state: SandlotSandboxSessionState, env: dict[str, str],
                 snapshot_id: str | None = None) -> AsyncSandbox:
    """A sandbox with the session's settings: a restore of `snapshot_id` (its processes go
    on), else of the state's source snapshot, else its template or image."""
    snapshot_id = snapshot_id or state.source_snapshot
    return await client.sandboxes.create(
        state.template, snapshot_id=snapshot_id, image=None if snapshot_id else state.image,
        memory_mb=state.memory_mb, cpus=state.cpus, env=env or None,
        timeout=state.sandbox_timeout, metadata=state.metadata, internet=state.internet)


class SandlotSandboxClient(BaseSandboxClient[SandlotSandboxClientOptions]):
    """Makes, resumes, forks and deletes sandlot sessions for the Agents SDK. The server is
    `api_url`/`api_key` (default env ``SANDLOT_URL``/``SANDLOT_API_KEY``)."""

    backend_id = BACKEND_ID
    supports_default_options = True

    def __init__(self, *, api_url: str | None = None, api_key: str | None = None,
                 instrumentation: Instrumentation | None = None,
                 dependencies: Dependencies | None = None) -> None:
        self._client = AsyncSandlot(api_url, api_key)
        self._instrumentation = instrumentation or Instrumentation()
        self._dependencies = dependencies

    @property
    def sandlot(self) -> AsyncSandlot:
        """The sandlot client the sessions use."""
        return self._client

    async def aclose(self) -> None:
        """Close the HTTP connections (sessions' sandboxes keep running)."""
        await self._client.aclose()

    def _session(self, state: SandlotSandboxSessionState, sandbox: AsyncSandbox,
                 *, preserved: bool) -> SandboxSession:
        inner = SandlotSandboxSession(state=state, sandbox=sandbox, client=self._client)
        inner._set_start_state_preserved(preserved, system=preserved)
        return self._wrap_session(inner, instrumentation=self._instrumentation)

    async def create(self, *, snapshot: SnapshotSpec | SnapshotBase | None = None,
                     manifest: Manifest | None = None,
                     options: SandlotSandboxClientOptions | None = None) -> SandboxSession:
        """A session on a new sandbox (restored from `options.snapshot` when given)."""
        options = options or SandlotSandboxClientOptions()
        manifest = manifest if manifest is not None else Manifest()
        self._validate_manifest_for_create(manifest)
        session_id = uuid.uuid4()
        state = SandlotSandboxSessionState(
            session_id=session_id, manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)), sandbox_id="",
            template=options.template, image=options.image, source_snapshot=options.snapshot,
            sandbox_timeout=options.timeout, memory_mb=options.memory_mb, cpus=options.cpus,
            base_env=dict(options.env or {}), metadata=dict(options.metadata or {}),
            internet=options.internet, pause_on_exit=options.pause_on_exit,
            exposed_ports=options.exposed_ports)
        env = {**state.base_env, **await manifest.environment.resolve()}
        sandbox = await _start(self._client, state, env)
        state.sandbox_id = sandbox.sandbox_id
        return self._session(state, sandbox, preserved=False)

    async def delete(self, session: SandboxSession) -> SandboxSession:
        """Kill the session's sandbox (if it still runs)."""
        inner = session._inner
        if not isinstance(inner, SandlotSandboxSession):
            raise TypeError("SandlotSandboxClient.delete expects a SandlotSandboxSession")
        try:
            await inner.sandbox.kill()
        except SandlotError:
            pass
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        """Reattach to the state's sandbox if it runs (or is paused: it is resumed); else
        restore the sandlot snapshot the state's workspace was persisted as (its processes
        running); else start a new sandbox, which the SDK hydrates from the state."""
        if not isinstance(state, SandlotSandboxSessionState):
            raise TypeError("SandlotSandboxClient.resume expects a SandlotSandboxSessionState")
        state.assert_path_grants_rebound()
        sandbox = await self._reattach(state.sandbox_id)
        if sandbox is None:
            snapshot_id = await self._persisted_snapshot(state)
            if snapshot_id is not None:
                try:
                    sandbox = await _start(self._client, state, state.base_env, snapshot_id)
                except NotFoundError:
                    sandbox = None
        if sandbox is not None:
            state.sandbox_id = sandbox.sandbox_id
            return self._session(state, sandbox, preserved=True)
        env = {**state.base_env, **await state.manifest.environment.resolve()}
        sandbox = await _start(self._client, state, env)
        state.sandbox_id = sandbox.sandbox_id
        state.workspace_root_ready = False
        return self._session(state, sandbox, preserved=False)

    async def _reattach(self, sandbox_id: str) -> AsyncSandbox | None:
        if not sandbox_id:
            return None
        try:  # gone: None; a failure to reach the server is raised, not taken for gone
            sandbox = await self._client.sandboxes.connect(sandbox_id)
        except NotFoundError:
            return None
        if sandbox.info.state == "paused":
            try:
                return await self._client.sandboxes.resume(sandbox_id)
            except (NotFoundError, InvalidStateError):  # killed, or resumed elsewhere
                return None
        return sandbox if sandbox.info.state in ("running", "starting") else None

    async def _persisted_snapshot(self, state: SandlotSandboxSessionState) -> str | None:
        deps = self._resolve_dependencies()
        try:
            if not await state.snapshot.restorable(dependencies=deps):
                return None
            stream = await state.snapshot.restore(dependencies=deps)
            try:
                head = stream.read(4096)
            finally:
                stream.close()
        except Exception:  # noqa: BLE001 - any store failure: fall back to a new sandbox
            return None
        return decode_snapshot_ref(head if isinstance(head, bytes) else b"")

    async def fork(self, session: SandboxSession, count: int = 1) -> list[SandboxSession]:
        """`count` new sessions on copies of `session`'s sandbox as it is now (memory,
        processes, files), each with its own id and snapshot; start them (``async with``)
        before use. The parent runs on."""
        inner = session._inner
        if not isinstance(inner, SandlotSandboxSession):
            raise TypeError("SandlotSandboxClient.fork expects a SandlotSandboxSession")
        children = await inner.sandbox.fork(count)
        forks = []
        for child in children:
            session_id = uuid.uuid4()
            snap = inner.state.snapshot
            if "id" in type(snap).model_fields:
                snap = snap.model_copy(update={"id": str(session_id)})
            state = inner.state.model_copy(deep=True, update={
                "session_id": session_id, "sandbox_id": child.sandbox_id, "snapshot": snap,
                "workspace_root_ready": True, "snapshot_fingerprint": None,
                "snapshot_fingerprint_version": None, "persisted_snapshots": []})
            forks.append(self._session(state, child, preserved=True))
        return forks

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, SandlotSandboxSessionState)


__all__ = [
    "SandlotSandboxClient",
    "SandlotSandboxClientOptions",
    "SandlotSandboxSession",
    "SandlotSandboxSessionState",
    "decode_snapshot_ref",
    "encode_snapshot_ref",
]
