"""Commands in a running sandbox: run with streamed output, start in the background, attach,
list, stdin, signals.

A command's timeout is enforced twice: by the agent in the guest (it kills the process group),
and by the host, which ends the request `grace` seconds after the timeout if the guest has not
said the command ended: a guest too busy to run its agent (a fork bomb) cannot hold a request,
or its caller, forever. The sandbox is then marked unresponsive; it can still be killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from sandlot.config import Limits
from sandlot.core.limits import check_command, check_stdin
from sandlot.core.live import LiveSandbox
from sandlot.core.models import ExecRequest, ProcessInfo, TerminalSize
from sandlot.core.tenancy import Principal
from sandlot.errors import CommandTimeoutError, InvalidArgumentError, SandlotError
from sandlot.runtime.base import ExecEvent, Exited, Output, Started
from sandlot.runtime.base import TerminalSize as GuestTerminalSize

__all__ = ["Commands", "ExecEvent", "Exited", "Output", "Started"]

log = logging.getLogger(__name__)
# Past the deadline, output already on its way is still passed on: each event within this
# many s, and at most this many s of waiting for them in all.
PAST_DEADLINE_WAIT = 1.0
DRAIN_AFTER_DEADLINE = 30.0
KILL_TIMEOUT = 5.0  # s the host waits for the agent to confirm a kill it sends at the deadline


class _Deadline:
    """The host's deadline for a command (its timeout plus the grace), on the waits for the
    guest only: a client that reads slowly pulls events late, and those already queued are
    its own. Past the deadline (a reader that came back late), each next event must come
    within PAST_DEADLINE_WAIT, and all such waits within DRAIN_AFTER_DEADLINE."""

    def __init__(self, seconds: float | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.at = self.loop.time() + seconds if seconds else None
        self.waited_past = 0.0

    def left(self) -> float | None:
        if self.at is None:
            return None
        now = self.loop.time()
        if now < self.at:
            return self.at - now
        budget = DRAIN_AFTER_DEADLINE - self.waited_past
        if budget <= 0:
            raise TimeoutError
        return min(PAST_DEADLINE_WAIT, budget)

    async def wait(self, make: Callable[[], Awaitable]):
        """What `make()` awaits, or TimeoutError when the deadline passes while the guest is
        silent."""
        start = self.loop.time()
        left = self.left()
        try:
            return await asyncio.wait_for(make(), left)
        finally:
            if self.at is not None:
                self.waited_past += max(0.0, self.loop.time() - max(start, self.at))


def _exit_code(code: int | None) -> int:
    """The agent reports a signal as a negative code; shells say 128 + signal."""
    if code is None:
        return -1
    return 128 - code if code < 0 else code


class Commands:
    def __init__(self, live_of: Callable[[str, Principal], LiveSandbox],
                 limits: Limits | None = None,
                 grace: float = 5.0) -> None:
        self.live_of = live_of  # a running sandbox by id, or NotFoundError
        self.limits = limits or Limits()
        self.grace = grace  # s past a command's timeout before the host ends it

    def _check(self, req: ExecRequest) -> None:
        check_command(self.limits, req.cmd, req.env, req.cwd, req.user, req.stdin)
        if req.pty is not None and not req.background:
            raise InvalidArgumentError("a command on a terminal runs in the background: set "
                                       "background, then follow its output by its pid")

    async def run(self, sandbox_id: str, req: ExecRequest, *, who: Principal
                  ) -> AsyncIterator[ExecEvent]:
        """Run a command: Started, Output..., Exited (exit code 128 + n for signal n).

        A timeout kills the whole process group and raises CommandTimeoutError (after the
        output that came before it); so does a guest that has not ended the command `grace`
        seconds after its timeout (the sandbox is then marked unresponsive).
        """
        self._check(req)
        live = self.live_of(sandbox_id, who)
        live.open_stream(self.limits.streams)
        deadline = _Deadline(req.timeout + self.grace if req.timeout else None)
        pid: int | None = None
        events: AsyncIterator[ExecEvent] | None = None
        try:
            guest = await deadline.wait(live.guest)
            events = guest.exec(req.cmd, env=req.env, cwd=req.cwd or live.record.workdir,
                                user=req.user or live.record.user or "root", timeout=req.timeout,
                                stdin=req.stdin.encode() if req.stdin is not None else None)
            while True:
                try:
                    event = await deadline.wait(lambda: anext(events))
                except StopAsyncIteration:
                    return
                if isinstance(event, Started):
                    pid = event.pid
                if isinstance(event, Exited):
                    live.mark_responsive()
                    if event.timed_out:
                        raise CommandTimeoutError(f"command timed out after {req.timeout}s; "
                                                  "its process group was killed")
                    yield Exited(_exit_code(event.exit_code), False)
                    return
                yield event
        except TimeoutError:
            live.mark_unresponsive(f"a command with timeout {req.timeout}s was not ended by "
                                   f"the guest {self.grace:g}s after it")
            log.warning("sandbox %s: command %s not ended by the guest %.0fs past its timeout "
                        "(%ss); ending it on the host", sandbox_id, pid, self.grace, req.timeout)
            if pid is not None:
                asyncio.create_task(self._kill_quietly(live, pid))
            raise CommandTimeoutError(
                f"command timed out after {req.timeout}s and the guest did not end it within "
                f"{self.grace:g}s more: the sandbox is unresponsive (it can still be killed)"
            ) from None
        finally:
            live.close_stream()
            if events is not None:
                with contextlib.suppress(Exception):
                    await events.aclose()

    @staticmethod
    async def _kill_quietly(live: LiveSandbox, pid: int) -> None:
        """Ask the agent once more to kill the command's group; it may be too busy to."""
        with contextlib.suppress(SandlotError, TimeoutError):
            guest = await asyncio.wait_for(live.guest(), KILL_TIMEOUT)
            await asyncio.wait_for(guest.kill(pid, 9), KILL_TIMEOUT)

    async def start(self, sandbox_id: str, req: ExecRequest, *, who: Principal) -> int:
        """Start a command in the background; its pid."""
        self._check(req)
        live = self.live_of(sandbox_id, who)
        guest = await live.guest()
        pty = None if req.pty is None else GuestTerminalSize(req.pty.cols, req.pty.rows)
        return await guest.start(req.cmd, env=req.env, cwd=req.cwd or live.record.workdir,
                                 user=req.user or live.record.user or "root",
                                 timeout=req.timeout,
                                 stdin=req.stdin.encode() if req.stdin is not None else None,
                                 pty=pty)

    async def resize(self, sandbox_id: str, pid: int, size: TerminalSize, *,
                     who: Principal) -> None:
        """Set the size of a process's terminal (its foreground job gets SIGWINCH)."""
        guest = await self.live_of(sandbox_id, who).guest()
        await guest.resize(pid, GuestTerminalSize(size.cols, size.rows))

    async def attach(self, sandbox_id: str, pid: int, *, who: Principal
                     ) -> AsyncIterator[ExecEvent]:
        """A process's buffered output, its live output, then its end."""
        live = self.live_of(sandbox_id, who)
        live.open_stream(self.limits.streams)
        try:
            guest = await live.guest()
            async for event in guest.attach(pid, replay=True):
                if isinstance(event, Exited):
                    if event.timed_out:
                        raise CommandTimeoutError(f"process {pid} timed out and was killed")
                    yield Exited(_exit_code(event.exit_code), False)
                else:
                    yield event
        finally:
            live.close_stream()

    async def list(self, sandbox_id: str, all: bool = False, *, who: Principal
                   ) -> list[ProcessInfo]:
        """Processes commands started (running ones, or `all`)."""
        guest = await self.live_of(sandbox_id, who).guest()
        return [ProcessInfo(**vars(p)) for p in await guest.processes(all=all)]

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool = False, *,
                         who: Principal) -> None:
        check_stdin(self.limits, data)
        await (await self.live_of(sandbox_id, who).guest()).send_stdin(pid, data, eof)

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9, *, who: Principal
                   ) -> bool:
        """Signal a process's group; False if it had already exited."""
        return await (await self.live_of(sandbox_id, who).guest()).kill(pid, signal)
