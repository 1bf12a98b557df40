"""sandlot guest agent: runs inside the VM (stdlib only) and serves the host over virtio-serial.

See docs/guest-protocol.md. One host session at a time; a new ``hello`` starts a new session
(the old one's subscriptions and open uploads are dropped; processes keep running and keep
buffering their output, so a new session can ``attach`` to them).
"""

from __future__ import annotations

import base64
import concurrent.futures
import ctypes
import errno
import fcntl
import gc
import glob
import grp
import json
import os
import pwd
import select
import shutil
import signal
import stat as statmod
import struct
import subprocess
import sys
import termios
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import OPS, PROTO_VERSION  # noqa: E402
from wire import CHUNK_SIZE, MAX_HEADER, FrameDecoder, FrameError, encode  # noqa: E402

PORT_NAME = "org.sandlot.agent"
CAPS = ["exec", "attach", "stdin", "files", "restore", "cpus", "step_clock", "read_credit",
        "list_limit", "output_credit", "pty", "file_metadata"]
# A `read` with `window` sends at most that many data chunks ahead of the host's `credit`
# frames, so a slow consumer of one file holds back that file only, not the whole link; an
# `exec` or `attach` with `window` does the same for a process's output (its pipe fills and
# the process waits, as it would writing to a slow terminal).
CREDIT_TIMEOUT = 120.0  # s without credit: the host is gone; stop reading
# Why: output of a process nobody listens to (background, or host away) is kept for a later
# attach, but never more than this per process; the oldest chunks are dropped first.
MAX_BUFFERED_OUTPUT = 8 << 20
MAX_FINISHED = 256
TERMINAL_DRAIN = 2.0  # s a terminal's last output may take to arrive after its process ended
# Why: a `list` answer is one frame header (at most MAX_HEADER): stop walking well before it.
MAX_LIST_ENTRIES = 100000
LIST_REPLY_BYTES = MAX_HEADER - (64 << 10)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RUN_DIR = "/run/sandlot"
METADATA_PREFIX = "user.e2b."  # a file's user metadata: extended attributes, as E2B keeps them

# Requests and output pumps run on long-lived threads: starting a thread per request costs a
# lot under emulation, and threads that exist when a template is snapshotted are reused by
# every sandbox restored from it.
POOL = concurrent.futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="agent")

RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207


class AgentError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def find_port() -> str:
    for name_file in glob.glob("/sys/class/virtio-ports/*/name"):
        with open(name_file) as f:
            if f.read().strip() == PORT_NAME:
                return "/dev/" + os.path.basename(os.path.dirname(name_file))
    raise RuntimeError("agent port not found")


class Channel:
    """The virtio-serial port, non-blocking: writes under a lock, reads in the main loop.

    A read of the port returns at most one 4 KiB virtqueue buffer, so the reader uses readv
    with many buffers: one system call drains everything the host has queued (the port is
    non-blocking, so readv stops at the first empty buffer instead of waiting).
    """

    READ_BUFFERS = 256

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._lock = threading.Lock()
        self._out = select.poll()
        self._out.register(self.fd, select.POLLOUT)
        self._in = select.poll()
        self._in.register(self.fd, select.POLLIN)
        self._bufs = [bytearray(4096) for _ in range(self.READ_BUFFERS)]

    def send(self, header: dict, payload: bytes = b"") -> None:
        data = memoryview(encode(header, payload))
        with self._lock:
            while data:
                try:
                    n = os.write(self.fd, data)
                except InterruptedError:
                    continue
                except BlockingIOError:
                    self._out.poll(100)
                    continue
                except OSError:
                    time.sleep(0.005)  # host away: wait for it to come back
                    continue
                data = data[n:]

    def recv(self) -> bytes:
        """Whatever the host has sent; b"" when no host is connected."""
        while True:
            self._in.poll(1000)
            try:
                n = os.readv(self.fd, self._bufs)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return b""
            full, rest = divmod(n, 4096)
            data = b"".join(self._bufs[:full])
            if rest:
                data += bytes(self._bufs[full][:rest])
            return data


