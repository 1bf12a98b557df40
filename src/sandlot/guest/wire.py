"""Framing of the host <-> guest agent channel (the guest's end: guest/go/wire).

A frame is::

    MAGIC (4 bytes) | header_len (u32 BE) | payload_len (u32 BE) | header | payload

where the header is a UTF-8 JSON object.

Both sides treat the peer as hostile: lengths are capped before anything is allocated, and a
reader that meets bytes that are not a frame start (left over from a connection that dropped
mid-frame, or a VM restored from a snapshot taken mid-write) skips ahead to the next MAGIC.
"""

from __future__ import annotations

import json
import struct

MAGIC = b"\xa5SL1"
# Why these caps: a header is a small JSON object (the largest is an env map); payloads are file
# chunks and output chunks, which senders split at CHUNK_SIZE.
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 4 << 20
CHUNK_SIZE = 1 << 20

_PREFIX = struct.Struct(">4sII")
PREFIX_SIZE = _PREFIX.size


class FrameError(ValueError):
    """The peer sent something that is not a valid frame."""


def encode(header: dict, payload: bytes = b"") -> bytes:
    """Serialize one frame."""
    head = json.dumps(header, separators=(",", ":")).encode()
    if len(head) > MAX_HEADER or len(payload) > MAX_PAYLOAD:
        raise FrameError("frame too large")
    return _PREFIX.pack(MAGIC, len(head), len(payload)) + head + payload


class FrameDecoder:
    """Incremental decoder: feed bytes, iterate complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.skipped = 0

    def reset(self) -> None:
        self._buf.clear()

    def feed(self, data: bytes) -> list[tuple[dict, bytes]]:
        self._buf += data
        frames: list[tuple[dict, bytes]] = []
        while True:
            start = self._buf.find(MAGIC)
            if start < 0:
                # Keep a possible partial MAGIC at the end.
                keep = len(MAGIC) - 1
                self.skipped += max(0, len(self._buf) - keep)
                del self._buf[: max(0, len(self._buf) - keep)]
                return frames
            if start:
                self.skipped += start
                del self._buf[:start]
            if len(self._buf) < PREFIX_SIZE:
                return frames
            _, hlen, plen = _PREFIX.unpack_from(self._buf)
            if hlen > MAX_HEADER or plen > MAX_PAYLOAD or hlen == 0:
                del self._buf[:1]  # not a real frame start: resync
                continue
            total = PREFIX_SIZE + hlen + plen
            if len(self._buf) < total:
                return frames
            raw_head = bytes(self._buf[PREFIX_SIZE : PREFIX_SIZE + hlen])
            payload = bytes(self._buf[PREFIX_SIZE + hlen : total])
            try:
                header = json.loads(raw_head)
                if not isinstance(header, dict):
                    raise ValueError
            except ValueError:
                del self._buf[:1]
                continue
            del self._buf[:total]
            frames.append((header, payload))
