"""``sandlot sandbox shell``: this terminal, attached to a terminal in a sandbox.

The local terminal goes to raw mode (every key goes to the sandbox, Ctrl-C included), its size
follows the window (SIGWINCH), and the remote process's exit status is returned. Input that is
not a terminal (a pipe) is sent as it is, then Ctrl-D.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator

from sandlot.sdk import Sandbox, Terminal

READ_SIZE = 4096


def run_shell(sbx: Sandbox, cmd: str, *, env: dict[str, str] | None = None,
              cwd: str | None = None, user: str = "root") -> int:
    """Run `cmd` on a terminal in `sbx` wired to this process's stdin/stdout; its exit code."""
    stdin = sys.stdin.fileno()
    interactive = os.isatty(stdin)
    cols, rows = _size(stdin if interactive else sys.stdout.fileno())
    env = {"TERM": os.environ.get("TERM") or "xterm-256color", **(env or {})}
    term = sbx.pty.create(cols, rows, cmd=cmd, env=env, cwd=cwd, user=user)
    done = threading.Event()
    result: dict = {}

    def follow() -> None:
        try:
            result["value"] = term.wait(on_data=_write)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            result["error"] = e
        finally:
            done.set()
            os.write(wake_w, b"x")

    wake_r, wake_w = os.pipe()
    resized = threading.Event()
    threading.Thread(target=follow, name="shell-output", daemon=True).start()
    with _raw(stdin, interactive), _on_resize(resized, wake_w):
        _pump_input(stdin, term, done, resized, wake_r, interactive)
    os.close(wake_r)
    os.close(wake_w)
    if "error" in result:
        raise result["error"]
    return result["value"].exit_code


def _pump_input(stdin: int, term: Terminal, done: threading.Event, resized: threading.Event,
                wake_r: int, interactive: bool) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    reading = True
    while not done.is_set():
        ready, _, _ = select.select([stdin, wake_r] if reading else [wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 64)
        if resized.is_set() and not done.is_set():
            resized.clear()
            with contextlib.suppress(Exception):  # it may have just exited
                term.resize(*_size(stdin))
        if reading and stdin in ready:
            data = os.read(stdin, READ_SIZE)
            text = decoder.decode(data, final=not data)
            if not data:
                reading = False
                text += "\x04"  # end of piped input: Ctrl-D, as a terminal says it
            if text and not done.is_set():
                with contextlib.suppress(Exception):
                    term.send_input(text)
            if not data and interactive:
                return


def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        size = shutil.get_terminal_size()
    return max(size.columns, 1), max(size.lines, 1)


def _write(chunk: str) -> None:
    sys.stdout.write(chunk)
    sys.stdout.flush()


@contextlib.contextmanager
def _raw(fd: int, interactive: bool) -> Iterator[None]:
    if not interactive:
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _on_resize(resized: threading.Event, wake_w: int) -> Iterator[None]:
    def handler(_sig: int, _frame: object) -> None:
        resized.set()
        with contextlib.suppress(OSError):
            os.write(wake_w, b"r")

    previous = signal.signal(signal.SIGWINCH, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGWINCH, previous)