class Proc:
    """A process started by exec, with its buffered output and its subscribers."""

    def __init__(self, agent: Agent, popen: subprocess.Popen, cmd: str, user: str,
                 master: int | None = None) -> None:
        self.agent = agent
        self.popen = popen
        self.master = master  # a terminal's master side: its input, output and size
        self.hung_up = False  # set once the process ended: the terminal's pump stops
        self.exited = threading.Event()  # its process has been waited for
        self.pid = popen.pid
        self.cmd = cmd
        self.user = user
        self.started = time.time()
        self.chunks: list[tuple[str, bytes]] = []
        self.buffered = 0
        self.truncated = False
        self.exit_code: int | None = None
        self.timed_out = False
        self.done = False
        self.subscribers: set[int] = set()
        self.credits: dict[int, ReadCredits] = {}  # subscribers that asked for a window
        self.waiting = 0  # output pumps waiting for a subscriber's credit
        self.lock = threading.Lock()

    def emit(self, stream: str, data: bytes) -> None:
        with self.lock:
            self.chunks.append((stream, data))
            self.buffered += len(data)
            while self.buffered > MAX_BUFFERED_OUTPUT and self.chunks:
                self.buffered -= len(self.chunks.pop(0)[1])
                self.truncated = True
            subs = [(rid, self.credits.get(rid)) for rid in self.subscribers]
        for rid, credits in subs:
            self.send(rid, credits, stream, data)

    def send(self, rid: int, credits: ReadCredits | None, stream: str, data: bytes) -> bool:
        """One output event to one subscriber, after its credit if it has a window (the
        calling pump, and so the process's pipe, waits for it)."""
        if credits is not None:
            with self.lock:
                self.waiting += 1
            try:
                ok = credits.take()
            finally:
                with self.lock:
                    self.waiting -= 1
            if not ok:
                self.unsubscribe(rid, credits)
                return False
        self.agent.chan.send({"id": rid, "event": stream}, data)
        return True

    def unsubscribe(self, rid: int, credits: ReadCredits) -> None:
        with self.lock:
            if rid not in self.subscribers:
                return
            self.subscribers.discard(rid)
            self.credits.pop(rid, None)
        self.agent.reads.pop(rid, None)
        if not credits.cancelled:  # the host went quiet rather than said it stopped
            self.agent.reply_error(rid, "internal", "output not consumed for "
                                   f"{CREDIT_TIMEOUT:.0f}s; the stream was dropped")

    def finish(self, exit_code: int) -> None:
        with self.lock:
            self.exit_code = exit_code
            self.done = True
            subs = list(self.subscribers)
            self.subscribers.clear()
            self.credits.clear()
        for rid in subs:
            self.agent.reads.pop(rid, None)
            self.agent.chan.send({"id": rid, "event": "exit", **self.result()})

    def result(self) -> dict:
        return {"exit_code": self.exit_code, "timed_out": self.timed_out, "pid": self.pid}

    def subscribe(self, rid: int, replay: bool, credits: ReadCredits | None = None) -> None:
        with self.lock:
            chunks = list(self.chunks) if replay else []
            done = self.done
            if not done:
                self.subscribers.add(rid)
                if credits is not None:
                    self.credits[rid] = credits
        for stream, data in chunks:
            if not self.send(rid, credits, stream, data):
                return
        if done:
            self.agent.reads.pop(rid, None)
            self.agent.chan.send({"id": rid, "event": "exit", **self.result()})

    def info(self) -> dict:
        return {
            "pid": self.pid,
            "cmd": self.cmd,
            "user": self.user,
            "running": not self.done,
            "exit_code": self.exit_code,
            "started_at": self.started,
            "pty": self.master is not None,
        }


