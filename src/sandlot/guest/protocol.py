"""The ops of the host <-> guest agent protocol: names, request fields, reply fields, events.

The one source of truth for both ends. The guest's agent (Go, guest/go/agent) registers one
handler per op named here, and `sandlot-agent -describe` lists them; the host client sends only
ops and fields named here (`request_header`); tests/unit/test_guest_protocol.py checks both ends
and docs/guest-protocol.md against it.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTO_VERSION = 1

# Fields of a file system entry (stat, list, write, mkdir, rename answer with these).
ENTRY_FIELDS = ("name", "path", "type", "size", "mode", "owner", "mtime", "target", "metadata")
# Fields of one process in a `ps` answer.
PROCESS_FIELDS = ("pid", "cmd", "user", "running", "exit_code", "started_at", "pty")
# Error types an error reply may carry.
ERROR_TYPES = ("not_found", "invalid", "permission", "internal")
# Frames that continue a request already sent (same id), not ops of their own.
CONTINUATIONS = ("credit", "chunk", "end")


@dataclass(frozen=True)
class Op:
    """One request type: what the host may send and what the agent answers."""

    name: str
    request: tuple[str, ...] = ()  # header fields besides `id` and `op`
    reply: tuple[str, ...] = ()  # fields of the final answer besides `id` and `ok`
    events: tuple[str, ...] = ()  # `event` values streamed before (or as) the answer
    payload: bool = False  # the request's frame carries a payload
    doc: str = ""


OPS: dict[str, Op] = {op.name: op for op in (
    Op("hello", ("nonce", "proto"), ("hello", "generation"),
       doc="opens a session; drops the previous session's subscriptions and uploads"),
    Op("ping", (), ("time_ns",), doc="the guest's wall clock"),
    Op("step_clock", ("delta_ns",), ("time_ns",), doc="moves the wall clock by delta_ns"),
    Op("configure", ("time_ns", "entropy", "env", "generation", "cpus", "freeze",
                     "disk_bytes"),
       ("time_ns", "cpus", "mem_kb", "disk_bytes"),
       doc="sets the clock, reseeds the RNG (base64 entropy), replaces the base env, writes "
           "/run/sandlot/generation, onlines cpus; freeze: collects the agent's garbage and "
           "returns its free memory before a template snapshot; disk_bytes: once the root "
           "disk is at least that big (the host grew it), grows the root filesystem to fill "
           "it and answers its size"),
    Op("exec", ("cmd", "env", "cwd", "user", "timeout", "stdin", "stream", "keep_stdin",
                "track", "window", "pty"), ("pid",), ("start", "stdout", "stderr", "exit"),
       payload=True, doc="runs bash -c cmd in its own process group; stdin: the payload is "
                         "its input; with window, at most that many output events ahead of "
                         "credits; pty {cols, rows}: in a new session on a pseudo-terminal "
                         "(TERM=xterm-256color), its output all `stdout`"),
    Op("attach", ("pid", "replay", "window"), (), ("stdout", "stderr", "exit"),
       doc="buffered output (replay), then live output, then exit; window as for exec"),
    Op("stdin", ("pid", "eof"), (), payload=True,
       doc="writes the payload to a process (eof on a terminal: Ctrl-D)"),
    Op("resize", ("pid", "cols", "rows"), (), doc="sets a terminal's size (SIGWINCH)"),
    Op("kill", ("pid", "signal"), ("killed",), doc="signals a process group"),
    Op("ps", ("all",), ("processes",), doc="processes exec started (running ones unless all)"),
    Op("read", ("path", "window"), ("end",), ("begin", "data"),
       doc="streams a file; with window, at most that many data events ahead of credits"),
    Op("write", ("path", "user", "mode", "eof", "metadata", "window"), ENTRY_FIELDS, ("ack",),
       payload=True,
       doc="then chunk frames with payloads and an end frame; written to a temp file and "
           "renamed into place; metadata: `user.e2b.<key>` xattrs of the new file; with "
           "window, an `ack` event per chunk written (the host sends at most window ahead)"),
    Op("list", ("path", "depth", "max_entries"), ("entries",),
       doc="entries under a directory; more than max_entries (or a reply over the frame "
           "limit) is an `invalid` error"),
    Op("stat", ("path",), ENTRY_FIELDS, doc="one entry (symlinks not followed)"),
    Op("exists", ("path",), ("exists",)),
    Op("remove", ("path",), (), doc="a file, symlink or directory tree"),
    Op("mkdir", ("path", "user"), ("created", *ENTRY_FIELDS), doc="with parents"),
    Op("rename", ("src", "dst"), ENTRY_FIELDS),
    Op("mount", ("path", "token", "user"), (),
       doc="mounts a volume at path (FUSE; its requests come to the host as `vreq` frames): "
           "token is the host's capability for it, its files appear owned by user"),
)}

# Events that end a stream: `exit` for processes; an answer with `ok` and no event for reads.
EXIT_EVENT = "exit"
# Fields of an `exit` event.
EXIT_FIELDS = ("exit_code", "timed_out", "pid")
# Fields of a read's `begin` event.
BEGIN_FIELDS = ("size",)


def request_header(rid: int, op: str, fields: dict) -> dict:
    """The header of request `rid`: refuses ops and fields the protocol does not have."""
    spec = OPS.get(op)
    if spec is None:
        raise ValueError(f"unknown agent op {op!r}")
    unknown = set(fields) - set(spec.request)
    if unknown:
        raise ValueError(f"agent op {op!r} has no fields {sorted(unknown)}")
    return {"id": rid, "op": op, **{k: v for k, v in fields.items() if v is not None}}
