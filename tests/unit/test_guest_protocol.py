"""Host and guest agree on the protocol: guest/protocol.py names every op and field; the agent
(the Go binary, src/sandlot/guest/go) has exactly those handlers and answers with those fields;
the host client sends only those and parses the answers; docs/guest-protocol.md lists the same
table. The agent runs here on a socket pair, on a temp directory (only ops that are safe on the
host: no clock or RNG changes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from guestkit import AgentProcess, describe

from sandlot.guest import client, protocol
from sandlot.guest.protocol import ENTRY_FIELDS, EXIT_FIELDS, OPS, PROCESS_FIELDS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def agent():
    proc = AgentProcess()
    proc.start_reading()
    yield proc
    proc.close()


def ask(agent: AgentProcess, op: str, payload: bytes = b"", **fields) -> list[tuple[dict, bytes]]:
    """Send one request; the frames of its answer, up to the terminal one."""
    rid = 7
    agent.send(protocol.request_header(rid, op, fields), payload)
    frames = []
    while True:
        header, data = agent.frames.get(timeout=10)
        assert header["id"] == rid
        frames.append((header, data))
        if "error" in header or header.get("event") == "exit" or (
                header.get("ok") and "event" not in header):
            return frames


def reply_fields(header: dict) -> set[str]:
    return set(header) - {"id", "ok", "event"}


def test_agent_handles_exactly_the_protocol_ops() -> None:
    described = describe()
    assert set(described["ops"]) == set(OPS)
    assert described["proto"] == protocol.PROTO_VERSION


def test_client_has_a_method_for_every_op() -> None:
    source = Path(client.__file__).read_text()
    for op in OPS:
        assert re.search(rf"_(request|stream)\(\s*\"{op}\"|request_header\(\w+, \"{op}\"",
                         source), f"no client call sends {op!r}"


def test_request_header_refuses_unknown_ops_and_fields() -> None:
    with pytest.raises(ValueError, match="unknown agent op"):
        protocol.request_header(1, "format_disk", {})
    with pytest.raises(ValueError, match="no fields"):
        protocol.request_header(1, "stat", {"path": "/", "follow": True})


def test_docs_table_matches_the_protocol() -> None:
    doc = (ROOT / "docs" / "guest-protocol.md").read_text()
    rows = {}
    for line in doc.splitlines():
        m = re.match(r"\| `(\w+)` \|([^|]*)\|([^|]*)\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = [set(re.findall(r"`(\w+)`", m.group(i))) for i in (2, 3, 4)]
    assert set(rows) == set(OPS)
    for name, op in OPS.items():
        assert rows[name] == [set(op.request), set(op.events), set(op.reply)], name


def test_file_ops_answer_the_declared_fields(agent, tmp_path) -> None:
    d = str(tmp_path)
    made = ask(agent, "mkdir", path=f"{d}/sub/dir")[-1][0]
    assert reply_fields(made) <= set(OPS["mkdir"].reply) and made["created"] is True
    client.FileEntry.parse(made)

    agent.send(protocol.request_header(9, "write", {"path": f"{d}/sub/f.txt"}), b"hel")
    agent.send({"id": 9, "op": "chunk"}, b"lo")
    agent.send({"id": 9, "op": "end"}, b"")
    written = agent.frames.get(timeout=10)[0]
    assert reply_fields(written) <= set(ENTRY_FIELDS)
    assert client.FileEntry.parse(written).size == 5

    stat = ask(agent, "stat", path=f"{d}/sub/f.txt")[-1][0]
    assert reply_fields(stat) <= set(OPS["stat"].reply)
    listed = ask(agent, "list", path=d, depth=3)[-1][0]
    assert reply_fields(listed) == set(OPS["list"].reply)
    assert {client.FileEntry.parse(e).path for e in listed["entries"]} == {
        f"{d}/sub", f"{d}/sub/dir", f"{d}/sub/f.txt"}
    for e in listed["entries"]:
        assert set(e) <= set(ENTRY_FIELDS)

    frames = ask(agent, "read", path=f"{d}/sub/f.txt")
    assert [h.get("event") for h, _ in frames] == ["begin", "data", None]
    assert set(frames[0][0]) - {"id", "event"} <= set(protocol.BEGIN_FIELDS)
    assert b"".join(p for _, p in frames) == b"hello"
    assert reply_fields(frames[-1][0]) <= set(OPS["read"].reply)

    moved = ask(agent, "rename", src=f"{d}/sub/f.txt", dst=f"{d}/g.txt")[-1][0]
    assert reply_fields(moved) <= set(OPS["rename"].reply)
    assert ask(agent, "exists", path=f"{d}/g.txt")[-1][0]["exists"] is True
    assert reply_fields(ask(agent, "remove", path=f"{d}/sub")[-1][0]) == set()
    missing = ask(agent, "stat", path=f"{d}/sub")[-1][0]
    assert missing["error"]["type"] in protocol.ERROR_TYPES
    assert isinstance(client.agent_error(missing["error"]), client.NotFoundError)


def test_process_ops_answer_the_declared_fields(agent) -> None:
    frames = ask(agent, "exec", b"from stdin", cmd="cat; echo err >&2", stdin=True)
    events = [h.get("event") for h, _ in frames]
    assert events[0] == "start" and events[-1] == "exit"
    assert set(events) <= set(OPS["exec"].events)
    assert reply_fields(frames[0][0]) <= set(OPS["exec"].reply)
    assert set(frames[-1][0]) - {"id", "event"} <= set(EXIT_FIELDS)
    parsed = [client._exec_event(h, p) for h, p in frames]
    assert parsed[-1] == client.Exited(0, False)
    assert b"".join(e.data for e in parsed if isinstance(e, client.Output)) in (
        b"from stdinerr\n", b"err\nfrom stdin")

    ps = ask(agent, "ps", all=True)[-1][0]
    assert reply_fields(ps) == set(OPS["ps"].reply)
    for p in ps["processes"]:
        assert set(p) == set(PROCESS_FIELDS)
        client.ProcessInfo.parse(p)
    pid = ps["processes"][0]["pid"]
    killed = ask(agent, "kill", pid=pid, signal=15)[-1][0]
    assert reply_fields(killed) == set(OPS["kill"].reply) and killed["killed"] is False
    attached = ask(agent, "attach", pid=pid, replay=True)
    assert {h.get("event") for h, _ in attached} <= set(OPS["attach"].events)
    pong = ask(agent, "ping")[-1][0]
    assert reply_fields(pong) == set(OPS["ping"].reply)


def test_hostile_replies_are_refused() -> None:
    with pytest.raises(client.GuestError):
        client.FileEntry.parse({"name": 1, "path": "/x", "type": "file", "size": 1,
                                "mode": 0, "owner": "r", "mtime": 0})
    with pytest.raises(client.GuestError):
        client.ProcessInfo.parse({"pid": True, "cmd": "", "user": "", "running": True,
                                  "exit_code": None, "started_at": 0})
    with pytest.raises(client.GuestError):
        client._exec_event({"event": "start", "pid": "1"}, b"")