class ReadCredits:
    """How many chunks a windowed read may still send; the host gives more as it consumes."""

    def __init__(self, window: int) -> None:
        self.available = window
        self.cancelled = False
        self.cond = threading.Condition()

    def take(self) -> bool:
        """Wait for a credit and use it; False if the host cancelled or went quiet."""
        with self.cond:
            ok = self.cond.wait_for(lambda: self.available > 0 or self.cancelled,
                                    CREDIT_TIMEOUT)
            if not ok or self.cancelled:
                return False
            self.available -= 1
            return True

    def give(self, n: int) -> None:
        with self.cond:
            if n < 0:
                self.cancelled = True
            else:
                self.available += n
            self.cond.notify()


class Agent:
    def __init__(self, chan: Channel) -> None:
        self.chan = chan
        self.procs: dict[int, Proc] = {}
        self.procs_lock = threading.Lock()
        self.env: dict[str, str] = {}
        self.generation = "0"
        self.uploads: dict[int, tuple] = {}
        self.reads: dict[int, ReadCredits] = {}
        self.configure_lock = threading.Lock()
        # One handler per op of the protocol, and none it does not have.
        self.handlers = {name: getattr(self, "op_" + name) for name in OPS}
        extra = {n[3:] for n in dir(self) if n.startswith("op_")} - set(OPS)
        if extra:
            raise RuntimeError(f"agent handlers outside the protocol: {sorted(extra)}")

    # ---- dispatch -------------------------------------------------------------------------

    def handle(self, header: dict, payload: bytes) -> None:
        rid = header.get("id")
        op = header.get("op")
        if not isinstance(rid, int):
            return
        if rid in self.uploads and op in ("chunk", "end"):
            self.upload_frame(rid, op, payload)
            return
        if op == "credit":
            self.credit(rid, int(header.get("n", 0)))
            return
        fn = self.handlers.get(op)
        if fn is None:
            self.reply_error(rid, "invalid", f"unknown op {op!r}")
            return
        if op in ("hello", "write", "ping"):
            self.run(fn, rid, header, payload)
        else:
            POOL.submit(self.run, fn, rid, header, payload)

    def run(self, fn, rid: int, header: dict, payload: bytes) -> None:
        try:
            result = fn(rid, header, payload)
        except AgentError as e:
            self.reply_error(rid, e.kind, str(e))
        except FileNotFoundError as e:
            self.reply_error(rid, "not_found", f"{e.filename or ''}: no such file or directory")
        except PermissionError as e:
            self.reply_error(rid, "permission", f"{e.filename or ''}: permission denied")
        except (IsADirectoryError, NotADirectoryError, FileExistsError, OSError) as e:
            self.reply_error(rid, "invalid", f"{e.filename or ''}: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001 - the agent must survive anything a request does
            self.reply_error(rid, "internal", f"{type(e).__name__}: {e}")
        else:
            if result is not None:
                try:
                    self.chan.send({"id": rid, "ok": True, **result})
                except FrameError:  # an answer too large for a frame: say so, don't go silent
                    self.reply_error(rid, "invalid", "the answer is too large for one frame")

    def reply_error(self, rid: int, kind: str, message: str) -> None:
        self.chan.send({"id": rid, "error": {"type": kind, "message": message[:4000]}})

    # ---- session --------------------------------------------------------------------------

    def op_hello(self, rid, h, _p):
        with self.procs_lock:
            for proc in self.procs.values():
                with proc.lock:
                    proc.subscribers.clear()
                    proc.credits.clear()
        self.uploads.clear()
        for credits in list(self.reads.values()):  # the reader of the old session is gone
            credits.give(-1)
        self.reads.clear()
        return {
            "hello": {"proto": PROTO_VERSION, "caps": CAPS, "nonce": h.get("nonce")},
            "generation": self.generation,
        }

    def op_ping(self, rid, h, _p):
        return {"time_ns": time.time_ns()}

    def op_step_clock(self, rid, h, _p):
        """Move the wall clock by `delta_ns` (the host measured the offset around a ping)."""
        with self.configure_lock:
            time.clock_settime_ns(time.CLOCK_REALTIME, time.time_ns() + int(h["delta_ns"]))
        return {"time_ns": time.time_ns()}

    def op_configure(self, rid, h, _p):
        """Set the clock, reseed the RNG, update the env and CPUs: sent after boot and restore.

        The host may send it twice (it re-sends with an unanswered hello): one at a time.
        """
        with self.configure_lock:
            return self._configure(h)

    def _configure(self, h):
        if "time_ns" in h:
            time.clock_settime_ns(time.CLOCK_REALTIME, int(h["time_ns"]))
        if h.get("entropy"):
            reseed(base64.b64decode(h["entropy"]))
        if "env" in h and isinstance(h["env"], dict):
            self.env = {str(k): str(v) for k, v in h["env"].items()}
        if h.get("generation") is not None:
            self.generation = str(h["generation"])
            os.makedirs(RUN_DIR, exist_ok=True)
            tmp = f"{RUN_DIR}/generation.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(self.generation + "\n")
            os.replace(tmp, RUN_DIR + "/generation")
        if h.get("freeze"):
            # Copy-on-write hygiene for restores: the cyclic GC writes to every object it
            # tracks, which would copy most of the agent's heap into each restored sandbox.
            gc.collect()
            gc.freeze()
        if h.get("cpus"):
            set_online_cpus(int(h["cpus"]))
            return {"time_ns": time.time_ns(), "cpus": os.cpu_count(), "mem_kb": mem_total_kb()}
        return {"time_ns": time.time_ns()}

    # ---- processes ------------------------------------------------------------------------

    def op_exec(self, rid, h, payload):
        cmd = h.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            raise AgentError("invalid", "cmd must be a non-empty string")
        user = h.get("user") or "root"
        try:
            pw = pwd.getpwnam(user)
        except KeyError:
            raise AgentError("invalid", f"no such user: {user}") from None
        size = h.get("pty")
        if size is not None and not isinstance(size, dict):
            raise AgentError("invalid", "pty must be an object with cols and rows")
        env = {
            "PATH": DEFAULT_PATH,
            "HOME": pw.pw_dir,
            "USER": pw.pw_name,
            "LOGNAME": pw.pw_name,
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
            "SANDLOT_GENERATION": self.generation,
        }
        if size is not None:
            env["TERM"] = "xterm-256color"
        env.update(self.env)
        env.update({str(k): str(v) for k, v in (h.get("env") or {}).items()})
        cwd = h.get("cwd") or pw.pw_dir
        if not os.path.isdir(cwd):
            raise AgentError("invalid", f"cwd {cwd}: not a directory")
        stdin_data = payload if h.get("stdin") else None
        identity = {}
        if pw.pw_uid != os.getuid():  # only then: without them Popen can use vfork (faster)
            identity = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": [
                g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem]}
        master = None
        if size is None:
            popen = subprocess.Popen(
                ["/bin/bash", "-c", cmd],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                **identity,
            )
        else:
            master, popen = spawn_on_terminal(cmd, cwd, env, identity, size)
        proc = Proc(self, popen, cmd, user, master)
        if h.get("track", True):  # the host's own warm-up runs are not listed
            with self.procs_lock:
                self.procs[proc.pid] = proc
                self.trim_finished()
        if h.get("stream", True):
            proc.subscribers.add(rid)
            window = int(h.get("window") or 0)
            if window > 0:
                proc.credits[rid] = self.reads[rid] = ReadCredits(window)
        self.chan.send({"id": rid, "ok": True, "pid": proc.pid, "event": "start"})
        if master is not None:
            readers = [POOL.submit(pump_terminal, proc)]
            if stdin_data:
                write_all(master, stdin_data)
        else:
            readers = [POOL.submit(pump, popen.stdout, proc, "stdout"),
                       POOL.submit(pump, popen.stderr, proc, "stderr")]
            if stdin_data is not None:
                POOL.submit(feed_stdin, popen, stdin_data, True)
            elif not h.get("keep_stdin"):
                popen.stdin.close()
        timeout = h.get("timeout")
        try:
            code = popen.wait(float(timeout) if timeout else None)
        except subprocess.TimeoutExpired:
            proc.timed_out = True
            kill_group(proc.pid, signal.SIGKILL)
            code = popen.wait()
        # A backgrounded grandchild may hold the pipes open: don't wait for it; but do wait
        # for output that only waits for the host's credit (it comes before the exit).
        proc.exited.set()
        # A terminal's output drains through one more hop (the line discipline): give it
        # longer, unless background jobs keep the terminal open.
        until = time.monotonic() + (TERMINAL_DRAIN if master is not None else 0.2)
        while True:
            _, pending = concurrent.futures.wait(readers, timeout=0.2)
            if not pending or (not proc.waiting and time.monotonic() >= until):
                break
        proc.hung_up = True  # a terminal's background jobs no longer hold its output open
        proc.finish(code)
        return None

    def trim_finished(self) -> None:
        finished = [p for p in self.procs.values() if p.done]
        for p in finished[: max(0, len(finished) - MAX_FINISHED)]:
            del self.procs[p.pid]

    def get_proc(self, h) -> Proc:
        with self.procs_lock:
            proc = self.procs.get(h.get("pid"))
        if proc is None:
            raise AgentError("not_found", f"no process {h.get('pid')}")
        return proc

    def op_attach(self, rid, h, _p):
        proc = self.get_proc(h)
        window = int(h.get("window") or 0)
        credits = None
        if window > 0:
            credits = self.reads[rid] = ReadCredits(window)
        proc.subscribe(rid, replay=bool(h.get("replay", True)), credits=credits)
        return None

    def op_stdin(self, rid, h, payload):
        proc = self.get_proc(h)
        if proc.done:
            raise AgentError("invalid", f"process {proc.pid} has exited")
        if proc.master is not None:
            write_all(proc.master, payload + (b"\x04" if h.get("eof") else b""))
        else:
            feed_stdin(proc.popen, payload, bool(h.get("eof")))
        return {}

    def op_resize(self, rid, h, _p):
        proc = self.get_proc(h)
        if proc.master is None:
            raise AgentError("invalid", f"process {proc.pid} has no terminal")
        if proc.done:
            raise AgentError("invalid", f"process {proc.pid} has exited")
        set_window_size(proc.master, h)  # the kernel sends SIGWINCH to its foreground group
        return {}

    def op_kill(self, rid, h, _p):
        proc = self.get_proc(h)
        sig = int(h.get("signal") or signal.SIGKILL)
        running = not proc.done  # read before signalling: it may exit at once
        if running:
            kill_group(proc.pid, sig)
        return {"killed": running}

    def op_ps(self, rid, h, _p):
        with self.procs_lock:
            procs = [p.info() for p in self.procs.values()]
        if not h.get("all"):
            procs = [p for p in procs if p["running"]]
        return {"processes": procs}

    # ---- files ----------------------------------------------------------------------------

    def op_read(self, rid, h, _p):
        path = need_path(h)
        if os.path.isdir(path):
            raise AgentError("invalid", f"{path}: is a directory")
        window = int(h.get("window") or 0)
        credits = ReadCredits(window) if window > 0 else None
        if credits is not None:
            self.reads[rid] = credits
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.chan.send({"id": rid, "event": "begin", "size": size})
                while True:
                    if credits is not None and not credits.take():
                        raise AgentError("invalid", "read cancelled by the host")
                    chunk = f.read(CHUNK_SIZE)
                    if not chunk:
                        break
                    self.chan.send({"id": rid, "event": "data"}, chunk)
        finally:
            self.reads.pop(rid, None)
        return {"end": True}

    def credit(self, rid: int, n: int) -> None:
        """The host consumed `n` chunks of read `rid` (n < 0: it stopped reading)."""
        credits = self.reads.get(rid)
        if credits is not None:
            credits.give(n)

    def op_write(self, rid, h, payload):
        path = need_path(h)
        if os.path.isdir(path):
            raise AgentError("invalid", f"{path}: is a directory")
        owner = user_ids(h.get("user"))
        make_dirs(os.path.dirname(path) or "/", owner)
        tmp = f"{path}.sandlot-{rid}.tmp"
        f = open(tmp, "wb")
        if payload:
            f.write(payload)
        metadata = h.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise AgentError("invalid", "metadata must be an object of strings")
        self.uploads[rid] = (f, tmp, path, owner, h.get("mode"), metadata)
        if h.get("eof"):
            self.upload_frame(rid, "end", b"")
        return None

    def upload_frame(self, rid: int, op: str, payload: bytes) -> None:
        f, tmp, path, owner, mode, metadata = self.uploads[rid]
        try:
            if op == "chunk":
                f.write(payload)
                return
            del self.uploads[rid]
            f.close()
            if mode is not None:
                os.chmod(tmp, int(mode))
            if owner:
                os.chown(tmp, *owner)
            # A new file each time: an overwrite replaces the whole metadata set.
            write_metadata(tmp, metadata)
            os.replace(tmp, path)
            self.chan.send({"id": rid, "ok": True, **entry(path)})
        except OSError as e:
            self.uploads.pop(rid, None)
            f.close()
            if os.path.exists(tmp):
                os.unlink(tmp)
            self.reply_error(rid, "invalid", f"{path}: {e.strerror or e}")

    def op_list(self, rid, h, _p):
        path = need_path(h)
        depth = max(1, int(h.get("depth") or 1))
        limit = min(MAX_LIST_ENTRIES, max(1, int(h.get("max_entries") or MAX_LIST_ENTRIES)))
        if not os.path.isdir(path):
            if not os.path.exists(path):
                raise FileNotFoundError(2, "not found", path)
            raise AgentError("invalid", f"{path}: not a directory")
        out = []
        self._walk(path, depth, out, [0], limit)
        return {"entries": out}

    def _walk(self, path, depth, out, size, limit):
        try:
            names = sorted(os.listdir(path))
        except (PermissionError, NotADirectoryError, FileNotFoundError):
            return
        for name in names:
            full = os.path.join(path, name)
            try:
                e = entry(full)
            except OSError:
                continue
            out.append(e)
            size[0] += len(json.dumps(e, separators=(",", ":"))) + 1
            if len(out) > limit or size[0] > LIST_REPLY_BYTES:
                raise AgentError("invalid", f"listing too large: more than {len(out) - 1} "
                                 "entries; list a subdirectory or a smaller depth")
            if depth > 1 and e["type"] == "dir":
                self._walk(full, depth - 1, out, size, limit)

    def op_stat(self, rid, h, _p):
        return entry(need_path(h))

    def op_exists(self, rid, h, _p):
        return {"exists": os.path.lexists(need_path(h))}

    def op_remove(self, rid, h, _p):
        path = need_path(h)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}

    def op_mkdir(self, rid, h, _p):
        path = need_path(h)
        existed = os.path.isdir(path)
        make_dirs(path, user_ids(h.get("user")))
        return {"created": not existed, **entry(path)}

    def op_rename(self, rid, h, _p):
        src = need_path(h, "src")
        dst = need_path(h, "dst")
        os.rename(src, dst)
        return entry(dst)


