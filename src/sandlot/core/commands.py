"""Commands in a running sandbox: run with streamed output, start in the background, attach,
and the agent's other process operations (ps, stdin, kill)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from sandlot.core.models import ExecRequest
from sandlot.core.runtime import LiveSandbox
from sandlot.errors import CommandTimeoutError


def exec_fields(live: LiveSandbox, req: ExecRequest) -> dict:
    """The agent's `exec` fields for a request (cwd defaults to the template's workdir)."""
    return {
        "cmd": req.cmd, "env": req.env or {}, "cwd": req.cwd or live.record.workdir,
        "user": req.user, "timeout": req.timeout or None, "stdin": req.stdin is not None,
    }


def _exit_code(code: int | None) -> int:
    """The agent reports a signal as a negative code; shells say 128 + signal."""
    if code is None:
        return -1
    return 128 - code if code < 0 else code


class Commands:
    def __init__(self, live_of: Callable[[str], LiveSandbox]) -> None:
        self.live_of = live_of  # a running sandbox by id, or NotFoundError

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[dict]:
        """Run a command; yields start, stdout/stderr (bytes), then exit events.

        A timeout kills the whole process group and raises CommandTimeoutError (after the
        output that came before it).
        """
        live = self.live_of(sandbox_id)
        agent = await live.session()
        payload = req.stdin.encode() if req.stdin else b""
        async for header, data in agent.stream("exec", payload, stream=True,
                                               **exec_fields(live, req)):
            event = header.get("event")
            if event == "start":
                yield {"type": "start", "pid": header["pid"]}
            elif event in ("stdout", "stderr"):
                yield {"type": event, "data": data}
            elif event == "exit":
                if header.get("timed_out"):
                    raise CommandTimeoutError(
                        f"command timed out after {req.timeout}s; its process group was killed")
                yield {"type": "exit", "exit_code": _exit_code(header.get("exit_code"))}

    async def start_background(self, sandbox_id: str, req: ExecRequest) -> int:
        live = self.live_of(sandbox_id)
        agent = await live.session()
        payload = req.stdin.encode() if req.stdin else b""
        fields = exec_fields(live, req) | {"stream": False, "keep_stdin": req.stdin is None}
        reply = await agent.request("exec", payload, **fields)
        return int(reply["pid"])

    async def attach(self, sandbox_id: str, pid: int) -> AsyncIterator[dict]:
        live = self.live_of(sandbox_id)
        agent = await live.session()
        async for header, data in agent.stream("attach", pid=pid, replay=True):
            event = header.get("event")
            if event in ("stdout", "stderr"):
                yield {"type": event, "data": data}
            elif event == "exit":
                if header.get("timed_out"):
                    raise CommandTimeoutError(f"process {pid} timed out and was killed")
                yield {"type": "exit", "exit_code": _exit_code(header.get("exit_code"))}

    async def agent_call(self, sandbox_id: str, op: str, payload: bytes = b"", **fields) -> dict:
        live = self.live_of(sandbox_id)
        agent = await live.session()
        return await agent.request(op, payload, **fields)
