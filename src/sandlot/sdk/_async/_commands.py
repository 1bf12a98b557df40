"""Running commands in a sandbox (async)."""

from __future__ import annotations

from typing import Literal, overload

from sandlot.errors import NotFoundError

from .. import _base
from .._models import CommandResult, ProcessInfo, parse_list
from ._http import AsyncAPI


class AsyncCommandHandle:
    """A command started in the background. Wait for it, feed its stdin, or kill it."""

    def __init__(self, api: AsyncAPI, sandbox_id: str, pid: int, cmd: str = "") -> None:
        self._api = api
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.cmd = cmd

    def __repr__(self) -> str:
        return f"AsyncCommandHandle(sandbox_id={self.sandbox_id!r}, pid={self.pid})"

    async def wait(self, on_stdout: _base.OutputCallback | None = None,
                   on_stderr: _base.OutputCallback | None = None) -> CommandResult:
        """Follow the command's output (replayed from its start) until it exits.

        The callbacks get each text chunk as it arrives. Raises the error the server reports,
        e.g. `CommandTimeoutError` if the command ran past its timeout.
        """
        events = _base.CommandStream(self.cmd, on_stdout, on_stderr)
        return await self._api.stream_events(
            _base.stream_command(self.sandbox_id, self.pid), events, _base.STREAM_TIMEOUT)

    async def kill(self, signal: int = 9) -> bool:
        """Send `signal` to the command's process group; False if it had already exited."""
        return await AsyncCommands(self._api, self.sandbox_id).kill(self.pid, signal)

    async def send_stdin(self, data: str | bytes, eof: bool = False) -> None:
        """Write `data` to the command's stdin; `eof=True` closes stdin afterwards."""
        await AsyncCommands(self._api, self.sandbox_id).send_stdin(self.pid, data, eof=eof)


class AsyncCommands:
    """``sbx.commands``: run commands and manage the processes they start."""

    def __init__(self, api: AsyncAPI, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    @overload
    async def run(self, cmd: str, *, timeout: float | None = 60,
                  env: dict[str, str] | None = None, cwd: str | None = None,
                  user: str | None = None,
                  on_stdout: _base.OutputCallback | None = None,
                  on_stderr: _base.OutputCallback | None = None,
                  background: Literal[False] = False, stdin: str | bytes | None = None,
                  check: bool = False) -> CommandResult: ...

    @overload
    async def run(self, cmd: str, *, timeout: float | None = 60,
                  env: dict[str, str] | None = None, cwd: str | None = None,
                  user: str | None = None,
                  on_stdout: _base.OutputCallback | None = None,
                  on_stderr: _base.OutputCallback | None = None,
                  background: Literal[True], stdin: str | bytes | None = None,
                  check: bool = False) -> AsyncCommandHandle: ...

    async def run(self, cmd: str, *, timeout: float | None = 60,
                  env: dict[str, str] | None = None, cwd: str | None = None,
                  user: str | None = None,
                  on_stdout: _base.OutputCallback | None = None,
                  on_stderr: _base.OutputCallback | None = None,
                  background: bool = False, stdin: str | bytes | None = None,
                  check: bool = False) -> CommandResult | AsyncCommandHandle:
        """Run `cmd` with ``/bin/sh -c`` and wait for it to finish.

        Output streams while the command runs: `on_stdout`/`on_stderr` (plain functions, not
        coroutines) are called with each text chunk. `timeout` is in seconds (None or 0: no
        limit); past it the server kills the whole process group and `CommandTimeoutError` is
        raised. `stdin` is written to the process and then closed. With `check=True` a non-zero
        exit raises `CommandExitError`.

        ``background=True`` is a thin alias for `start` (kept for E2B users): it returns an
        `AsyncCommandHandle` at once and ignores the callbacks and `check`; prefer `start`.
        """
        if background:
            return await self.start(cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                    stdin=stdin)
        req = _base.run_command(self._sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd,
                                user=user, stdin=stdin, background=False)
        events = _base.CommandStream(cmd, on_stdout, on_stderr, check=check)
        return await self._api.stream_events(req, events, _base.command_timeout(timeout))

    async def start(self, cmd: str, *, timeout: float | None = None,
                    env: dict[str, str] | None = None, cwd: str | None = None,
                    user: str | None = None, stdin: str | bytes | None = None,
                    ) -> AsyncCommandHandle:
        """Start `cmd` in the background and return a handle at once.

        `timeout` defaults to None (runs until it exits, is killed, or the sandbox stops).
        """
        req = _base.run_command(self._sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd,
                                user=user, stdin=stdin, background=True)
        pid = _base.background_pid(await self._api.call(req))
        return AsyncCommandHandle(self._api, self._sandbox_id, pid, cmd)

    async def connect(self, pid: int) -> AsyncCommandHandle:
        """A handle for a running process, e.g. one from `list`."""
        return AsyncCommandHandle(self._api, self._sandbox_id, pid)

    async def list(self) -> list[ProcessInfo]:
        """The processes still running in the sandbox that commands started."""
        data = await self._api.call(_base.list_commands(self._sandbox_id))
        return parse_list(ProcessInfo, data, "processes")

    async def kill(self, pid: int, signal: int = 9) -> bool:
        """Send `signal` to process `pid`'s group; False if it had exited or is unknown."""
        try:
            data = await self._api.call(_base.kill_command(self._sandbox_id, pid, signal))
        except NotFoundError:
            return False
        return bool((data or {}).get("killed", False))

    async def send_stdin(self, pid: int, data: str | bytes, eof: bool = False) -> None:
        """Write `data` to process `pid`'s stdin; `eof=True` closes stdin afterwards."""
        await self._api.call(_base.send_stdin(self._sandbox_id, pid, data, eof))
