"""Core's background loops (heartbeats, usage samples, the reaper, the store's GC)."""

from __future__ import annotations

import asyncio
import contextlib


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait for it to end (an error it ended with is its own
    loop's to have logged)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
