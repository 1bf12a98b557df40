"""Terminals against real VMs: `sbx.pty` (a shell on a pseudo-terminal: input, size, Ctrl-C,
exit status, reconnect) and `sandlot sandbox shell` driven through a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from sandlot import AsyncSandbox, InvalidArgumentError, NotFoundError, Sandbox

PROMPT = r"root@sandlot:.*# "


@pytest.fixture(scope="module")
def sbx(server):
    box = Sandbox.create(timeout=900, metadata={"suite": "test_terminal"})
    yield box
    box.kill()


class Screen:
    """What a terminal has drawn so far, filled by its `wait` in a thread."""

    def __init__(self, term) -> None:
        self.chunks: list[str] = []
        self.result = None
        self.thread = threading.Thread(target=self._follow, args=(term,), daemon=True)
        self.thread.start()

    def _follow(self, term) -> None:
        self.result = term.wait(on_data=self.chunks.append)

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text)
            if m:
                return m
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not drawn in {timeout}s; screen: {self.text[-2000:]!r}")

    def done(self, timeout: float = 60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the terminal's process did not exit"
        return self.result


def test_shell_on_a_terminal_input_size_ctrl_c_and_exit_status(sbx):
    term = sbx.pty.create(cols=100, rows=30, env={"MARK": "m4rk"})
    screen = Screen(term)
    screen.expect(PROMPT)  # a shell starting up drops what was typed ahead of it
    term.send_input("echo $((6*7))-$MARK-$TERM; tty; stty size\r")
    screen.expect(r"42-m4rk-xterm-256color")
    screen.expect(r"/dev/pts/\d+")
    screen.expect(r"30 100")
    info = next(p for p in sbx.commands.list() if p.pid == term.pid)
    assert info.pty and info.running

    term.resize(132, 43)
    term.send_input("stty size\r")
    screen.expect(r"43 132")

    term.send_input("sleep 600\r")
    time.sleep(1)
    term.send_input("\x03")  # Ctrl-C reaches the foreground job, not the shell
    term.send_input("echo after-$?\r")
    screen.expect(r"after-130")

    term.send_input("exit 3\r")
    result = screen.done()
    assert result.exit_code == 3
    assert "after-130" in result.stdout  # the whole output, replayed


def test_reconnect_replays_and_input_goes_on(sbx):
    term = sbx.pty.create(cmd="cat", cols=80, rows=24)
    term.send_input("first line\r")
    again = sbx.pty.connect(term.pid)
    screen = Screen(again)
    screen.expect(r"first line\r\n(.|\n)*first line")  # the echo, then cat's copy
    again.send_input("second\r")
    screen.expect(r"second\r\n(.|\n)*second")
    again.send_input("\x04")  # Ctrl-D: end of input for cat
    assert screen.done().exit_code == 0


def test_terminal_errors(sbx):
    with pytest.raises(InvalidArgumentError, match="cols"):
        sbx.pty.create(cols=0, rows=24)
    plain = sbx.commands.start("sleep 30")
    try:
        with pytest.raises(InvalidArgumentError, match="no terminal"):
            sbx.pty.resize(plain.pid, 80, 24)
    finally:
        plain.kill()
    with pytest.raises(NotFoundError):
        sbx.pty.resize(999999, 80, 24)
    term = sbx.pty.create(cmd="true")
    assert term.wait().exit_code == 0
    with pytest.raises(InvalidArgumentError, match="exited"):
        term.send_input("late\r")


async def test_async_terminal(sbx):
    box = await AsyncSandbox.connect(sbx.sandbox_id)
    try:
        term = await box.pty.create(cmd="read x; echo got-$x; exit 5", cols=40, rows=10)
        await term.send_input("value\r")
        result = await term.wait()
        assert result.exit_code == 5 and "got-value" in result.stdout
    finally:
        await box.aclose()


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def test_cli_shell_through_a_real_terminal(server, sbx):
    """`sandlot sandbox shell` in a pseudo-terminal, as a user runs it: raw mode, keys,
    the window's size and its changes, and the remote shell's exit status."""
    master, slave = pty.openpty()
    _set_size(slave, 33, 111)
    env = {**os.environ, "SANDLOT_URL": server.url, "SANDLOT_API_KEY": server.key,
           "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "-m", "sandlot.cli", "sandbox", "shell",
                             sbx.sandbox_id], stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True, close_fds=True,
                            # its controlling terminal, as a login gives one: window changes
                            # reach it as SIGWINCH
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    seen = bytearray()

    def expect(pattern: bytes, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, seen):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen; got {bytes(seen[-2000:])!r}")
            ready, _, _ = select.select([master], [], [], min(left, 0.5))
            if ready:
                try:
                    seen.extend(os.read(master, 65536))
                except OSError:
                    break

    try:
        expect(PROMPT.encode())  # a shell starting up drops what was typed ahead of it
        os.write(master, b"echo $((7*6))x; stty size\r")
        expect(rb"42x")
        expect(rb"33 111")
        _set_size(master, 50, 160)  # the window changed: the CLI gets SIGWINCH
        time.sleep(0.5)
        os.write(master, b"stty size\r")
        expect(rb"50 160")
        os.write(master, b"exit 7\r")
        assert proc.wait(60) == 7
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
