# Generated from src/sandlot/sdk/_async/_http.py by scripts/unasync.py; do not edit.
# ruff: noqa: I001
"""The one place the SDK sends HTTP requests (sync)."""

from __future__ import annotations

from typing import Any

import httpx

from .. import _base
from .._models import CommandResult


class API:
    """Server URL, API key and an httpx client, opened lazily and reopened after `close`.

    Every request goes through `send`, which maps transport failures and error answers to
    `sandlot.errors` classes via `_base`.
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, *,
                 transport: httpx.BaseTransport | None = None,
                 request_timeout: float | httpx.Timeout | None = None) -> None:
        self.api_url, self.api_key = _base.resolve_config(api_url, api_key)
        self._transport = transport
        self._request_timeout = request_timeout
        self._client: httpx.Client | None = None

    def _http(self) -> httpx.Client:
        if self._client is None or self._client.is_closed:
            kwargs = _base.client_kwargs(self.api_url, self.api_key, self._request_timeout)
            self._client = httpx.Client(transport=self._transport, **kwargs)
        return self._client

    def close(self) -> None:
        """Close the connection pool; a later request opens a new one."""
        if self._client is not None:
            client, self._client = self._client, None
            client.close()

    def send(self, req: _base.Request, *, content: Any = None, stream: bool = False,
             timeout: httpx.Timeout | None = None) -> httpx.Response:
        """Send `req`; raise the sandlot error for any failure. With `stream` the body is unread
        and the caller must close the response."""
        with _base.map_transport_errors(self.api_url):
            client = self._http()
            request = client.build_request(
                req.method, req.path, params=req.params or None, json=req.json,
                content=content, timeout=timeout or req.timeout or client.timeout,
                headers=req.headers or None,
            )
            response = client.send(request, stream=stream)
            if response.is_error:
                try:
                    response.read()
                finally:
                    response.close()
                raise _base.error_from_response(response.status_code, response.content,
                                                has_key=self.api_key is not None)
        return response

    def call(self, req: _base.Request, *, content: Any = None,
             timeout: httpx.Timeout | None = None) -> Any:
        """Send `req` and return its parsed JSON body (None for an empty body)."""
        response = self.send(req, content=content, timeout=timeout)
        return _base.parse_json(response.content)

    def stream_events(self, req: _base.Request, events: _base.CommandStream,
                      timeout: httpx.Timeout | None) -> CommandResult:
        """Send `req`, feed each NDJSON line of the answer to `events`, return its result."""
        response = self.send(req, stream=True, timeout=timeout)
        try:
            with _base.map_transport_errors(self.api_url):
                for line in response.iter_lines():
                    events.feed(line)
        finally:
            response.close()
        return events.result()


class ByteStream:
    """An iterator of the byte chunks of a downloaded file.

    The download is open until the iterator is exhausted or closed; use it as
    ``with`` block (or call `close`) if you may stop early.
    """

    def __init__(self, api: API, response: httpx.Response) -> None:
        self._api = api
        self._response = response
        self._chunks = response.iter_bytes()

    def __iter__(self) -> ByteStream:
        return self

    def __next__(self) -> bytes:
        with _base.map_transport_errors(self._api.api_url):
            try:
                return self._chunks.__next__()
            except StopIteration:
                self.close()
                raise

    def close(self) -> None:
        """Stop the download and release the connection."""
        self._response.close()

    def __enter__(self) -> ByteStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