# ---- helpers ------------------------------------------------------------------------------


def pump(pipe, proc: Proc, stream: str) -> None:
    fd = pipe.fileno()
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        proc.emit(stream, data)
    pipe.close()


def spawn_on_terminal(cmd: str, cwd: str, env: dict, identity: dict, size: dict
                      ) -> tuple[int, subprocess.Popen]:
    """Start `cmd` in a new session whose controlling terminal is a new pseudo-terminal;
    returns the master side and the process."""
    master, slave = os.openpty()
    try:
        set_window_size(master, size)
        popen = subprocess.Popen(
            ["/bin/bash", "-c", cmd], stdin=slave, stdout=slave, stderr=slave, cwd=cwd,
            env=env, start_new_session=True, close_fds=True,
            # Runs in the child after setsid: the terminal becomes its controlling one. The
            # only Python run between fork and exec, and only for terminals.
            preexec_fn=take_terminal, **identity)
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return master, popen


def take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def set_window_size(fd: int, size: dict) -> None:
    cols, rows = size.get("cols"), size.get("rows")
    if not (isinstance(cols, int) and isinstance(rows, int) and 0 < cols <= 4096
            and 0 < rows <= 4096):
        raise AgentError("invalid", "a terminal's cols and rows are integers from 1 to 4096")
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def pump_terminal(proc: Proc) -> None:
    """A terminal's output until every process on it is gone (EIO) or its first process
    ended (`hung_up`: background jobs then lose the terminal); closes the master side."""
    fd = proc.master
    try:
        while not proc.hung_up:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: no process has the terminal open
                break
            if not data:
                break
            proc.emit("stdout", data)
    finally:
        # Closing the master hangs the terminal up: SIGHUP to its session. A process that
        # closed its stdio (EIO above) may still be running its last code: wait for it.
        proc.exited.wait()
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except OSError:  # the terminal is gone
            return


