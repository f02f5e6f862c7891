"""The upstream HTTP seam: how the proxy talks to workers on the request path.

A small pooled HTTP/1.1 client: asyncio protocols, httptools (the C parser uvicorn uses) for responses,
keep-alive connections per worker. Measured on this machine against bench/mock_worker.py, a small proxied
request costs 37 us of client CPU here against 147 us with aiohttp's client (and 0.75 ms with httpx), on
a gateway whose whole budget per small request is well under a millisecond (docs/BENCHMARKS.md). The
registry's control traffic (health checks, /metrics scrapes, /v1/models, /kv_event_sources: two calls per
worker per health interval) uses a second pool of this client (:meth:`Upstream.get`); /tokenize and the
prefetch orders stay on httpx.

- Bodies pass through undecoded (no content decoding), so the client gets the worker's bytes; a chunked
  response is de-chunked here and re-framed by the ASGI server.
- A keep-alive connection the worker closed while idle (its keep-alive timeout, uvicorn's 5 s in vLLM)
  can fail a request before any byte of the answer: that request is sent again once on a new connection,
  as HTTP clients do, instead of counting as a failed worker. Idle connections are dropped after
  ``KEEPALIVE_S``, below that timeout.
- Bounded: at most ``max_connections`` open connections (a request waits for one), and a response that
  the client reads slower than the worker writes pauses the worker's socket past ``HIGH_WATER`` bytes.
- Timeouts: ``connect_timeout_s`` to connect, ``request_timeout_s`` between bytes of the answer.
"""
from __future__ import annotations

import asyncio
import collections
import time
from urllib.parse import urlsplit

import httptools

from router.config import Settings

