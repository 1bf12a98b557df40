"""A running sandbox as core keeps it: its record, its VM, and the lock its lifecycle changes
(snapshots, forks, rollback, pause, kill) take."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sandlot.core.models import SandboxRecord
from sandlot.errors import InvalidStateError
from sandlot.runtime.base import Guest, Vm


def _settled() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass
class KeyStreams:
    """Streams open per API key (a sandbox's `owner`) over one host's sandboxes."""

    limit: int  # 0: none
    open: dict[str, int] = field(default_factory=dict)


@dataclass(eq=False)
class LiveSandbox:
    record: SandboxRecord
    vm: Vm
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _captures: int = 0
    _settled: asyncio.Event = field(default_factory=_settled)
    ports: dict[int, tuple[str, int]] = field(default_factory=dict)  # guest port -> host's
    ports_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    streams: int = 0  # command outputs and file reads being streamed from it now
    key_streams: KeyStreams | None = None  # its owner's, across the host (set by core)

    @property
    def sandbox_id(self) -> str:
        return self.record.sandbox_id

    def capture_asked(self) -> None:
        """A snapshot was asked for: commands and file operations asked for after it wait
        until it is captured, so they are never in it."""
        self._captures += 1
        self._settled.clear()

    def capture_done(self) -> None:
        self._captures = max(0, self._captures - 1)
        if not self._captures:
            self._settled.set()

    async def guest(self) -> Guest:
        await self._settled.wait()
        return await self.vm.guest()

    def open_stream(self, limit: int) -> None:
        """Count a stream (a command followed, a file read); at most `limit` at once, since
        each holds a bounded buffer in the server."""
        if self.streams >= limit:
            raise InvalidStateError(
                f"sandbox {self.sandbox_id} has {self.streams} streams open (commands followed, "
                "files being read), the limit (SANDLOT_MAX_STREAMS); finish or close some")
        owner, keys = self.record.owner, self.key_streams
        if owner and keys is not None:
            if keys.limit and keys.open.get(owner, 0) >= keys.limit:
                raise InvalidStateError(
                    f"this tenant has {keys.open[owner]} streams open across its sandboxes, "
                    "the limit (SANDLOT_MAX_KEY_STREAMS); finish or close some")
            keys.open[owner] = keys.open.get(owner, 0) + 1
        self.streams += 1

    def close_stream(self) -> None:
        self.streams -= 1
        owner, keys = self.record.owner, self.key_streams
        if owner and keys is not None and keys.open.get(owner):
            keys.open[owner] -= 1
            if not keys.open[owner]:
                del keys.open[owner]

    def mark_unresponsive(self, reason: str) -> None:
        """The guest did not answer in time (e.g. too busy to end a command at its timeout):
        shown as the record's `error` until it answers again. It can still be killed."""
        self.record.error = f"unresponsive: {reason}"

    def mark_responsive(self) -> None:
        if self.record.error and self.record.error.startswith("unresponsive: "):
            self.record.error = None
