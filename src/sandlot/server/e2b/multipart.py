"""A streaming ``multipart/form-data`` reader for envd's ``POST /files``: each part's body is
passed on in chunks as it arrives, so an upload is never held whole in memory."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from sandlot.errors import InvalidArgumentError

# Why: part headers come from API clients; real ones are a few hundred bytes.
MAX_HEADERS = 16 << 10
MAX_PARTS = 10000
_BOUNDARY = re.compile(r'boundary="?([^";,]+)"?', re.I)
_PARAM = re.compile(r';\s*([a-zA-Z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def boundary_of(content_type: str) -> bytes:
    m = _BOUNDARY.search(content_type)
    if not m or len(m.group(1)) > 200:
        raise InvalidArgumentError("multipart body without a usable boundary")
    return m.group(1).strip().encode()


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    # httpx and browsers escape quotes and newlines in file names as %22, %0D, %0A.
    return value.replace("%22", '"').replace("%0D", "\r").replace("%0A", "\n")


class Part:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        disposition = headers.get("content-disposition", "")
        params = {k.lower(): _unquote(v) for k, v in _PARAM.findall(disposition)}
        self.name = params.get("name")
        self.filename = params.get("filename")


class MultipartReader:
    """``async for part in reader``: read `reader.body()` for each part before the next."""

    def __init__(self, chunks: AsyncIterator[bytes], boundary: bytes) -> None:
        self._chunks = chunks.__aiter__()
        self._delim = b"\r\n--" + boundary
        # A CRLF in front lets the first boundary match the same delimiter as the others.
        self._buf = bytearray(b"\r\n")
        self._in_body = False
        self._done = False
        self._parts = 0

    async def _fill(self) -> None:
        try:
            self._buf += await anext(self._chunks)
        except StopAsyncIteration:
            raise InvalidArgumentError("the multipart body ended early") from None

    async def _skip_to_delimiter(self) -> None:
        while (i := self._buf.find(self._delim)) < 0:
            del self._buf[:max(0, len(self._buf) - len(self._delim))]
            await self._fill()
        del self._buf[:i + len(self._delim)]

    def __aiter__(self) -> MultipartReader:
        return self

    async def __anext__(self) -> Part:
        if self._done:
            raise StopAsyncIteration
        if self._in_body:
            async for _ in self.body():
                pass
        elif self._parts == 0:
            await self._skip_to_delimiter()
        while len(self._buf) < 2:
            await self._fill()
        if self._buf[:2] == b"--":
            self._done = True
            raise StopAsyncIteration
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            if len(self._buf) > MAX_HEADERS:
                raise InvalidArgumentError("multipart part headers are too large")
            await self._fill()
        raw = bytes(self._buf[:end]).decode("utf-8", "replace")
        del self._buf[:end + 4]
        headers = {}
        for line in raw.split("\r\n")[1:]:  # the first line is the rest of the delimiter line
            key, sep, value = line.partition(":")
            if sep:
                headers[key.strip().lower()] = value.strip()
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise InvalidArgumentError(f"more than {MAX_PARTS} parts")
        self._in_body = True
        return Part(headers)

    async def body(self) -> AsyncIterator[bytes]:
        """The current part's bytes, chunk by chunk, up to the next delimiter."""
        keep = len(self._delim) - 1
        while self._in_body:
            i = self._buf.find(self._delim)
            if i >= 0:
                data = bytes(self._buf[:i])
                del self._buf[:i + len(self._delim)]
                self._in_body = False
                if data:
                    yield data
                return
            if len(self._buf) > keep:
                data = bytes(self._buf[:-keep])
                del self._buf[:-keep]
                yield data
            await self._fill()
