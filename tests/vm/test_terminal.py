"""Terminals against real VMs: `sbx.pty` (a shell on a pseudo-terminal: input, size, Ctrl-C,
exit status, reconnect), `sandlot sandbox shell` driven through a real pseudo-terminal, and
the terminal WebSocket (`GET /v1/sandboxes/{id}/pty`) through a real WebSocket client."""

from __future__ import annotations

import fcntl
import json
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
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

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


def _socket(server, sandbox_id: str) -> ClientConnection:
    return connect(server.url.replace("http", "ws", 1) + f"/v1/sandboxes/{sandbox_id}/pty",
                   open_timeout=60)


def _drawn(ws: ClientConnection, pattern: bytes, seen: bytearray, timeout: float = 90
           ) -> None:
    """Read output frames into `seen` until `pattern` is in it."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, seen):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{pattern!r} not drawn; got {bytes(seen[-2000:])!r}")
        try:
            frame = ws.recv(timeout=left)
        except TimeoutError:
            continue
        assert isinstance(frame, bytes), frame  # no control message before the exit
        seen.extend(frame)


def test_a_terminal_over_a_websocket(server, sbx):
    """The key in the first message; keys and output as binary frames, a resize as a text
    frame; the shell's exit comes as a message, then the close."""
    with _socket(server, sbx.sandbox_id) as ws:
        ws.send(json.dumps({"api_key": server.key, "cols": 90, "rows": 20,
                            "env": {"MARK": "w5"}}))
        start = json.loads(ws.recv(timeout=60))
        assert start["type"] == "start"
        seen = bytearray()
        _drawn(ws, PROMPT.encode(), seen)  # a shell starting up drops what was typed ahead
        ws.send(b"echo hi-$MARK; stty size\r")
        _drawn(ws, rb"hi-w5", seen)
        _drawn(ws, rb"20 90", seen)
        info = next(p for p in sbx.commands.list() if p.pid == start["pid"])
        assert info.pty and info.running
        ws.send(json.dumps({"type": "resize", "cols": 132, "rows": 43}))
        ws.send(b"stty size\r")
        _drawn(ws, rb"43 132", seen)
        ws.send(b"exit 4\r")
        while isinstance(last := ws.recv(timeout=60), bytes):  # the rest of the output
            pass
        assert json.loads(last) == {"type": "exit", "exit_code": 4}
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=60)
    assert ws.close_code == 1000


def _refusal(server, sandbox_id: str, first: str) -> tuple[int | None, dict]:
    with _socket(server, sandbox_id) as ws:
        ws.send(first)
        said = json.loads(ws.recv(timeout=60))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=60)
    assert said["type"] == "error"
    return ws.close_code, said["error"]


def test_a_websocket_terminal_needs_a_key_of_the_sandboxs_tenant(server, sbx):
    running = {p.pid for p in sbx.commands.list()}
    for first in (json.dumps({"api_key": "sl_not_a_key", "cols": 80, "rows": 24}),
                  json.dumps({"cols": 80, "rows": 24})):
        code, error = _refusal(server, sbx.sandbox_id, first)
        assert code == 1008 and error["type"] == "AuthenticationError", error
    other = subprocess.run([sys.executable, "-m", "sandlot.cli", "keys", "create", "--tenant",
                            "pty-other", "--data-dir", str(server.data_dir)], env=server.env,
                           capture_output=True, text=True, check=True).stdout.strip()
    code, error = _refusal(server, sbx.sandbox_id, json.dumps({"api_key": other}))
    assert code == 4404 and error["type"] == "NotFoundError", error  # as a missing one
    assert {p.pid for p in sbx.commands.list()} == running  # no shell started for any

