"""Connect protocol framing with the JSON codec, as envd speaks it to the E2B SDK (HTTP/1.1).

Unary calls:  POST ``application/json``; the body is one JSON message. The answer is
              ``200 application/json``, or an error status with ``{"code", "message"}``.
Streams:      POST ``application/connect+json``. Each message is an envelope: one flag byte,
              a 4-byte big-endian length, then the JSON. A server stream ends with an envelope
              whose flags carry END_STREAM, holding ``{}`` or ``{"error": {...}}``; its HTTP
              status is always 200. A client stream sends many envelopes in the request body.

Message fields are protobuf JSON: camelCase names (the original snake_case names are accepted
on input too), enums as their names, bytes as base64, 64-bit integers as strings.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sandlot.errors import InvalidArgumentError
from sandlot.server.e2b.errors import Unsupported, connect_error, connect_unary_error

STREAM_TYPE = "application/connect+json"
FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
# Why: request messages come from API clients; envd's own messages are small (commands, paths,
# stdin chunks). Anything larger is refused before it is buffered.
MAX_MESSAGE = 8 << 20
MAX_TIMEOUT_DIGITS = 10


def envelope(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(error: dict | None = None) -> bytes:
    return envelope({"error": error} if error else {}, FLAG_END_STREAM)


def field(msg: dict, camel: str, snake: str | None = None, default=None):
    """A message field by its JSON (camelCase) name or its proto (snake_case) name."""
    if camel in msg:
        return msg[camel]
    if snake and snake in msg:
        return msg[snake]
    return default


# A request message's schema, from envd's .proto files: {json name: type}, where a type is
# "string", "bool", "bytes", "enum", "uint32", a nested schema (a message), ["repeated", type]
# or ["map", type] (string keys). Unknown fields are ignored and null is a field's default, as
# protobuf JSON has them.
Schema = dict
_SCALARS = {"string": str, "bool": bool, "bytes": str}
UINT32_MAX = (1 << 32) - 1


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def _check_value(value, kind, where: str) -> None:
    if value is None:
        return
    if isinstance(kind, dict):
        check(value, kind, where)
    elif isinstance(kind, list):
        container, inner = kind
        if container == "repeated" and not isinstance(value, list):
            raise InvalidArgumentError(f"{where} must be a list")
        if container == "map" and not isinstance(value, dict):
            raise InvalidArgumentError(f"{where} must be an object")
        for i, item in (enumerate(value) if container == "repeated" else value.items()):
            _check_value(item, inner, f"{where}[{i!r}]")
    elif kind == "uint32":
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or \
                not 0 <= value <= UINT32_MAX:
            raise InvalidArgumentError(f"{where} must be an integer from 0 to {UINT32_MAX}")
    elif kind == "enum":
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise InvalidArgumentError(f"{where} must be an enum name or number")
    elif not isinstance(value, _SCALARS[kind]):
        raise InvalidArgumentError(f"{where} must be a {'string' if kind == 'bytes' else kind}")


def check(msg: dict, schema: Schema, where: str = "the request") -> dict:
    """`msg` with every field `schema` names of its type; InvalidArgumentError otherwise, so
    that a handler never meets a field of the wrong type."""
    if not isinstance(msg, dict):
        raise InvalidArgumentError(f"{where} must be a JSON object")
    for name, kind in schema.items():
        for key in {name, _snake(name)}:
            if key in msg:
                _check_value(msg[key], kind, f"{where}.{key}" if where != "the request"
                             else key)
    return msg


def b64decode(value) -> bytes:
    if not value:
        return b""
    if not isinstance(value, str):
        raise InvalidArgumentError("bytes fields must be base64 strings")
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_"
                                if ("-" in value or "_" in value) else None, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError("invalid base64 in a bytes field") from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


def timeout_s(request: Request) -> float | None:
    """The call's deadline from ``Connect-Timeout-Ms``, in seconds; None when absent."""
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    if len(raw) > MAX_TIMEOUT_DIGITS or not raw.isdigit():
        raise InvalidArgumentError(f"invalid Connect-Timeout-Ms header {raw!r}")
    return int(raw) / 1000 or None


def _parse(data: bytes) -> dict:
    try:
        msg = json.loads(data or b"{}")
    except (ValueError, RecursionError):
        raise InvalidArgumentError("the request message is not valid JSON") from None
    if not isinstance(msg, dict):
        raise InvalidArgumentError("the request message must be a JSON object")
    return msg


async def _read_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE + 5:
            raise InvalidArgumentError(f"request larger than {MAX_MESSAGE} bytes")
    return bytes(body)


def _check_flags(flags: int) -> None:
    if flags & FLAG_COMPRESSED:
        raise Unsupported("compressed Connect messages are not supported; send identity")


async def read_unary(request: Request) -> dict:
    return _parse(await _read_body(request))


async def read_single_envelope(request: Request) -> dict:
    """The one request message of a server-streaming call."""
    body = await _read_body(request)
    if len(body) < 5:
        raise InvalidArgumentError("a streaming request needs one enveloped message")
    flags, length = struct.unpack(">BI", body[:5])
    _check_flags(flags)
    if length != len(body) - 5:
        raise InvalidArgumentError("the request envelope's length does not match its body")
    return _parse(body[5:])


async def read_envelopes(request: Request) -> AsyncIterator[dict]:
    """The messages of a client stream, as they arrive."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        while len(buf) >= 5:
            flags, length = struct.unpack(">BI", buf[:5])
            if length > MAX_MESSAGE:
                raise InvalidArgumentError(f"message larger than {MAX_MESSAGE} bytes")
            if len(buf) < 5 + length:
                break
            data = bytes(buf[5:5 + length])
            del buf[:5 + length]
            _check_flags(flags)
            if flags & FLAG_END_STREAM:
                return
            yield _parse(data)
    if buf:
        raise InvalidArgumentError("the request stream ended inside a message")


async def unary(request: Request, handler: Callable[[dict], Awaitable[dict]],
                where: str) -> Response:
    """Run a unary handler: parse, call, encode; any error becomes a Connect error."""
    try:
        return JSONResponse(await handler(await read_unary(request)))
    except Exception as e:  # noqa: BLE001 - every failure is answered as a Connect error
        return connect_unary_error(e, where)


def server_stream(messages: AsyncIterator[dict], where: str) -> StreamingResponse:
    """Answer a server-streaming call. Errors from `messages` (also the ones raised before its
    first message) end the stream as Connect errors; the HTTP status stays 200."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for msg in messages:
                yield envelope(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sent to the client as the end-stream error
            yield end_stream(connect_error(e, where))
            return
        finally:
            aclose = getattr(messages, "aclose", None)
            if aclose is not None:
                await aclose()
        yield end_stream()

    return StreamingResponse(body(), media_type=STREAM_TYPE)


def stream_error(exc: BaseException, where: str) -> StreamingResponse:
    """A streaming call that fails before it starts: 200 with just the end-stream error."""

    async def body() -> AsyncIterator[bytes]:
        yield end_stream(connect_error(exc, where))

    return StreamingResponse(body(), media_type=STREAM_TYPE)
