"""Files in a running sandbox, streamed through the guest agent in chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from sandlot.core.runtime import LiveSandbox
from sandlot.errors import InvalidArgumentError


def check_path(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidArgumentError(f"path must be absolute, got {path!r}")


def strip_reply(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "ok")}


class Files:
    def __init__(self, live_of: Callable[[str], LiveSandbox]) -> None:
        self.live_of = live_of  # a running sandbox by id, or NotFoundError

    async def read_file(self, sandbox_id: str, path: str) -> tuple[int, AsyncIterator[bytes]]:
        """Open a guest file for streaming: (size, chunks). Errors raise before any byte."""
        check_path(path)
        live = self.live_of(sandbox_id)
        agent = await live.session()
        events = agent.stream("read", path=path)
        header, _ = await anext(events)
        size = int(header.get("size", 0))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for h, data in events:
                    if h.get("event") == "data":
                        yield data
            finally:
                await events.aclose()

        return size, chunks()

    async def write_file(self, sandbox_id: str, path: str, chunks: AsyncIterator[bytes],
                         user: str | None = None) -> dict:
        check_path(path)
        live = self.live_of(sandbox_id)
        agent = await live.session()
        reply = await agent.upload(path, chunks, user=user)
        return strip_reply(reply)

    async def file_op(self, sandbox_id: str, op: str, **fields) -> dict:
        for key in ("path", "src", "dst"):
            if key in fields:
                check_path(fields[key])
        agent = await self.live_of(sandbox_id).session()
        return strip_reply(await agent.request(op, **fields))
