"""The fake runtime's guest (runtime/fake.py): an in-memory file system and a tiny shell,
``echo`` (with ``$VARS``, ``-n``, ``>&2``, ``> file`` and ``>> file``), ``cat [file]`` (stdin
without one), ``printenv NAME``, ``pwd``, ``whoami``, ``sleep N``, ``exit N``, ``true``,
``false``, joined by ``;`` or ``&&``; ``crash`` drops the agent link (GuestError); ``hang``
never ends and ignores its timeout, as a guest too busy to answer would; anything else is
"command not found" (127)."""

from __future__ import annotations

import asyncio
import itertools
import posixpath
import re
import shlex
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sandlot.errors import GuestError, InvalidArgumentError, NotFoundError
from sandlot.guest.client import Configure, Configured
from sandlot.runtime.base import (
    ExecEvent,
    Exited,
    FileEntry,
    Output,
    ProcessInfo,
    Started,
    TerminalSize,
)

_pids = itertools.count(100)
_VAR = re.compile(r"\$\{?(\w+)\}?")


def next_pid() -> int:
    """A process id no other fake process or VM has."""
    return next(_pids)


@dataclass
class GuestState:
    """What a capture keeps of a fake VM."""

    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/tmp", "/root", "/home",
                                                    "/home/user"})
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)  # a file's user metadata
    mounts: dict[str, str] = field(default_factory=dict)  # volume mounts: path -> token


@dataclass
class _Proc:
    pid: int
    cmd: str
    user: str
    started_at: float
    output: list[Output] = field(default_factory=list)
    exit: Exited | None = None
    lost: GuestError | None = None
    stdin: asyncio.Queue = field(default_factory=asyncio.Queue)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    hung: bool = False  # `hang`: the fake agent stops answering for this process
    terminal: TerminalSize | None = None