KEEPALIVE_S = 4.0
HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """A failure talking to a worker. ``kind``: "connect" (refused/unreachable), "timeout", "protocol".
    ``refused``: the host answered that nothing listens on the port (a process gone), not that it could not
    be reached (a DNS or routing failure says nothing about the process)."""

    def __init__(self, kind: str, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.refused = refused


_EXPIRED = object()


def _expire(w: asyncio.Future) -> None:
    if not w.done():
        w.set_result(_EXPIRED)


class _Dropped(Exception):
    """The connection closed before any byte of the response (a candidate for one resend)."""


class _Headers:
    """Response headers: names as sent, lookups by lower-case name."""

    __slots__ = ("_items", "_map")

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items
        self._map = {k.lower(): v for k, v in items}

    def get(self, name: str, default=None):
        return self._map.get(name.lower(), default)

    def items(self):
        return self._items

    def __getitem__(self, name: str) -> str:
        return self._map[name.lower()]

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._map


class UpstreamResponse:
    """A worker's response, read incrementally. ``close()`` returns the connection to the pool when the
    response was read to its end, and drops it otherwise (which cancels the request on the worker)."""

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.headers: _Headers = _Headers([])
        self._raw_headers: list[tuple[str, str]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._head = False
        self.complete = False
        self.keep_alive = False
        self._error: UpstreamError | None = None
        self._got_bytes = False

    # -- fed by the connection ------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _fail(self, err: UpstreamError) -> None:
        if not self.complete and self._error is None:
            self._error = err
        self._wake()

    # -- read by the proxy ----------------------------------------------------------------------------
    async def _wait(self, timeout: float) -> None:
        """Until the connection feeds something, or ``timeout`` (a bare timer: asyncio.wait_for cost 30 us
        a call here, and a request waits two or three times)."""
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, w)
        try:
            await w
        finally:
            timer.cancel()
            self._waiter = None
        if w.result() is _EXPIRED:
            raise UpstreamError("timeout", f"no data from the worker for {timeout:g} s")

    async def head(self, timeout: float) -> None:
        while not self._head:
            if self._error is not None:
                if not self._got_bytes:
                    raise _Dropped(str(self._error))
                raise self._error
            await self._wait(timeout)

    async def chunks(self):
        timeout = self._conn.read_timeout
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._buffered <= HIGH_WATER // 2:
                    self._conn.resume()
                yield data
                continue
            if self.complete:
                return
            if self._error is not None:
                raise self._error
            await self._wait(timeout)

    async def read(self) -> bytes:
        parts = [c async for c in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._conn.release(self)


class _Conn(asyncio.Protocol):
    """One keep-alive connection to a worker, and the parser of the response on it."""

    def __init__(self, pool: Upstream, key: tuple[str, int], read_timeout: float) -> None:
        self.pool, self.key, self.read_timeout = pool, key, read_timeout
        self.transport: asyncio.Transport | None = None
        self.resp: UpstreamResponse | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.uses = 0
        self._paused = False
        self._interim = False  # parsing an interim (1xx) head's message
        self._name: bytes | None = None

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:  # bytes nobody asked for: the connection is no longer reusable
            self.abort()
            return
        r._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            r._fail(UpstreamError("protocol", f"invalid HTTP response: {e}"))
            self.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._closed(self)
        r = self.resp
        if r is not None and not r.complete:
            if r._head and r.headers.get("content-length") is None and "chunked" not in (
                    r.headers.get("transfer-encoding") or ""):
                r.complete = True  # a body delimited by the end of the connection
                r._wake()
            else:
                r._fail(UpstreamError("protocol", f"the worker closed the connection ({exc or 'EOF'})"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        r = self.resp
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # an interim head (100 Continue, 103 Early Hints)
            r._raw_headers.clear()
            self._interim = True  # its end is not the response's: the final head follows
            return
        r.status = status
        r.keep_alive = self.parser.should_keep_alive()  # valid here, not after the message
        r.headers = _Headers(r._raw_headers)
        r._head = True
        r._wake()

    def on_body(self, body: bytes) -> None:
        self.resp._feed(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        r = self.resp
        r.complete = True
        r._wake()

    # used by the pool and the response
    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        self.resp = UpstreamResponse(self)
        self._interim = False
        self.uses += 1
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return self.resp

    def pause(self) -> None:
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def release(self, resp: UpstreamResponse) -> None:
        if self.resp is not resp:
            return
        if resp.complete and resp.keep_alive and not self.closed:
            self.resp = None
            self.resume()
            self.parser = httptools.HttpResponseParser(self)
            self.pool._idle_put(self)
        else:
            self.resp = None
            self.abort()


class Upstream:
    """A pooled client for forwarding requests (bounded connections, connect and read timeouts). The
    timeouts are the settings' unless ``timeout_s`` is given: the registry keeps a second pool for its
    health checks and scrapes (:meth:`get`), with the health timeout, so a saturated request pool never
    delays them."""

    def __init__(self, settings: Settings, *, timeout_s: float | None = None) -> None:
        self.settings = settings
        self.max_connections = settings.max_connections
        self.connect_timeout_s = settings.connect_timeout_s if timeout_s is None else timeout_s
        self.read_timeout_s = settings.request_timeout_s if timeout_s is None else timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._open = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # requests waiting for a slot

    def _base(self, url: str) -> tuple[str, int, str]:
        u = urlsplit(url)
        try:
            port = u.port  # raises for a port that is no number in 0-65535
        except ValueError:
            port = -1
        # the request line is Latin-1: IDNA hosts only
        if u.scheme != "http" or not u.hostname or not u.hostname.isascii() or port == -1:
            raise UpstreamError("connect", f"unsupported worker URL {url!r} (http://host:port only)")
        return u.hostname, port or 80, u.path or "/"

    def _idle_put(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def _take(self, key) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if not c.closed and not c.transport.is_closing() and now - c.idle_since < KEEPALIVE_S:
                return c
            c.abort()
        return None

    def _closed(self, conn: _Conn) -> None:
        self._open -= 1
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                break

    async def _connect(self, host: str, port: int) -> _Conn:
        if self._open >= self.max_connections:
            for conns in self._idle.values():  # make room by closing an idle connection elsewhere
                if conns:
                    conns.pop(0).abort()
                    break
            else:
                deadline = time.monotonic() + self.connect_timeout_s
                while self._open >= self.max_connections:
                    w = asyncio.get_running_loop().create_future()
                    self._waiters.append(w)
                    try:
                        await asyncio.wait_for(w, max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        raise UpstreamError("timeout", "no free upstream connection") from None
        loop = asyncio.get_running_loop()
        conn = _Conn(self, (host, port), self.read_timeout_s)
        self._open += 1
        try:
            await asyncio.wait_for(loop.create_connection(lambda: conn, host, port), self.connect_timeout_s)
        except TimeoutError:
            self._open -= 1
            raise UpstreamError("timeout", f"connecting to {host}:{port} took over {self.connect_timeout_s:g} s") from None
        except OSError as e:
            self._open -= 1
            raise UpstreamError("connect", f"{type(e).__name__}: {e}",
                                refused=isinstance(e, ConnectionRefusedError)) from None
        return conn

    async def open(self, method: str, url: str, body: bytes, headers: dict[str, str],
                   query: str = "") -> UpstreamResponse:
        """Send the request and wait for the response head."""
        host, port, path = self._base(url)
        target = f"{path}?{query}" if query else path
        lines = [f"{method} {target} HTTP/1.1", f"host: {host}:{port}"]
        lines += [f"{k}: {v}" for k, v in headers.items() if k != "host"]
        lines.append(f"content-length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        key = (host, port)
        for _ in range(2):
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(host, port)
            resp = conn.send(head, body)
            try:
                await resp.head(self.read_timeout_s)
                return resp
            except _Dropped as e:
                conn.abort()
                if reused:
                    continue  # the worker closed an idle keep-alive connection: send it again, once
                raise UpstreamError("protocol", str(e)) from None
            except BaseException:
                conn.abort()
                raise
        raise UpstreamError("protocol", "the worker closed two connections before answering")

    async def get(self, url: str) -> tuple[int, bytes]:
        """``GET url``: its status and whole body, within the read timeout in all (control traffic: a
        health check or a scrape, where httpx cost 20x this client's CPU per call)."""
        try:
            async with asyncio.timeout(self.read_timeout_s):
                resp = await self.open("GET", url, b"", {"accept": "*/*"})
                try:
                    return resp.status, await resp.read()
                finally:
                    resp.close()
        except TimeoutError:
            raise UpstreamError("timeout", f"no whole answer within {self.read_timeout_s:g} s") from None

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.abort()
        self._idle.clear()
