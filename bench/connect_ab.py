"""envd's Connect RPCs served two ways, side by side in one process: sandlot's hand-written
framing (`server/e2b/connect.py`, JSON) and the `connectrpc` runtime (JSON and binary proto),
the latter a prototype of the process service's Start and StreamInput and the filesystem's
Stat on envd's generated stubs (the ones the e2b Python SDK ships) mounted in the same app
under ``/e2b/envd-crpc``, with the same E2b-Sandbox-Id routing and authentication. For issue 23
item 5 (docs/benchmarks.md, "Connect RPC: hand-written framing and `connectrpc`, side by
side"; docs/e2b.md, "Connect RPC").

    PYTHONPATH=$PWD/src /work/main/.venv/bin/python bench/connect_ab.py \\
        [--runs 7] [--calls 500] [--events 5000] [--transport asgi|uvicorn]
    PYTHONPATH=$PWD/src /work/main/.venv/bin/python bench/connect_ab.py --sdk

The server runs on the fast tier's fake runtime (no VMs). Per run and side, interleaved:
`--calls` unary Stat calls one after another (calls/s), and one Start whose command prints
`--events` lines (output events/s, from the request to the end of the stream). `asgi` calls
the app through httpx's ASGI transport; `uvicorn` serves it on loopback (HTTP/1.1) and calls it
with httpx.
The sides are first checked to answer alike. `--sdk` instead runs the unmodified e2b Python
SDK and the e2b npm package (tests/ts/e2b-js after `make setup`, or $E2B_JS_DIR) against both
sides on loopback. Needs the test extras (the pinned e2b SDK brings `connectrpc`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import gzip
import json
import os
import shlex
import statistics
import struct
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_connect, filesystem_pb
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from protobuf.wkt.google.protobuf import timestamp_pb
from starlette.requests import Request
from starlette.routing import Mount

from sandlot.core.commands import Exited, Output
from sandlot.core.models import ExecRequest
from sandlot.errors import InvalidArgumentError
from sandlot.runtime.fake import FakeGuest
from sandlot.server.e2b import errors, process
from sandlot.server.e2b import router as e2b_router
from sandlot.server.e2b.convert import permissions, resolve
from sandlot.server.e2b.envd import envd_call
from sandlot.server.e2b.filesystem import _resolve
from sandlot.testing import in_process, loopback_socket

PREFIX = "/e2b/envd-crpc"
PREFIX_GZIP = "/e2b/envd-crpc-gzip"  # connectrpc's default: gzip when the client accepts it

# ---- the fake guest: `bench-out N` prints N lines; envd's `exec ...` and the SDKs'
# `/bin/bash -l -c <script>` run their command or script --------------------------------------

_one, _shell = FakeGuest._one, FakeGuest._shell


async def _bench_one(self, proc, line, env, cwd, emit) -> int:
    words = line.split()
    if words[:1] == ["bench-out"]:
        for i in range(int(words[1])):
            emit("stdout", f"line {i} of the bench's output, about sixty bytes long\n")
        return 0
    return await _one(self, proc, line, env, cwd, emit)


async def _bench_shell(self, proc, env, cwd, emit) -> int:
    words = shlex.split(proc.cmd.removeprefix("exec "))
    if words[:1] == ["/bin/bash"] and "-c" in words:
        proc.cmd = words[words.index("-c") + 1]
    else:
        proc.cmd = shlex.join(words)
    return await _shell(self, proc, env, cwd, emit)


FakeGuest._one, FakeGuest._shell = _bench_one, _bench_shell

# ---- the connectrpc prototype ---------------------------------------------------------------

_scope: contextvars.ContextVar[dict] = contextvars.ContextVar("scope")
FILE_TYPES = {"file": filesystem_pb.FileType.FILE, "dir": filesystem_pb.FileType.DIRECTORY,
              "symlink": filesystem_pb.FileType.SYMLINK}


def _connect_error(exc: Exception) -> ConnectError:
    err = errors.connect_error(exc, "envd rpc (connectrpc)")
    return ConnectError(Code(err["code"]), err["message"])


async def _envd():
    try:
        return await envd_call(Request(_scope.get()))
    except Exception as e:  # noqa: BLE001 - answered as a Connect error
        raise _connect_error(e) from None


def _entry(entry, link) -> filesystem_pb.EntryInfo:
    kind, mode = entry.type, entry.mode & 0o777
    if entry.type == "symlink" and link is not None:
        kind = link[1].type if link[1] is not None else "unknown"
        mode = link[1].mode & 0o777 if link[1] is not None else 0
    seconds = int(entry.mtime)
    return filesystem_pb.EntryInfo(
        name=entry.name, type=FILE_TYPES.get(kind, filesystem_pb.FileType.UNSPECIFIED),
        path=entry.path, size=entry.size, mode=mode,
        permissions=permissions(entry.type, entry.mode), owner=entry.owner, group=entry.owner,
        modified_time=timestamp_pb.Timestamp(seconds=seconds,
                                             nanos=int((entry.mtime - seconds) * 1e9)),
        symlink_target=(link[0] if link else entry.target) if entry.type == "symlink" else None)


class Filesystem(filesystem_connect.Filesystem):
    async def stat(self, request, ctx) -> filesystem_pb.StatResponse:
        env = await _envd()
        try:
            entry = await env.files.stat(env.sandbox_id, resolve(request.path, env.user),
                                         who=env.who)
            link = await _resolve(env, entry) if entry.type == "symlink" else None
            return filesystem_pb.StatResponse(entry=_entry(entry, link))
        except Exception as e:  # noqa: BLE001 - answered as a Connect error
            raise _connect_error(e) from None


class Process(process_connect.Process):
    async def start(self, request, ctx) -> AsyncIterator[process_pb.StartResponse]:
        env = await _envd()
        try:
            proc = request.process
            req = ExecRequest(cmd="exec " + shlex.join([proc.cmd, *proc.args]),
                              env=dict(proc.envs), user=env.user, timeout=env.timeout or 0,
                              background=True, stdin=None if request.stdin else "")
            pid = await env.core.commands.start(env.sandbox_id, req, who=env.who)
            ev = process_pb.ProcessEvent
            yield _oneof("start", ev.StartEvent(pid=pid))
            pump = process.EventPump(env.core.commands.attach(env.sandbox_id, pid, who=env.who))
            try:
                while True:
                    try:
                        item = await pump.get(env.keepalive)
                    except StopAsyncIteration:
                        env.check_running()
                        return
                    if item is None:
                        yield _oneof("keepalive", ev.KeepAlive())
                    elif isinstance(item, Output):
                        yield _oneof("data", ev.DataEvent(output=_pair(item.stream, item.data)))
                    elif isinstance(item, Exited):
                        code = item.exit_code or 0
                        yield _oneof("end", ev.EndEvent(
                            exit_code=code, exited=True, status=f"exit status {code}",
                            error=f"exit status {code}" if code else None))
                        return
            finally:
                await pump.close()
        except Exception as e:  # noqa: BLE001 - ends the stream as a Connect error
            raise _connect_error(e) from None

    async def stream_input(self, requests, ctx) -> process_pb.StreamInputResponse:
        env = await _envd()
        try:
            pid = None
            async for m in requests:
                match m.event:
                    case Oneof("start", start):
                        pid = start.process.selector.value
                    case Oneof("data", data) if data.input and data.input.input:
                        if pid is None:
                            raise InvalidArgumentError("StreamInput must open with a start")
                        await env.core.commands.send_stdin(env.sandbox_id, pid,
                                                           data.input.input.value,
                                                           who=env.who)
            return process_pb.StreamInputResponse()
        except Exception as e:  # noqa: BLE001 - answered as a Connect error
            raise _connect_error(e) from None


def _pair(field: str, value) -> Oneof:
    return Oneof(field, value)


def _oneof(kind: str, value) -> process_pb.StartResponse:
    return process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(kind, value)))


SERVED = {"/process.Process/Start", "/process.Process/StreamInput",
          "/filesystem.Filesystem/Stat"}


class Dispatch:
    """The two services under `prefix`, each call's ASGI scope kept for `envd_call`."""

    def __init__(self, prefix: str, compressions: tuple | None = ()) -> None:
        self.prefix = prefix
        self.apps = {}
        for app in (process_connect.ProcessASGIApplication(Process(), compressions=compressions),
                    filesystem_connect.FilesystemASGIApplication(Filesystem(),
                                                                 compressions=compressions)):
            self.apps[app.path] = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"].removeprefix(self.prefix)
        if path not in SERVED:  # the rest (/health, /files, other RPCs): the hand-written
            await scope["app"]({**scope, "path": "/e2b/envd" + path, "root_path": ""},
                               receive, send)
            return
        app = self.apps["/" + path.lstrip("/").split("/", 1)[0]]
        _scope.set(scope)
        await app({**scope, "path": path, "root_path": ""}, receive, send)


