"""An in-memory fake of the REST API in docs/api.md, as an httpx handler, for SDK unit tests.

It models only what the SDK needs: the shapes of answers, errors and NDJSON streams. Commands
are canned: ``echo X`` prints X, ``fail`` exits 3 with stderr, ``hang`` times out, ``crash``
ends its stream with a GuestError, and anything else exits 0 silently.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

API_KEY = "sk-test"
NOW = "2026-11-22T02:00:00Z"


def _err(status: int, type_: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": type_, "message": message}})


class FakeServer:
    """State plus a `handler(request) -> Response` usable with `httpx.MockTransport`."""

    def __init__(self, *, async_mode: bool = False, api_key: str | None = API_KEY) -> None:
        self.async_mode = async_mode
        self.api_key = api_key
        self.ids = itertools.count(1)
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.snapshots: dict[str, dict[str, Any]] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.processes: dict[tuple[str, int], dict[str, Any]] = {}
        self.requests: list[httpx.Request] = []
        self.snapshot_polls_until_ready = 2
        self.fail_snapshot = False
        self.fork_fail_indexes: set[int] = set()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    # -- helpers -------------------------------------------------------------------------------

    def _stream(self, lines: list[dict[str, Any]]) -> httpx.Response:
        chunks = [(json.dumps(line) + "\n").encode() for line in lines]
        headers = {"content-type": "application/x-ndjson"}
        if self.async_mode:
            async def agen() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield chunk
            return httpx.Response(200, headers=headers, content=agen())

        def gen() -> Iterator[bytes]:
            yield from chunks
        return httpx.Response(200, headers=headers, content=gen())

    def _sandbox(self, **fields: Any) -> dict[str, Any]:
        sid = f"sb-{next(self.ids):04d}"
        info = {"sandbox_id": sid, "template": "base", "snapshot_id": None, "state": "running",
                "memory_mb": 512, "cpus": 1, "metadata": {}, "env": {}, "created_at": NOW,
                "expires_at": NOW, "timeout": 300, "internet": True, "generation": "g-1",
                "pid": 1000, "unknown_future_field": 1}
        info.update({k: v for k, v in fields.items() if v is not None})
        info["sandbox_id"] = sid
        self.sandboxes[sid] = info
        return info

    def _events(self, sid: str, cmd: str, pid: int) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = [{"type": "start", "pid": pid}]
        if cmd.startswith("echo "):
            events += [{"type": "stdout", "data": cmd[5:]}, {"type": "stdout", "data": "\n"},
                       {"type": "exit", "exit_code": 0}]
        elif cmd == "fail":
            events += [{"type": "stdout", "data": "partial"},
                       {"type": "stderr", "data": "boom\n"}, {"type": "exit", "exit_code": 3}]
        elif cmd == "hang":
            events += [{"type": "error", "error": {"type": "CommandTimeoutError",
                                                   "message": "command timed out after 1s"}}]
        elif cmd == "crash":
            events += [{"type": "error",
                        "error": {"type": "GuestError", "message": "agent went away"}}]
        elif cmd == "cat":
            data = self.processes.get((sid, pid), {}).get("stdin", "")
            events += [{"type": "stdout", "data": data}, {"type": "exit", "exit_code": 0}]
        else:
            events += [{"type": "exit", "exit_code": 0}]
        return events

    # -- the handler -----------------------------------------------------------------------------

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok", "version": "test"})
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return _err(401, "AuthenticationError", "missing or wrong API key")
        parts = path.strip("/").split("/")[1:]  # drop "v1"
        body = json.loads(request.content) if request.content and request.method != "PUT" \
            else None
        method = request.method
        q = request.url.params
        if parts[0] == "templates":
            tmpl = {"name": "base", "hash": "abc", "memory_mb": 512, "cpus": 1, "env": {},
                    "workdir": None, "built_at": NOW}
            if len(parts) == 1:
                return httpx.Response(200, json={"templates": [tmpl]})
            if parts[1] == "base":
                return httpx.Response(200, json=tmpl)
            return _err(404, "NotFoundError", f"template {parts[1]} not found")
        if parts[0] == "snapshots":
            return self._snapshots(method, parts[1:], body, q)
        if parts[0] != "sandboxes":
            return _err(404, "NotFoundError", "no route")
        if len(parts) == 1:
            if method == "POST":
                if body["template"] not in ("base", None):
                    return _err(404, "NotFoundError", f"template {body['template']} not found")
                info = self._sandbox(template=body["template"], snapshot_id=body["snapshot_id"],
                                     memory_mb=body["memory_mb"], cpus=body["cpus"],
                                     env=body["env"], metadata=body["metadata"],
                                     timeout=body["timeout"], internet=body["internet"])
                return httpx.Response(201, json=info)
            wanted = json.loads(q["metadata"]) if "metadata" in q else {}
            out = [s for s in self.sandboxes.values()
                   if wanted.items() <= s["metadata"].items()
                   and (s["state"] == "running" or q.get("all") == "true")]
            return httpx.Response(200, json={"sandboxes": out})
        sid = parts[1]
        sbx = self.sandboxes.get(sid)
        if sbx is None or sbx["state"] == "stopped":
            return _err(404, "NotFoundError", f"sandbox {sid} not found")
        rest = parts[2:]
        if not rest:
            if method == "DELETE":
                sbx["state"] = "stopped"
                return httpx.Response(204)
            return httpx.Response(200, json=sbx)
        if rest == ["timeout"]:
            sbx["timeout"] = body["timeout"]
            return httpx.Response(200, json=sbx)
        if rest == ["fork"]:
            children, errors = [], []
            for i in range(body["count"]):
                if i in self.fork_fail_indexes:
                    errors.append({"index": i, "error": {"type": "VmmError",
                                                         "message": "qemu died"}})
                else:
                    children.append(self._sandbox(metadata=sbx["metadata"]))
            return httpx.Response(200, json={"sandboxes": children, "errors": errors})
        if rest == ["rollback"]:
            snap = self._find_snapshot(body["snapshot_id"])
            if snap is None:
                return _err(404, "NotFoundError", "snapshot not found")
            sbx["snapshot_id"] = snap["snapshot_id"]
            sbx["generation"] = "g-2"
            return httpx.Response(200, json=sbx)
        if rest == ["snapshots"]:
            snap_id = f"snap-{next(self.ids):04d}"
            if body["name"] and self._find_snapshot(body["name"]):
                return _err(409, "ConflictError", f"name {body['name']} taken")
            snap = {"snapshot_id": snap_id, "name": body["name"], "state": "creating",
                    "error": None, "sandbox_id": sid, "template": "base", "memory_mb": 512,
                    "cpus": 1, "created_at": NOW, "ready_at": None, "size_bytes": None,
                    "stored_bytes": None, "polls": 0}
            self.snapshots[snap_id] = snap
            return httpx.Response(201, json=self._snap_json(snap))
        if rest[0] == "commands":
            return self._commands(sid, method, rest[1:], body)
        if rest[0] == "files":
            return self._files(sid, method, rest[1:], body, q, request)
        return _err(404, "NotFoundError", "no route")

    def _commands(self, sid: str, method: str, rest: list[str], body: Any) -> httpx.Response:
        if not rest:
            if method == "GET":
                procs = [p["info"] for (s, _), p in self.processes.items()
                         if s == sid and p["info"]["running"]]
                return httpx.Response(200, json={"processes": procs})
            if body["cwd"] == "/nope":
                return _err(400, "InvalidArgumentError", "cwd /nope does not exist")
            pid = 800 + next(self.ids)
            info = {"pid": pid, "cmd": body["cmd"], "user": body["user"], "running": True,
                    "exit_code": None, "started_at": 1.0}
            self.processes[(sid, pid)] = {"info": info, "stdin": body["stdin"] or "",
                                          "body": body}
            if body["background"]:
                return httpx.Response(200, json={"pid": pid})
            info["running"] = False
            return self._stream(self._events(sid, body["cmd"], pid))
        proc = self.processes.get((sid, int(rest[0])))
        if proc is None:
            return _err(404, "NotFoundError", f"process {rest[0]} not found")
        if rest[1] == "stream":
            proc["info"]["running"] = False
            return self._stream(self._events(sid, proc["info"]["cmd"], proc["info"]["pid"]))
        if rest[1] == "stdin":
            proc["stdin"] += body["data"]
            proc["eof"] = body["eof"]
            return httpx.Response(204)
        if rest[1] == "kill":
            was_running = proc["info"]["running"]
            proc["info"]["running"] = False
            proc["signal"] = body["signal"]
            return httpx.Response(200, json={"killed": was_running})
        return _err(404, "NotFoundError", "no route")

    def _entry(self, path: str, kind: str = "file", sid: str = "") -> dict[str, Any]:
        size = len(self.files.get((sid, path), b""))
        return {"name": path.rsplit("/", 1)[-1], "path": path, "type": kind, "size": size,
                "mode": 420, "owner": "root", "mtime": 1.0}

    def _files(self, sid: str, method: str, rest: list[str], body: Any, q: Any,
               request: httpx.Request) -> httpx.Response:
        key = (sid, q.get("path", ""))
        if not rest:
            if method == "PUT":
                self.files[key] = request.content
                entry = self._entry(key[1])
                entry["size"] = len(request.content)
                return httpx.Response(200, json=entry)
            if key not in self.files:
                return _err(404, "NotFoundError", f"{key[1]} not found")
            if method == "DELETE":
                del self.files[key]
                return httpx.Response(204)
            return httpx.Response(200, content=self.files[key],
                                  headers={"content-type": "application/octet-stream"})
        if rest == ["list"]:
            prefix = key[1].rstrip("/") + "/"
            entries = [self._entry(p) for (s, p) in self.files if s == sid
                       and p.startswith(prefix)]
            return httpx.Response(200, json={"entries": entries})
        if rest == ["exists"]:
            return httpx.Response(200, json={"exists": key in self.files})
        if rest == ["stat"]:
            if key not in self.files:
                return _err(404, "NotFoundError", f"{key[1]} not found")
            return httpx.Response(200, json=self._entry(key[1], sid=sid))
        if rest == ["mkdir"]:
            created = (sid, body["path"]) not in self.files
            self.files.setdefault((sid, body["path"]), b"")
            return httpx.Response(200, json={**self._entry(body["path"], "dir"),
                                             "created": created})
        if rest == ["rename"]:
            src, dst = (sid, body["src"]), (sid, body["dst"])
            if src not in self.files:
                return _err(404, "NotFoundError", f"{body['src']} not found")
            self.files[dst] = self.files.pop(src)
            return httpx.Response(200, json=self._entry(body["dst"]))
        return _err(404, "NotFoundError", "no route")

    def _find_snapshot(self, ref: str) -> dict[str, Any] | None:
        for snap in self.snapshots.values():
            if snap["state"] != "deleted" and ref in (snap["snapshot_id"], snap["name"]):
                return snap
        return None

    def _snap_json(self, snap: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in snap.items() if k != "polls"}

    def _snapshots(self, method: str, rest: list[str], body: Any, q: Any) -> httpx.Response:
        if not rest:
            out = [self._snap_json(s) for s in self.snapshots.values() if s["state"] != "deleted"
                   and q.get("sandbox_id") in (None, s["sandbox_id"])]
            return httpx.Response(200, json={"snapshots": out})
        snap = self._find_snapshot(rest[0])
        if snap is None:
            return _err(404, "NotFoundError", f"snapshot {rest[0]} not found")
        if len(rest) == 2 and rest[1] == "restore":
            info = self._sandbox(snapshot_id=snap["snapshot_id"], memory_mb=body["memory_mb"],
                                 cpus=body["cpus"], env=body["env"], metadata=body["metadata"],
                                 timeout=body["timeout"])
            return httpx.Response(201, json=info)
        if method == "DELETE":
            snap["state"] = "deleted"
            return httpx.Response(204)
        if method == "PATCH":
            other = self._find_snapshot(body["name"])
            if other is not None and other is not snap:
                return _err(409, "ConflictError", f"name {body['name']} taken")
            snap["name"] = body["name"]
            return httpx.Response(200, json=self._snap_json(snap))
        snap["polls"] += 1
        if snap["state"] in ("creating", "uploading"):
            if self.fail_snapshot:
                snap["state"], snap["error"] = "failed", "disk full"
            elif snap["polls"] >= self.snapshot_polls_until_ready:
                snap["state"], snap["ready_at"] = "ready", NOW
            else:
                snap["state"] = "uploading"
        return httpx.Response(200, json=self._snap_json(snap))