class FakeGuest:
    """The typed guest API (runtime/base.Guest) over an in-memory machine."""

    def __init__(self, state: GuestState, generation: str) -> None:
        self.state = state
        self.generation = generation
        self.procs: dict[int, _Proc] = {}
        self.alive = True

    def _check(self) -> None:
        if not self.alive:
            raise NotFoundError("the sandbox's VM is gone")

    async def sync_clock(self) -> float:
        return 0.0

    async def configure(self, configure: Configure) -> Configured:
        self._check()
        if configure.env is not None:
            self.state.env = dict(configure.env)
        if configure.generation is not None:
            self.generation = configure.generation
        return Configured(time_ns=time.time_ns(), cpus=configure.cpus)

    # ---- processes ------------------------------------------------------------------------

    def _env(self, user: str, extra: dict[str, str] | None) -> dict[str, str]:
        home = "/root" if user == "root" else f"/home/{user}"
        return {"HOME": home, "USER": user, "SANDLOT_GENERATION": self.generation,
                **self.state.env, **(extra or {})}

    def _spawn(self, cmd: str, env: dict[str, str] | None, cwd: str | None, user: str | None,
               timeout: float | None, stdin: bytes | None) -> _Proc:
        self._check()
        user = user or "root"
        if user not in ("root", "user"):
            raise InvalidArgumentError(f"no such user: {user}")
        proc = _Proc(pid=next(_pids), cmd=cmd, user=user, started_at=time.time())
        if stdin is not None:
            proc.stdin.put_nowait(stdin)
            proc.stdin.put_nowait(None)
        variables = self._env(user, env)
        workdir = cwd or variables["HOME"]
        if workdir not in self.state.dirs:
            raise InvalidArgumentError(f"cwd {workdir}: not a directory")
        self.procs[proc.pid] = proc
        proc.task = asyncio.get_running_loop().create_task(
            self._run(proc, variables, workdir, timeout))
        return proc

    async def _run(self, proc: _Proc, env: dict[str, str], cwd: str,
                   timeout: float | None) -> None:
        def emit(stream: str, text: str) -> None:
            if text:
                proc.output.append(Output(stream, text.encode()))
                proc.changed.set()
        try:
            code = await asyncio.wait_for(self._shell(proc, env, cwd, emit), timeout or None)
            proc.exit = Exited(code, False)
        except TimeoutError:
            if proc.hung:
                return  # never answered
            proc.exit = Exited(-9, True)
        except GuestError as e:
            proc.lost = e
        proc.changed.set()

    async def _shell(self, proc: _Proc, env: dict[str, str], cwd: str, emit) -> int:
        code = 0
        for part, joiner in _split(proc.cmd):
            if joiner == "&&" and code:
                break
            code = await self._one(proc, part, env, cwd, emit)
            if code < 0:
                return code
        return code

    async def _one(self, proc: _Proc, line: str, env: dict[str, str], cwd: str, emit) -> int:
        try:
            words = [_VAR.sub(lambda m: env.get(m.group(1), ""), w) for w in shlex.split(line)]
        except ValueError as e:
            emit("stderr", f"bash: {e}\n")
            return 2
        if not words:
            return 0
        stream, target, append = "stdout", None, False
        if words[-1] == ">&2":
            stream, words = "stderr", words[:-1]
        elif len(words) >= 3 and words[-2] in (">", ">>"):
            target, append, words = self._abs(words[-1], cwd), words[-2] == ">>", words[:-2]
        name, args = words[0], words[1:]
        out = ""
        if name == "echo":
            newline = not (args and args[0] == "-n")
            out = " ".join(args[1:] if not newline else args) + ("\n" if newline else "")
        elif name == "cat":
            if args:
                path = self._abs(args[0], cwd)
                if path not in self.state.files:
                    emit("stderr", f"cat: {args[0]}: No such file or directory\n")
                    return 1
                out = self.state.files[path].decode(errors="replace")
            else:
                while (chunk := await proc.stdin.get()) is not None:
                    out += chunk.decode(errors="replace")
        elif name == "printenv":
            if not args or args[0] not in env:
                return 1
            out = env[args[0]] + "\n"
        elif name == "pwd":
            out = cwd + "\n"
        elif name == "whoami":
            out = proc.user + "\n"
        elif name == "sleep":
            await asyncio.sleep(float(args[0]) if args else 0)
        elif name == "exit":
            return int(args[0]) if args else 0
        elif name in ("true", "false"):
            return 0 if name == "true" else 1
        elif name == "hang":
            proc.hung = True
            await asyncio.Event().wait()
        elif name == "crash":
            raise GuestError("agent connection lost: the fake guest crashed")
        else:
            emit("stderr", f"bash: {name}: command not found\n")
            return 127
        if target is not None:
            old = self.state.files.get(target, b"") if append else b""
            self.state.files[target] = old + out.encode()
        else:
            emit(stream, out)
        return 0

    async def _events(self, proc: _Proc, replay: bool, start: bool) -> AsyncIterator[ExecEvent]:
        if start:
            yield Started(proc.pid)
        sent = 0 if replay else len(proc.output)
        while True:
            proc.changed.clear()
            while sent < len(proc.output):
                yield proc.output[sent]
                sent += 1
            if proc.exit is not None:
                yield proc.exit
                return
            if proc.lost is not None:
                raise proc.lost
            await proc.changed.wait()

    def exec(self, cmd: str, *, env=None, cwd=None, user=None, timeout=None, stdin=None,
             track: bool = True) -> AsyncIterator[ExecEvent]:
        return self._events(self._spawn(cmd, env, cwd, user, timeout, stdin), True, True)

    async def start(self, cmd: str, *, env=None, cwd=None, user=None, timeout=None,
                    stdin=None, pty: TerminalSize | None = None) -> int:
        proc = self._spawn(cmd, env, cwd, user, timeout, stdin)
        proc.terminal = pty
        return proc.pid

    async def resize(self, pid: int, size: TerminalSize) -> None:
        proc = self._proc(pid)
        if proc.terminal is None:
            raise InvalidArgumentError(f"process {pid} has no terminal")
        if proc.exit is not None:
            raise InvalidArgumentError(f"process {pid} has exited")
        proc.terminal = size

    def attach(self, pid: int, replay: bool = True) -> AsyncIterator[ExecEvent]:
        return self._events(self._proc(pid), replay, False)

    def _proc(self, pid: int) -> _Proc:
        self._check()
        proc = self.procs.get(pid)
        if proc is None:
            raise NotFoundError(f"no process {pid}")
        return proc

    async def send_stdin(self, pid: int, data: bytes, eof: bool = False) -> None:
        proc = self._proc(pid)
        if proc.exit is not None:
            raise InvalidArgumentError(f"process {pid} has exited")
        if data:
            proc.stdin.put_nowait(data)
        if eof:
            proc.stdin.put_nowait(None)

    async def kill(self, pid: int, signal: int = 9) -> bool:
        proc = self._proc(pid)
        if proc.exit is not None:
            return False
        proc.task.cancel()
        proc.exit = Exited(-signal, False)
        proc.changed.set()
        return True

    async def processes(self, all: bool = False) -> list[ProcessInfo]:
        self._check()
        return [ProcessInfo(pid=p.pid, cmd=p.cmd, user=p.user, running=p.exit is None,
                            exit_code=p.exit.exit_code if p.exit else None,
                            started_at=p.started_at, pty=p.terminal is not None)
                for p in self.procs.values() if all or p.exit is None]

    # ---- files ----------------------------------------------------------------------------

    @staticmethod
    def _abs(path: str, cwd: str = "/") -> str:
        return posixpath.normpath(posixpath.join(cwd, path))

    def _entry(self, path: str) -> FileEntry:
        if path in self.state.dirs:
            return FileEntry(name=posixpath.basename(path) or "/", path=path, type="dir",
                             size=4096, mode=0o755, owner="root", mtime=0.0)
        if path in self.state.files:
            return FileEntry(name=posixpath.basename(path), path=path, type="file",
                             size=len(self.state.files[path]), mode=0o644, owner="root",
                             mtime=0.0, metadata=self.state.metadata.get(path) or None)
        raise NotFoundError(f"{path}: no such file or directory")

    async def read(self, path: str) -> tuple[int, AsyncIterator[bytes]]:
        self._check()
        if path in self.state.dirs:
            raise InvalidArgumentError(f"{path}: is a directory")
        data = self._entry(path) and self.state.files[path]

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 1 << 20):
                yield data[i : i + (1 << 20)]

        return len(data), chunks()

    async def write(self, path: str, chunks: AsyncIterator[bytes], user=None,
                    mode=None, metadata=None) -> FileEntry:
        self._check()
        if path in self.state.dirs:
            raise InvalidArgumentError(f"{path}: is a directory")
        data = bytearray()
        async for chunk in chunks:
            data += chunk
        self._make_dirs(posixpath.dirname(path))
        self.state.files[path] = bytes(data)
        self.state.metadata[path] = dict(metadata or {})
        return self._entry(path)

    def _make_dirs(self, path: str) -> bool:
        if path in self.state.files:
            raise InvalidArgumentError(f"{path}: not a directory")
        created = path not in self.state.dirs
        while path not in self.state.dirs:
            self.state.dirs.add(path)
            path = posixpath.dirname(path)
        return created

    async def list_dir(self, path: str, depth: int = 1, max_entries: int | None = None
                       ) -> list[FileEntry]:
        self._check()
        if path not in self.state.dirs:
            self._entry(path)
            raise InvalidArgumentError(f"{path}: not a directory")
        prefix = path.rstrip("/") + "/"
        out = []
        for p in sorted((self.state.dirs | set(self.state.files)) - {path}):
            rest = p[len(prefix):] if p.startswith(prefix) else None
            if rest and rest.count("/") < depth:
                out.append(self._entry(p))
                if max_entries is not None and len(out) > max_entries:
                    raise InvalidArgumentError(f"listing too large: more than {max_entries} "
                                               "entries")
        return out

    async def stat(self, path: str) -> FileEntry:
        self._check()
        return self._entry(path)

    async def exists(self, path: str) -> bool:
        self._check()
        return path in self.state.dirs or path in self.state.files

    async def remove(self, path: str) -> None:
        self._entry(path)
        self.state.files = {p: d for p, d in self.state.files.items()
                            if p != path and not p.startswith(path + "/")}
        self.state.dirs = {d for d in self.state.dirs if d != path
                           and not d.startswith(path + "/")}

    async def mkdir(self, path: str, user=None) -> tuple[bool, FileEntry]:
        self._check()
        return self._make_dirs(path), self._entry(path)

    async def mount(self, path: str, token: str, user: str | None = None) -> None:
        self.state.mounts[path] = token

    async def rename(self, src: str, dst: str) -> FileEntry:
        self._entry(src)
        if src in self.state.files:
            self.state.files[dst] = self.state.files.pop(src)
            self.state.metadata[dst] = self.state.metadata.pop(src, {})
        else:
            for p in [p for p in self.state.files if p.startswith(src + "/")]:
                self.state.files[dst + p[len(src):]] = self.state.files.pop(p)
            self.state.dirs = {dst + d[len(src):] if d == src or d.startswith(src + "/") else d
                               for d in self.state.dirs}
        return self._entry(dst)


MEMORY_DIRS = ("/tmp", "/dev/shm", "/run")  # tmpfs in the guest: gone with its memory


def drop_memory(state: GuestState) -> None:
    """What a boot from the disk keeps of a fake guest: its files outside tmpfs."""
    def in_memory(path: str) -> bool:
        return any(path.startswith(d + "/") for d in MEMORY_DIRS)

    state.files = {p: d for p, d in state.files.items() if not in_memory(p)}
    state.metadata = {p: m for p, m in state.metadata.items() if not in_memory(p)}
    state.dirs = {d for d in state.dirs if not in_memory(d)}


def _split(cmd: str) -> list[tuple[str, str]]:
    """`a; b && c` -> [(a, ';'), (b, ';'), (c, '&&')]: each part with the joiner before it."""
    out, joiner, part = [], ";", ""
    i = 0
    while i < len(cmd):
        if cmd.startswith("&&", i) or cmd[i] == ";":
            out.append((part.strip(), joiner))
            joiner = "&&" if cmd.startswith("&&", i) else ";"
            i += 2 if joiner == "&&" else 1
            part = ""
            continue
        part += cmd[i]
        i += 1
    out.append((part.strip(), joiner))
    return [(p, j) for p, j in out if p]
