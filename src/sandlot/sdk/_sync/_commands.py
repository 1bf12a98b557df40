# Generated from src/sandlot/sdk/_async/_commands.py by scripts/unasync.py; do not edit.
# ruff: noqa: I001
"""Running commands in a sandbox (sync)."""

from __future__ import annotations

from typing import Literal, overload

from sandlot.errors import NotFoundError

from .. import _base
from .._models import CommandResult, ProcessInfo, parse_list
from ._http import API


class CommandHandle:
    """A command started in the background. Wait for it, feed its stdin, or kill it."""

    def __init__(self, api: API, sandbox_id: str, pid: int, cmd: str = "") -> None:
        self._api = api
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.cmd = cmd

    def __repr__(self) -> str:
        return f"CommandHandle(sandbox_id={self.sandbox_id!r}, pid={self.pid})"

    def wait(self, on_stdout: _base.OutputCallback | None = None,
             on_stderr: _base.OutputCallback | None = None) -> CommandResult:
        """Follow the command's output (replayed from its start) until it exits.

        The callbacks get each text chunk as it arrives. Raises the error the server reports,
        e.g. `CommandTimeoutError` if the command ran past its timeout.
        """
        events = _base.CommandStream(self.cmd, on_stdout, on_stderr)
        return self._api.stream_events(
            _base.stream_command(self.sandbox_id, self.pid), events, _base.STREAM_TIMEOUT)

    def kill(self, signal: int = 9) -> bool:
        """Send `signal` to the command's process group; False if it had already exited."""
        return Commands(self._api, self.sandbox_id).kill(self.pid, signal)

    def send_stdin(self, data: str | bytes, eof: bool = False) -> None:
        """Write `data` to the command's stdin; `eof=True` closes stdin afterwards."""
        Commands(self._api, self.sandbox_id).send_stdin(self.pid, data, eof=eof)


class Commands:
    """``sbx.commands``: run commands and manage the processes they start."""

    def __init__(self, api: API, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    @overload
    def run(self, cmd: str, *, timeout: float | None = 60,
            env: dict[str, str] | None = None, cwd: str | None = None,
            user: str | None = None,
            on_stdout: _base.OutputCallback | None = None,
            on_stderr: _base.OutputCallback | None = None,
            background: Literal[False] = False, stdin: str | bytes | None = None,
            check: bool = False) -> CommandResult: ...

    @overload
    def run(self, cmd: str, *, timeout: float | None = 60,
            env: dict[str, str] | None = None, cwd: str | None = None,
            user: str | None = None,
            on_stdout: _base.OutputCallback | None = None,
            on_stderr: _base.OutputCallback | None = None,
            background: Literal[True], stdin: str | bytes | None = None,
            check: bool = False) -> CommandHandle: ...

    def run(self, cmd: str, *, timeout: float | None = 60,
            env: dict[str, str] | None = None, cwd: str | None = None,
            user: str | None = None,
            on_stdout: _base.OutputCallback | None = None,
            on_stderr: _base.OutputCallback | None = None,
            background: bool = False, stdin: str | bytes | None = None,
            check: bool = False) -> CommandResult | CommandHandle:
        """Run `cmd` with ``/bin/sh -c`` and wait for it to finish.

        Output streams while the command runs: `on_stdout`/`on_stderr` (plain functions, not
        coroutines) are called with each text chunk. `timeout` is in seconds (None or 0: no
        limit); past it the server kills the whole process group and `CommandTimeoutError` is
        raised. `stdin` is written to the process and then closed. With `check=True` a non-zero
        exit raises `CommandExitError`.

        ``background=True`` is a thin alias for `start` (kept for E2B users): it returns an
        `CommandHandle` at once and ignores the callbacks and `check`; prefer `start`.
        """
        if background:
            return self.start(cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                              stdin=stdin)
        req = _base.run_command(self._sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd,
                                user=user, stdin=stdin, background=False)
        events = _base.CommandStream(cmd, on_stdout, on_stderr, check=check)
        return self._api.stream_events(req, events, _base.command_timeout(timeout))

    def start(self, cmd: str, *, timeout: float | None = None,
              env: dict[str, str] | None = None, cwd: str | None = None,
              user: str | None = None, stdin: str | bytes | None = None,
              ) -> CommandHandle:
        """Start `cmd` in the background and return a handle at once.

        `timeout` defaults to None (runs until it exits, is killed, or the sandbox stops).
        """
        req = _base.run_command(self._sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd,
                                user=user, stdin=stdin, background=True)
        pid = _base.background_pid(self._api.call(req))
        return CommandHandle(self._api, self._sandbox_id, pid, cmd)

    def connect(self, pid: int) -> CommandHandle:
        """A handle for a running process, e.g. one from `list`."""
        return CommandHandle(self._api, self._sandbox_id, pid)

    def list(self) -> list[ProcessInfo]:
        """The processes still running in the sandbox that commands started."""
        data = self._api.call(_base.list_commands(self._sandbox_id))
        return parse_list(ProcessInfo, data, "processes")

    def kill(self, pid: int, signal: int = 9) -> bool:
        """Send `signal` to process `pid`'s group; False if it had exited or is unknown."""
        try:
            data = self._api.call(_base.kill_command(self._sandbox_id, pid, signal))
        except NotFoundError:
            return False
        return bool((data or {}).get("killed", False))

    def send_stdin(self, pid: int, data: str | bytes, eof: bool = False) -> None:
        """Write `data` to process `pid`'s stdin; `eof=True` closes stdin afterwards."""
        self._api.call(_base.send_stdin(self._sandbox_id, pid, data, eof))
