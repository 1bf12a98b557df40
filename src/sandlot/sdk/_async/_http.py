"""The one place the SDK sends HTTP requests (async)."""

from __future__ import annotations

from typing import Any

import httpx

from .. import _base
from .._models import CommandResult


class AsyncAPI:
    """Server URL, API key and an httpx client, opened lazily and reopened after `aclose`.

    Every request goes through `send`, which maps transport failures and error answers to
    `sandlot.errors` classes via `_base`.
    """

    def __init__(self, api_url: str | None = None, api_key: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 request_timeout: float | httpx.Timeout | None = None) -> None:
        self.api_url, self.api_key = _base.resolve_config(api_url, api_key)
        self._transport = transport
        self._request_timeout = request_timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            kwargs = _base.client_kwargs(self.api_url, self.api_key, self._request_timeout)
            self._client = httpx.AsyncClient(transport=self._transport, **kwargs)
        return self._client

    async def aclose(self) -> None:
        """Close the connection pool; a later request opens a new one."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def send(self, req: _base.Request, *, content: Any = None, stream: bool = False,
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
            response = await client.send(request, stream=stream)
            if response.is_error:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                raise _base.error_from_response(response.status_code, response.content,
                                                has_key=self.api_key is not None)
        return response

    async def call(self, req: _base.Request, *, content: Any = None,
                   timeout: httpx.Timeout | None = None) -> Any:
        """Send `req` and return its parsed JSON body (None for an empty body)."""
        response = await self.send(req, content=content, timeout=timeout)
        return _base.parse_json(response.content)

    async def stream_events(self, req: _base.Request, events: _base.CommandStream,
                            timeout: httpx.Timeout | None) -> CommandResult:
        """Send `req`, feed each NDJSON line of the answer to `events`, return its result."""
        response = await self.send(req, stream=True, timeout=timeout)
        try:
            with _base.map_transport_errors(self.api_url):
                async for line in response.aiter_lines():
                    events.feed(line)
        finally:
            await response.aclose()
        return events.result()


class AsyncByteStream:
    """An async iterator of the byte chunks of a downloaded file.

    The download is open until the iterator is exhausted or closed; use it as
    ``async with`` block (or call `aclose`) if you may stop early.
    """

    def __init__(self, api: AsyncAPI, response: httpx.Response) -> None:
        self._api = api
        self._response = response
        self._chunks = response.aiter_bytes()

    def __aiter__(self) -> AsyncByteStream:
        return self

    async def __anext__(self) -> bytes:
        with _base.map_transport_errors(self._api.api_url):
            try:
                return await self._chunks.__anext__()
            except StopAsyncIteration:
                await self.aclose()
                raise

    async def aclose(self) -> None:
        """Stop the download and release the connection."""
        await self._response.aclose()

    async def __aenter__(self) -> AsyncByteStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