# ---- the calls ------------------------------------------------------------------------------


def _envelope(data: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(data)) + data


def _frames(body: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i < len(body):
        flags, n = struct.unpack(">BI", body[i:i + 5])
        out.append((flags, body[i + 5:i + 5 + n]))
        i += 5 + n
    return out


SIDES = {
    # name: (prefix, unary content type, stream content type, encode(dict, message class))
    "hand-written json": ("/e2b/envd", "application/json", "application/connect+json", None),
    "connectrpc json": (PREFIX, "application/json", "application/connect+json", None),
    "connectrpc proto": (PREFIX, "application/proto", "application/connect+proto", "proto"),
    "connectrpc json gzip": (PREFIX_GZIP, "application/json", "application/connect+json", None),
}


def _body(side: str, msg: dict, cls) -> bytes:
    if SIDES[side][3] == "proto":
        return cls.from_json(json.dumps(msg)).to_binary()
    return json.dumps(msg).encode()


async def stat_calls(client: httpx.AsyncClient, side: str, headers: dict, n: int) -> float:
    prefix, unary_type, _, _ = SIDES[side]
    body = _body(side, {"path": "/home/user"}, filesystem_pb.StatRequest)
    h = {**headers, "content-type": unary_type}
    url = f"{prefix}/filesystem.Filesystem/Stat"
    t0 = time.perf_counter()
    for _ in range(n):
        r = await client.post(url, content=body, headers=h)
        if r.status_code != 200:
            raise RuntimeError(f"{side} Stat: {r.status_code} {r.content[:200]!r}")
    return n / (time.perf_counter() - t0)


async def start_stream(client: httpx.AsyncClient, side: str, headers: dict, n: int
                       ) -> tuple[float, bytes]:
    prefix, _, stream_type, _ = SIDES[side]
    msg = {"process": {"cmd": "bench-out", "args": [str(n)]}}
    body = _envelope(_body(side, msg, process_pb.StartRequest))
    h = {**headers, "content-type": stream_type, "connect-accept-encoding": "gzip"}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{prefix}/process.Process/Start", content=body,
                             headers=h) as r:
        data = b"".join([chunk async for chunk in r.aiter_raw()])
    return n / (time.perf_counter() - t0), data


