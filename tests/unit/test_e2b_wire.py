"""The E2B layer's wire pieces without VMs: multipart streaming, Connect framing, the JSON
shapes (decoded with the e2b SDK's own protobuf classes), paths, users and error codes."""

from __future__ import annotations

import base64
import json
import random
import struct

import httpx
import pytest
from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from protobuf import Oneof

from sandlot.core.models import FileInfo
from sandlot.errors import (
    CommandTimeoutError,
    ConflictError,
    GuestError,
    InvalidArgumentError,
    NotFoundError,
    StorageError,
)
from sandlot.server.e2b import connect, convert, process
from sandlot.server.e2b.errors import SandboxNotRunning, Unsupported, connect_code, http_status
from sandlot.server.e2b.multipart import MultipartReader, boundary_of


async def _chunks(data: bytes, seed: int):
    rng = random.Random(seed)
    i = 0
    while i < len(data):
        n = rng.choice([1, 2, 3, 7, 64, 1000, 70000])
        yield data[i:i + n]
        i += n


@pytest.mark.parametrize("seed", range(5))
async def test_multipart_reader_streams_parts(seed):
    files = [("file", ("/tmp/a.txt", b"alpha")),
             ("file", ('we"ird\\name.bin', b"\r\n--" + bytes(range(256)) * 300)),
             ("file", ("empty", b""))]
    req = httpx.Request("POST", "http://x/files", files=files)
    body = req.read()
    reader = MultipartReader(_chunks(body, seed), boundary_of(req.headers["content-type"]))
    got = []
    async for part in reader:
        got.append((part.filename, b"".join([c async for c in reader.body()])))
    assert got == [(name, data) for _, (name, data) in files]


async def test_multipart_reader_skips_unread_parts_and_rejects_truncation():
    req = httpx.Request("POST", "http://x", files=[("file", ("a", b"1" * 5000)),
                                                   ("file", ("b", b"2"))])
    body, boundary = req.read(), boundary_of(req.headers["content-type"])
    reader = MultipartReader(_chunks(body, 1), boundary)
    assert [p.filename async for p in reader] == ["a", "b"]
    reader = MultipartReader(_chunks(body[:-40], 1), boundary)
    with pytest.raises(InvalidArgumentError):
        async for _ in reader:
            async for _ in reader.body():
                pass


def test_envelopes():
    frame = connect.envelope({"a": 1})
    flags, length = struct.unpack(">BI", frame[:5])
    assert flags == 0 and json.loads(frame[5:]) == {"a": 1} and length == len(frame) - 5
    end = connect.end_stream({"code": "not_found", "message": "x"})
    assert end[0] == connect.FLAG_END_STREAM
    assert json.loads(end[5:]) == {"error": {"code": "not_found", "message": "x"}}
    assert json.loads(connect.end_stream()[5:]) == {}
    assert connect.b64decode(base64.b64encode(b"\xff\x00").decode()) == b"\xff\x00"
    assert connect.b64decode(base64.urlsafe_b64encode(b"\xfb\xff").decode().rstrip("=")) \
        == b"\xfb\xff"


def test_shapes_decode_with_the_sdk_protobufs():
    entry = convert.entry_info(FileInfo(name="x", path="/home/user/x", type="symlink",
                                        size=5, mode=0o777, owner="user",
                                        mtime=1_700_000_000.5, target="/etc/hosts"))
    info = filesystem_pb.EntryInfo.from_json(json.dumps(entry))
    assert info.type == filesystem_pb.FileType.SYMLINK and info.symlink_target == "/etc/hosts"
    assert (info.size, info.mode, info.permissions) == (5, 0o777, "Lrwxrwxrwx")
    assert info.modified_time.to_datetime().timestamp() == 1_700_000_000.5
    d = filesystem_pb.EntryInfo.from_json(json.dumps(convert.entry_info(
        FileInfo(name="d", path="/d", type="dir", size=4096, mode=0o755, owner="root",
                 mtime=0))))
    assert d.type == filesystem_pb.FileType.DIRECTORY and d.permissions == "drwxr-xr-x"

    start = process_pb.StartResponse.from_json(json.dumps(process._event("start", {"pid": 9})))
    assert start.event.event == Oneof("start", process_pb.ProcessEvent.StartEvent(pid=9))
    data = process_pb.StartResponse.from_json(json.dumps(
        process._event("data", {"stdout": connect.b64encode(b"hi\n")})))
    assert data.event.event.value.output == Oneof("stdout", b"hi\n")
    end = process_pb.StartResponse.from_json(json.dumps(process._end(3))).event.event.value
    assert (end.exit_code, end.exited, end.error) == (3, True, "exit status 3")