def feed_stdin(popen: subprocess.Popen, data: bytes, eof: bool) -> None:
    try:
        if data:
            popen.stdin.write(data)
            popen.stdin.flush()
        if eof:
            popen.stdin.close()
    except (BrokenPipeError, ValueError, OSError):
        pass


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def need_path(h: dict, key: str = "path") -> str:
    path = h.get(key)
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise AgentError("invalid", f"{key} must be an absolute path")
    return os.path.normpath(path)


def user_ids(user) -> tuple[int, int] | None:
    if not user or user == "root":
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise AgentError("invalid", f"no such user: {user}") from None
    return pw.pw_uid, pw.pw_gid


def make_dirs(path: str, owner) -> None:
    missing = []
    p = path
    while p and not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d)
        if owner:
            os.chown(d, *owner)


def entry(path: str) -> dict:
    st = os.lstat(path)
    if statmod.S_ISDIR(st.st_mode):
        kind = "dir"
    elif statmod.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif statmod.S_ISREG(st.st_mode):
        kind = "file"
    else:
        kind = "other"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    out = {
        "name": os.path.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": statmod.S_IMODE(st.st_mode),
        "owner": owner,
        "mtime": st.st_mtime,
    }
    if kind == "symlink":
        out["target"] = os.readlink(path)
    else:
        metadata = read_metadata(path)
        if metadata:
            out["metadata"] = metadata
    return out