def _decoded_stream(side: str, data: bytes) -> list[dict]:
    out = []
    for flags, payload in _frames(data):
        if flags & 1:
            payload = gzip.decompress(payload)
        if flags & 2:
            out.append({"end_stream": json.loads(payload)})
        elif SIDES[side][3] == "proto":
            out.append(json.loads(process_pb.StartResponse.from_binary(payload).to_json()))
        else:
            out.append(json.loads(payload))
    for m in out:  # pids differ from call to call; protobuf JSON leaves out a zero exit code
        m.get("event", {}).get("start", {}).pop("pid", None)
        if m.get("event", {}).get("end", {}).get("exitCode") == 0:
            del m["event"]["end"]["exitCode"]
    return out


async def check_alike(client, headers) -> None:
    stats, streams = {}, {}
    for side in SIDES:
        prefix, unary_type, _, codec = SIDES[side]
        r = await client.post(f"{prefix}/filesystem.Filesystem/Stat",
                              content=_body(side, {"path": "/home/user"},
                                            filesystem_pb.StatRequest),
                              headers={**headers, "content-type": unary_type})
        stats[side] = (json.loads(filesystem_pb.StatResponse.from_binary(r.content).to_json())
                       if codec == "proto" else r.json())
        stats[side]["entry"].pop("modifiedTime")  # RFC 3339 with or without nanoseconds
        _, data = await start_stream(client, side, headers, 3)
        streams[side] = _decoded_stream(side, data)
    first = next(iter(SIDES))
    for side in SIDES:
        assert stats[side] == stats[first], (side, stats[side], stats[first])
        assert streams[side] == streams[first], (side, streams[side], streams[first])


@contextlib.asynccontextmanager
async def serve(app, transport: str) -> AsyncIterator[httpx.AsyncClient]:
    if transport == "asgi":
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://sandlot.test", timeout=60) as client:
            yield client
        return
    import uvicorn

    sock = loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http="h11"))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        server.should_exit = server.force_exit = True
        await asyncio.wait_for(task, 10)


# ---- the unmodified SDKs against each side --------------------------------------------------

JS = r"""
const { Sandbox } = await import('e2b/dist/index.mjs')  // Node 18: the ES build
const [apiUrl, sandboxUrl, apiKey] = process.argv.slice(1)
const out = {}
const check = async (name, f) => {
  try { out[name] = await f() } catch (e) { out[name] = 'raised ' + e.constructor.name }
}
const sbx = await Sandbox.create('base', { apiUrl, sandboxUrl, apiKey })
await check('run', async () => (await sbx.commands.run('echo hi')).stdout)
await check('exit 3', async () => (await sbx.commands.run('echo boom >&2; exit 3')).exitCode)
await check('stat', async () => (await sbx.files.getInfo('/home/user')).type)
await check('stat missing', async () => (await sbx.files.getInfo('/nope')).type)
await check('timeout', async () => (await sbx.commands.run('sleep 5', { timeoutMs: 500 })).exitCode)
await check('stdin (SendInput)', async () => {
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'abc')
  await sbx.commands.closeStdin(h.pid)
  return (await h.wait()).stdout
})
await sbx.kill()
console.log(JSON.stringify(out))
"""