def test_paths_and_users():
    assert convert.resolve("a/b", "user") == "/home/user/a/b"
    assert convert.resolve("~/a", "root") == "/root/a"
    assert convert.resolve("~", "user") == "/home/user"
    assert convert.resolve("", "user") == "/home/user"
    assert convert.resolve("/tmp/../etc//x/", "user") == "/etc/x"
    assert convert.resolve("//x", "user") == "/x"
    basic = "Basic " + base64.b64encode(b"root:").decode()
    assert convert.user_of({"authorization": basic}) == "root"
    assert convert.user_of({}) == "user"
    with pytest.raises(InvalidArgumentError):
        convert.user_of({"authorization": "Basic " + base64.b64encode(b"a b:").decode()})


def test_error_codes():
    cases = [(NotFoundError("x"), "not_found", 404), (InvalidArgumentError("x"),
             "invalid_argument", 400), (ConflictError("x"), "already_exists", 409),
             (CommandTimeoutError("x"), "deadline_exceeded", 504),
             (GuestError("x"), "unavailable", 502), (SandboxNotRunning("sb-1"), "unavailable", 502),
             (Unsupported("x"), "unimplemented", 501), (StorageError("x"), "internal", 500),
             (RuntimeError("x"), "internal", 500)]
    for exc, code, status in cases:
        assert (connect_code(exc), http_status(exc)) == (code, status), exc
    assert "was not found" in str(SandboxNotRunning("sb-1"))  # what the SDK looks for


def test_pages_newest_first_with_keyset_tokens():
    from datetime import UTC, datetime, timedelta

    from sandlot.server.e2b.api import _page

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    items = [(t0 + timedelta(seconds=s), f"sb-{i}") for i, s in enumerate([1, 3, 2, 3])]
    walk, token = [], None
    while True:
        page, headers = _page(items, lambda i: i, 1, token)
        walk += [i[1] for i in page]
        token = headers.get("x-next-token")
        if not token:
            break
    assert walk == ["sb-1", "sb-3", "sb-2", "sb-0"]  # newest first, ties by id
    page, headers = _page(items, lambda i: i, 3, None, "asc")
    assert [i[1] for i in page] == ["sb-0", "sb-2", "sb-1"]
    rest, more = _page(items, lambda i: i, 3, headers["x-next-token"], "asc")
    assert [i[1] for i in rest] == ["sb-3"] and more == {}
    for bad in ("nope", base64.urlsafe_b64encode(b"x__y").decode()):
        with pytest.raises(InvalidArgumentError):
            _page(items, lambda i: i, 1, bad)
    with pytest.raises(InvalidArgumentError, match="other sort order"):
        _page(items, lambda i: i, 1, headers["x-next-token"], "desc")
    with pytest.raises(InvalidArgumentError):
        _page(items, lambda i: i, 1, None, "sideways")


def test_symlink_entries_as_envd():
    link = FileInfo(name="l", path="/home/user/l", type="symlink", size=5, mode=0o777,
                    owner="user", mtime=0, target="t.txt")
    target = FileInfo(name="t.txt", path="/home/user/t.txt", type="file", size=9, mode=0o640,
                      owner="user", mtime=0)
    out = convert.entry_info(link, ("/home/user/t.txt", target))
    assert out["type"] == "FILE_TYPE_FILE" and out["symlinkTarget"] == "/home/user/t.txt"
    assert out["mode"] == 0o640 and out["permissions"] == "Lrwxrwxrwx" and out["size"] == "5"
    broken = convert.entry_info(link, ("/home/user/l", None))
    assert broken["type"] == "FILE_TYPE_UNSPECIFIED" and broken["symlinkTarget"] == "/home/user/l"
    assert broken["mode"] == 0
