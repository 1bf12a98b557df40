"""Errors only the SDK raises. They sit in the tree of `sandlot.errors`::

    SandlotError
    ├── CommandExitError        check=True and the command exited non-zero (has .result)
    ├── WaitTimeoutError        a client-side wait (e.g. Snapshot.wait) ran out of time
    └── SandboxError
        └── SnapshotFailedError a snapshot ended in state failed (or was deleted) while waited on

Connection problems (refused, timed out, dropped) are raised as plain `SandlotError` with the
httpx exception as ``__cause__``; no httpx exception escapes the SDK.
"""

from __future__ import annotations

from sandlot.errors import SandboxError, SandlotError

from ._models import CommandResult


class CommandExitError(SandlotError):
    """A command run with ``check=True`` exited with a non-zero code."""

    def __init__(self, result: CommandResult, cmd: str = "") -> None:
        tail = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
        message = f"command exited with code {result.exit_code}"
        if cmd:
            message = f"command {cmd!r} exited with code {result.exit_code}"
        if tail:
            message += f": {tail[0]}"
        super().__init__(message)
        self.result = result
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr


class SnapshotFailedError(SandboxError):
    """A snapshot that was being waited on ended in state ``failed`` or ``deleted``."""

    def __init__(self, message: str = "", *, snapshot_id: str | None = None) -> None:
        super().__init__(message)
        self.snapshot_id = snapshot_id


class WaitTimeoutError(SandlotError):
    """A client-side wait ran past its timeout; the server-side operation may still finish."""

    status = 504