async def _py_checks(url: str, key: str, envd: str) -> dict:
    from e2b import AsyncSandbox

    sbx = await AsyncSandbox.create("base", api_url=f"{url}/e2b", sandbox_url=f"{url}{envd}",
                                    api_key=key)
    out: dict = {}

    async def check(name, coro) -> None:
        try:
            out[name] = await asyncio.wait_for(coro, 30)
        except Exception as e:  # noqa: BLE001 - the SDK's error class is the result
            out[name] = f"raised {type(e).__name__}"

    async def stream_input() -> str:
        h = await sbx.commands.run("cat", background=True, stdin=True)
        async with sbx.commands.stream_input(h.pid) as inp:
            await inp.send("abc")
        await sbx.commands.close_stdin(h.pid)
        return (await h.wait()).stdout

    async def run(cmd, **kw):
        return await sbx.commands.run(cmd, **kw)

    await check("run", _get(run("echo hi"), "stdout"))
    await check("exit 3", _get(run("echo boom >&2; exit 3"), "exit_code"))
    await check("stat", _get(sbx.files.get_info("/home/user"), "type"))
    await check("stat missing", _get(sbx.files.get_info("/nope"), "type"))
    await check("timeout", _get(run("sleep 5", timeout=0.5), "exit_code"))
    await check("stdin (StreamInput)", stream_input())
    await sbx.kill()
    return out


async def _get(coro, attr: str):
    return str(getattr(await coro, attr))


async def sdk_checks(url: str, key: str) -> None:
    js_dir = Path(os.environ.get("E2B_JS_DIR") or
                  Path(__file__).resolve().parents[1] / "tests" / "ts" / "e2b-js")
    for name, envd in (("hand-written", "/e2b/envd"), ("connectrpc", PREFIX)):
        print(f"{name} ({envd})")
        print("  python SDK:", await _py_checks(url, key, envd))
        proc = await asyncio.create_subprocess_exec(
            "node", "--input-type=module", "-e", JS, f"{url}/e2b", f"{url}{envd}", key,
            cwd=js_dir, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        stdout, _ = await proc.communicate()
        print("  JS SDK:    ", stdout.decode().strip()[-600:])


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with in_process(Path(tmp)) as srv:
            # Next to envd's routes, so that both sides cost the same route matching.
            routes = srv.app.router.routes
            at = next(i for i, r in enumerate(routes)
                      if getattr(r, "original_router", None) is e2b_router)
            routes.insert(at, Mount(PREFIX, app=Dispatch(PREFIX)))
            routes.insert(at, Mount(PREFIX_GZIP, app=Dispatch(PREFIX_GZIP, None)))
            async with serve(srv.app, args.transport) as client:
                if args.sdk:
                    await sdk_checks(str(client.base_url).rstrip("/"), srv.key)
                    return
                r = await client.post("/v1/sandboxes", json={},
                                      headers={"authorization": f"Bearer {srv.key}"})
                r.raise_for_status()
                headers = {"x-api-key": srv.key, "e2b-sandbox-id": r.json()["sandbox_id"]}
                await check_alike(client, headers)
                unary: dict[str, list[float]] = {s: [] for s in SIDES}
                stream: dict[str, list[float]] = {s: [] for s in SIDES}
                for run in range(args.runs + 1):  # the first run warms up and is not counted
                    for side in SIDES:
                        u = await stat_calls(client, side, headers, args.calls)
                        s, _ = await start_stream(client, side, headers, args.events)
                        if run:
                            unary[side].append(u)
                            stream[side].append(s)
    print(f"transport {args.transport}, {args.runs} runs: median (min-max)")
    print(f"{'side':<20} {'Stat calls/s':>24} {'Start output events/s':>28}")
    for side in SIDES:
        u, s = unary[side], stream[side]
        print(f"{side:<20} {statistics.median(u):>10.0f} ({min(u):.0f}-{max(u):.0f})"
              f" {statistics.median(s):>14.0f} ({min(s):.0f}-{max(s):.0f})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--events", type=int, default=5000)
    p.add_argument("--transport", choices=("asgi", "uvicorn"), default="asgi")
    p.add_argument("--sdk", action="store_true",
                   help="instead: run the unmodified e2b SDKs (Python, JS) against both sides")
    args = p.parse_args()
    if args.sdk:
        args.transport = "uvicorn"
    asyncio.run(main(args))
