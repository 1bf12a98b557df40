"""Commands in a running sandbox: run with streamed output, start in the background, attach,
list, stdin, signals."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from sandlot.core.live import LiveSandbox
from sandlot.core.models import ExecRequest, ProcessInfo
from sandlot.errors import CommandTimeoutError
from sandlot.runtime.base import ExecEvent, Exited, Output, Started

__all__ = ["Commands", "ExecEvent", "Exited", "Output", "Started"]


def _exit_code(code: int | None) -> int:
    """The agent reports a signal as a negative code; shells say 128 + signal."""
    if code is None:
        return -1
    return 128 - code if code < 0 else code


class Commands:
    def __init__(self, live_of: Callable[[str], LiveSandbox]) -> None:
        self.live_of = live_of  # a running sandbox by id, or NotFoundError

    async def run(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Run a command: Started, Output..., Exited (exit code 128 + n for signal n).

        A timeout kills the whole process group and raises CommandTimeoutError (after the
        output that came before it).
        """
        live = self.live_of(sandbox_id)
        guest = await live.guest()
        events = guest.exec(req.cmd, env=req.env, cwd=req.cwd or live.record.workdir,
                            user=req.user, timeout=req.timeout,
                            stdin=req.stdin.encode() if req.stdin is not None else None)
        async for event in events:
            if isinstance(event, Exited):
                if event.timed_out:
                    raise CommandTimeoutError(f"command timed out after {req.timeout}s; its "
                                              "process group was killed")
                yield Exited(_exit_code(event.exit_code), False)
            else:
                yield event

    async def start(self, sandbox_id: str, req: ExecRequest) -> int:
        """Start a command in the background; its pid."""
        live = self.live_of(sandbox_id)
        guest = await live.guest()
        return await guest.start(req.cmd, env=req.env, cwd=req.cwd or live.record.workdir,
                                 user=req.user, timeout=req.timeout,
                                 stdin=req.stdin.encode() if req.stdin is not None else None)

    async def attach(self, sandbox_id: str, pid: int) -> AsyncIterator[ExecEvent]:
        """A process's buffered output, its live output, then its end."""
        guest = await self.live_of(sandbox_id).guest()
        async for event in guest.attach(pid, replay=True):
            if isinstance(event, Exited):
                if event.timed_out:
                    raise CommandTimeoutError(f"process {pid} timed out and was killed")
                yield Exited(_exit_code(event.exit_code), False)
            else:
                yield event

    async def list(self, sandbox_id: str, all: bool = False) -> list[ProcessInfo]:
        """Processes commands started (running ones, or `all`)."""
        guest = await self.live_of(sandbox_id).guest()
        return [ProcessInfo(**vars(p)) for p in await guest.processes(all=all)]

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool = False
                         ) -> None:
        await (await self.live_of(sandbox_id).guest()).send_stdin(pid, data, eof)

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9) -> bool:
        """Signal a process's group; False if it had already exited."""
        return await (await self.live_of(sandbox_id).guest()).kill(pid, signal)
