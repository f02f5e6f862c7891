"""The upstream HTTP seam: how the proxy talks to workers on the request path.

aiohttp's client costs about a seventh of httpx's CPU per proxied request on this machine (0.1 ms vs
0.75 ms measured with bench/mock_worker.py), and the gateway's overhead goal is sub-millisecond, so the
hot path uses aiohttp; control traffic (health, /metrics, /v1/models, /tokenize) stays on httpx. Bodies
are passed through undecoded (``auto_decompress=False``) so the client gets the worker's bytes.
"""
from __future__ import annotations

import asyncio

import aiohttp
from yarl import URL

from router.config import Settings


class UpstreamError(Exception):
    """A failure talking to a worker. ``kind``: "connect" (refused/unreachable), "timeout", "protocol"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _classify(e: BaseException) -> UpstreamError:
    if isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ClientConnectionResetError))\
            and not isinstance(e, aiohttp.ServerDisconnectedError):
        return UpstreamError("connect", f"{type(e).__name__}: {e}")
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamError("timeout", f"{type(e).__name__}: {e}")
    return UpstreamError("protocol", f"{type(e).__name__}: {e}")


class UpstreamResponse:
    """A worker's response, read incrementally. ``close()`` drops the connection (cancels the request)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = resp.headers

    async def chunks(self):
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _classify(e) from e

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _classify(e) from e

    def close(self) -> None:
        """Return a fully read connection to the pool, or drop an unfinished one."""
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class Upstream:
    """A pooled client for forwarding requests (bounded connections, connect and read timeouts)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    def _get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            s = self.settings
            connector = aiohttp.TCPConnector(limit=s.max_connections, limit_per_host=0, keepalive_timeout=30,
                                             enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",),
                timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s,
                                              sock_read=s.request_timeout_s))
        return self._session

    async def open(self, method: str, url: str, body: bytes, headers: dict[str, str],
                   query: str = "") -> UpstreamResponse:
        """Send the request and wait for the response head."""
        if query:
            url = f"{url}?{query}"
        try:
            resp = await self._get().request(method, URL(url, encoded=True), data=body if body else None, headers=headers,
                                             allow_redirects=False, compress=None)
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _classify(e) from e
        return UpstreamResponse(resp)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
