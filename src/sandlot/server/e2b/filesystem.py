"""envd's ``filesystem.Filesystem`` service on sandlot's agent: Stat, ListDir, MakeDir, Move,
Remove, and directory watching (WatchDir for the async SDK; CreateWatcher, GetWatcherEvents and
RemoveWatcher for the sync one).

The agent has no inotify, so watching polls: each look lists the directory (recursively if
asked, so folders made after the watch began are watched too) and compares it with the last
look. A file that appears with content is a create and a write, as envd reports a file
created and then written on inotify; one created and removed between two looks is none.

A symlink's entry is envd's: the type and mode of what it points to, and the absolute path it
resolves to as its target (`_resolve` follows the chain as Go's `filepath.EvalSymlinks`).
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
from collections.abc import AsyncIterator

from sandlot.core.models import FileInfo
from sandlot.errors import ConflictError, InvalidArgumentError, NotFoundError, SandlotError
from sandlot.server.e2b.connect import field
from sandlot.server.e2b.convert import entry_info, resolve
from sandlot.server.e2b.state import Envd

POLL_INTERVAL = 0.2
RECURSIVE_DEPTH = 32
MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup
# Why: sync watchers live until RemoveWatcher; clients that never call it must not grow this
# without bound, so the oldest go first.
MAX_WATCHERS = 256


def _path(ctx: Envd, msg: dict) -> str:
    return resolve(field(msg, "path"), ctx.user)


async def _resolve(ctx: Envd, link: FileInfo) -> tuple[str, FileInfo | None]:
    """Where a symlink leads: (the absolute path, its entry), or (the link's own path, None)
    when the chain is broken or too long."""
    entry = link
    for _ in range(MAX_LINKS):
        path = posixpath.normpath(posixpath.join(posixpath.dirname(entry.path),
                                                 entry.target or ""))
        try:
            entry = await ctx.files.stat(ctx.sandbox_id, path, who=ctx.who)
        except (NotFoundError, InvalidArgumentError):
            ctx.check_running()
            return link.path, None
        if entry.type != "symlink":
            return path, entry
    return link.path, None


async def info(ctx: Envd, entry: FileInfo) -> dict:
    """`entry` as envd's EntryInfo, a symlink resolved."""
    link = await _resolve(ctx, entry) if entry.type == "symlink" else None
    return entry_info(entry, link)


async def stat(ctx: Envd, msg: dict) -> dict:
    return {"entry": await info(ctx, await ctx.files.stat(ctx.sandbox_id, _path(ctx, msg),
                                                         who=ctx.who))}


async def list_dir(ctx: Envd, msg: dict) -> dict:
    depth = int(field(msg, "depth") or 1)
    if depth < 1:
        raise InvalidArgumentError("depth must be at least 1")
    entries = await ctx.files.list(ctx.sandbox_id, _path(ctx, msg), depth, who=ctx.who)
    return {"entries": [await info(ctx, e) for e in entries]}


async def make_dir(ctx: Envd, msg: dict) -> dict:
    path = _path(ctx, msg)
    made = await ctx.files.mkdir(ctx.sandbox_id, path, ctx.user, who=ctx.who)
    if not made.created:
        raise ConflictError(f"directory {path} already exists")
    return {"entry": await info(ctx, made)}


async def move(ctx: Envd, msg: dict) -> dict:
    src = resolve(field(msg, "source"), ctx.user)
    dst = resolve(field(msg, "destination"), ctx.user)
    await ctx.files.mkdir(ctx.sandbox_id, posixpath.dirname(dst) or "/", ctx.user, who=ctx.who)
    return {"entry": await info(ctx, await ctx.files.rename(ctx.sandbox_id, src, dst,
                                                            who=ctx.who))}


async def remove(ctx: Envd, msg: dict) -> dict:
    """envd removes as `os.RemoveAll`: a path that is not there is removed already."""
    path = _path(ctx, msg)
    try:
        await ctx.files.remove(ctx.sandbox_id, path, who=ctx.who)
    except NotFoundError:
        # The sandbox's own absence is still an error: exists() raises it.
        if await ctx.files.exists(ctx.sandbox_id, path, who=ctx.who):
            raise
    return {}


# ---- watching ------------------------------------------------------------------------------


class Watcher:
    """Polls one directory and reports what changed since the last look."""

    def __init__(self, ctx: Envd, path: str, recursive: bool, include_entry: bool) -> None:
        self.ctx = ctx
        self.path = path
        self.recursive = recursive
        self.include_entry = include_entry
        self.last: dict[str, FileInfo] = {}

    async def start(self) -> None:
        entry = await self.ctx.files.stat(self.ctx.sandbox_id, self.path, who=self.ctx.who)
        if entry.type != "dir":
            raise InvalidArgumentError(f"{self.path} is not a directory")
        self.last = await self._look()

    async def _look(self) -> dict[str, FileInfo]:
        depth = RECURSIVE_DEPTH if self.recursive else 1
        try:
            entries = await self.ctx.files.list(self.ctx.sandbox_id, self.path, depth,
                                                who=self.ctx.who)
        except NotFoundError:
            return {}  # the directory itself went away: everything in it was removed
        return {e.path: e for e in entries}

    def _event(self, path: str, kind: str, entry: FileInfo | None) -> dict:
        ev = {"name": posixpath.relpath(path, self.path), "type": f"EVENT_TYPE_{kind}"}
        if self.include_entry and entry is not None:
            ev["entry"] = entry
        return ev

    async def changes(self) -> list[dict]:
        events = await self._changes()
        for ev in events:
            if "entry" in ev:
                ev["entry"] = await info(self.ctx, ev["entry"])
        return events

    async def _changes(self) -> list[dict]:
        now = await self._look()
        events = []
        for path in sorted(now.keys() - self.last.keys()):
            events.append(self._event(path, "CREATE", now[path]))
            if now[path].type == "file" and now[path].size > 0:
                events.append(self._event(path, "WRITE", now[path]))  # created, then written
        for path in sorted(now.keys() & self.last.keys()):
            old, new = self.last[path], now[path]
            if old.type != new.type:
                events.append(self._event(path, "REMOVE", None))
                events.append(self._event(path, "CREATE", new))
            elif new.type != "dir" and (old.size, old.mtime) != (new.size, new.mtime):
                # A directory's mtime moves with its entries, which get events of their own.
                events.append(self._event(path, "WRITE", new))
            elif (old.mode, old.owner) != (new.mode, new.owner):
                events.append(self._event(path, "CHMOD", new))
        for path in sorted(self.last.keys() - now.keys()):
            events.append(self._event(path, "REMOVE", None))
        self.last = now
        return events


def _watcher(ctx: Envd, msg: dict) -> Watcher:
    return Watcher(ctx, _path(ctx, msg), bool(field(msg, "recursive")),
                   bool(field(msg, "includeEntry", "include_entry")))


async def watch_dir(ctx: Envd, msg: dict) -> AsyncIterator[dict]:
    watcher = _watcher(ctx, msg)
    await watcher.start()
    yield {"start": {}}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.timeout if ctx.timeout else None
    quiet_since = loop.time()
    while True:
        await asyncio.sleep(POLL_INTERVAL)
        try:
            events = await watcher.changes()
        except SandlotError:
            ctx.check_running()  # a sandbox killed or paused while watched
            raise
        for ev in events:
            quiet_since = loop.time()
            yield {"filesystem": ev}
        if ctx.keepalive and loop.time() - quiet_since >= ctx.keepalive:
            quiet_since = loop.time()
            yield {"keepalive": {}}
        if deadline is not None and loop.time() >= deadline:
            return


async def create_watcher(ctx: Envd, msg: dict) -> dict:
    watcher = _watcher(ctx, msg)
    await watcher.start()
    watchers = ctx.state.watchers
    while len(watchers) >= MAX_WATCHERS:
        watchers.pop(next(iter(watchers)))
    watcher_id = "w-" + secrets.token_hex(8)
    watchers[watcher_id] = watcher
    return {"watcherId": watcher_id}


def _find(ctx: Envd, msg: dict) -> tuple[str, Watcher]:
    watcher_id = str(field(msg, "watcherId", "watcher_id") or "")
    watcher = ctx.state.watchers.get(watcher_id)
    if not isinstance(watcher, Watcher) or watcher.ctx.sandbox_id != ctx.sandbox_id:
        raise NotFoundError(f"watcher {watcher_id!r} not found")
    return watcher_id, watcher


async def get_watcher_events(ctx: Envd, msg: dict) -> dict:
    _, watcher = _find(ctx, msg)
    return {"events": await watcher.changes()}


async def remove_watcher(ctx: Envd, msg: dict) -> dict:
    watcher_id, _ = _find(ctx, msg)
    ctx.state.watchers.pop(watcher_id, None)
    return {}


_PATH = {"path": "string"}
_WATCH = {"path": "string", "recursive": "bool", "includeEntry": "bool",
          "allowNetworkMounts": "bool"}
# Each method's request message (envd's filesystem.proto), checked before its handler runs.
REQUESTS = {
    "Stat": _PATH, "ListDir": {"path": "string", "depth": "uint32"}, "MakeDir": _PATH,
    "Move": {"source": "string", "destination": "string"}, "Remove": _PATH,
    "WatchDir": _WATCH, "CreateWatcher": _WATCH,
    "GetWatcherEvents": {"watcherId": "string"}, "RemoveWatcher": {"watcherId": "string"},
}
UNARY = {"Stat": stat, "ListDir": list_dir, "MakeDir": make_dir, "Move": move,
         "Remove": remove, "CreateWatcher": create_watcher,
         "GetWatcherEvents": get_watcher_events, "RemoveWatcher": remove_watcher}
SERVER_STREAM = {"WatchDir": watch_dir}
