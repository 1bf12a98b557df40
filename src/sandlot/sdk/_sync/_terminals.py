# Generated from src/sandlot/sdk/_async/_terminals.py by scripts/unasync.py; do not edit.
# ruff: noqa: I001
"""Terminals in a sandbox (sync): a shell, or any command, on a pseudo-terminal."""

from __future__ import annotations

from .. import _base
from .._models import CommandResult
from ._commands import CommandHandle, Commands
from ._http import API

DEFAULT_SHELL = "/bin/bash -i -l"


class Terminal(CommandHandle):
    """A process on a terminal: type into it, resize it, follow what it draws.

    A terminal merges its process's stdout and stderr, as a real one does: all its output
    comes as ``stdout`` (with the terminal's control sequences, ``\\r\\n`` line ends and the
    echo of what was typed).
    """

    def __repr__(self) -> str:
        return f"Terminal(sandbox_id={self.sandbox_id!r}, pid={self.pid})"

    def send_input(self, data: str | bytes) -> None:
        """Type `data` (keys as the terminal gets them: ``"\\r"`` is Enter, ``"\\x03"``
        Ctrl-C, ``"\\x04"`` Ctrl-D)."""
        self.send_stdin(data)

    def resize(self, cols: int, rows: int) -> None:
        """Set the terminal's size; its foreground program gets SIGWINCH."""
        self._api.call(_base.resize_terminal(self.sandbox_id, self.pid, cols, rows))

    def wait(self, on_data: _base.OutputCallback | None = None,  # type: ignore[override]
             ) -> CommandResult:
        """Follow the terminal's output (replayed from its start) until its process exits;
        `on_data` gets each chunk. Its result's ``stdout`` is all the output."""
        return super().wait(on_stdout=on_data)


class Terminals:
    """``sbx.pty``: processes on pseudo-terminals, such as an interactive shell."""

    def __init__(self, api: API, sandbox_id: str) -> None:
        self._api = api
        self._sandbox_id = sandbox_id

    def create(self, cols: int = 80, rows: int = 24, *, cmd: str = DEFAULT_SHELL,
               env: dict[str, str] | None = None, cwd: str | None = None,
               user: str = "root", timeout: float | None = None) -> Terminal:
        """Start `cmd` (an interactive login shell by default) on a new `cols` x `rows`
        terminal with ``TERM=xterm-256color``; returns at once.

        `timeout` (seconds; None: none) kills it; it also ends with the sandbox. When its
        process exits, programs it left in the background lose the terminal (SIGHUP).
        """
        req = _base.run_command(self._sandbox_id, cmd, timeout=timeout, env=env, cwd=cwd,
                                user=user, stdin=None, background=True, pty=(cols, rows))
        pid = _base.background_pid(self._api.call(req))
        return Terminal(self._api, self._sandbox_id, pid, cmd)

    def connect(self, pid: int) -> Terminal:
        """A handle for a terminal started earlier (by anyone: see ``commands.list()``)."""
        return Terminal(self._api, self._sandbox_id, pid)

    def send_input(self, pid: int, data: str | bytes) -> None:
        """Type `data` into terminal `pid`."""
        self._api.call(_base.send_stdin(self._sandbox_id, pid, data))

    def resize(self, pid: int, cols: int, rows: int) -> None:
        """Set terminal `pid`'s size."""
        self._api.call(_base.resize_terminal(self._sandbox_id, pid, cols, rows))

    def kill(self, pid: int, signal: int = 9) -> bool:
        """Signal the process group on terminal `pid`; False if it had already exited."""
        return Commands(self._api, self._sandbox_id).kill(pid, signal)
