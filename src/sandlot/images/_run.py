"""Subprocess helper for image builds: run a command, raise BuildError with its output tail."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from sandlot.errors import BuildError


def run(cmd: Sequence[str], *, cwd: str | None = None, env: dict | None = None,
        input: bytes | None = None) -> str:
    proc = subprocess.run(list(cmd), cwd=cwd, env=env, input=input, capture_output=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode(errors="replace")[-3000:]
        raise BuildError(f"{cmd[0]} failed (exit {proc.returncode}): {tail}")
    return proc.stdout.decode(errors="replace")