def write_metadata(path: str, metadata: dict) -> None:
    """User metadata as `user.e2b.<key>` extended attributes (E2B's envd keeps it so); a
    file system without user xattrs (tmpfs before Linux 6.6) keeps none, and the answer's
    entry, read back, says so."""
    for key, value in metadata.items():
        try:
            os.setxattr(path, METADATA_PREFIX + str(key).lower(), str(value).encode())
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                return
            raise


def read_metadata(path: str) -> dict:
    try:
        names = [n for n in os.listxattr(path, follow_symlinks=False)
                 if n.startswith(METADATA_PREFIX)]
        return {n[len(METADATA_PREFIX):]: os.getxattr(path, n, follow_symlinks=False)
                .decode(errors="replace") for n in names}
    except OSError:
        return {}


def reseed(entropy: bytes) -> None:
    """Mix host entropy into the kernel CRNG and force a reseed (forks share RNG state)."""
    words = (len(entropy) + 3) // 4
    buf = struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy.ljust(words * 4, b"\0")
    arr = ctypes.create_string_buffer(buf, len(buf))
    fd = os.open("/dev/random", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, arr)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)


def set_online_cpus(count: int) -> None:
    """Online CPUs 0..count-1 and offline the rest (cpu0 is always online)."""
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/online"):
        index = int(path.split("/")[-2][3:])
        want = "1" if index < count else "0"
        try:
            with open(path) as f:
                if f.read().strip() == want:
                    continue
            with open(path, "w") as f:
                f.write(want)
        except OSError:
            pass


def mem_total_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    chan = Channel(find_port())
    agent = Agent(chan)
    decoder = FrameDecoder()
    while True:
        data = chan.recv()
        if not data:
            # No host connected: the port reads EOF until one connects. Drop partial input.
            decoder.reset()
            time.sleep(0.005)
            continue
        for header, payload in decoder.feed(data):
            agent.handle(header, payload)


if __name__ == "__main__":
    main()
