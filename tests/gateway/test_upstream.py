"""The upstream client (router/upstream.py) against real sockets: raw asyncio servers that answer as a
worker would, or misbehave as one can (close an idle keep-alive connection, answer garbage, stall,
delimit a body by closing). A raw server is used because the cases are about bytes on the wire."""
from __future__ import annotations

import asyncio

import pytest

from router.config import Settings
from router.upstream import Upstream, UpstreamError

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length"))
    return head + await reader.readexactly(n)


def client(**kw) -> Upstream:
    return Upstream(Settings(**{"connect_timeout_s": 2.0, "request_timeout_s": 2.0, **kw}))


async def test_keep_alive_reuse_and_resend_after_an_idle_close():
    """The worker answers one request per connection and then closes it (as an expired keep-alive does):
    the next request finds the pooled connection dead and is sent again on a new one, not failed."""
    conns = 0

    async def handler(reader, writer):
        nonlocal conns
        conns += 1
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    server, url = await serve(handler)
    up = client()
    for _ in range(3):
        r = await up.open("POST", url + "/v1/completions", b'{"a":1}', {"content-type": "application/json"})
        assert r.status == 200 and await r.read() == b"{}"
        r.close()
        await asyncio.sleep(0.2)  # the worker has closed the idle connection by now
    assert conns == 3
    await up.close()
    server.close()


async def test_requests_share_one_connection_when_the_worker_keeps_it():
    conns = 0

    async def handler(reader, writer):
        nonlocal conns
        conns += 1
        try:
            while True:
                req = await read_request(reader)
                assert b"x-request-id: r1" in req and req.endswith(b"hello")
                writer.write(OK)
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    server, url = await serve(handler)
    up = client()
    for _ in range(5):
        r = await up.open("POST", url + "/v1/x", b"hello", {"x-request-id": "r1"}, query="a=1")
        assert await r.read() == b"{}"
        r.close()
    assert conns == 1
    await up.close()
    server.close()


async def test_chunked_stream_eof_body_garbage_and_stall():
    async def handler(reader, writer):
        try:
            while await one(await read_request(reader), writer):
                pass
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def one(req: bytes, writer) -> bool:
        """Answer one request; False when the connection ends after it."""
        if b"/stream" in req:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(3):
                data = b"data: %d\n\n" % i
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        if b"/eof" in req:
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        elif b"/garbage" in req:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif b"/stall" in req:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            await writer.drain()
            await asyncio.sleep(5)
        await writer.drain()
        return False

    server, url = await serve(handler)
    up = client(request_timeout_s=0.5)
    r = await up.open("GET", url + "/stream", b"", {})
    assert r.headers["content-type"] == "text/event-stream"
    assert [c async for c in r.chunks()] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    r.close()
    r = await up.open("GET", url + "/eof", b"", {})
    assert await r.read() == b"until the end"
    r.close()
    with pytest.raises(UpstreamError) as e:
        await up.open("GET", url + "/garbage", b"", {})
    assert e.value.kind == "protocol"
    r = await up.open("GET", url + "/stall", b"", {})
    with pytest.raises(UpstreamError) as e:
        await r.read()
    assert e.value.kind == "timeout"
    r.close()
    await up.close()
    server.close()


async def test_refused_is_a_connect_error_and_connections_are_bounded():
    up = client()
    with pytest.raises(UpstreamError) as e:
        await up.open("GET", "http://127.0.0.1:1/x", b"", {})
    assert e.value.kind == "connect"

    release = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        await release.wait()
        writer.write(OK)
        await writer.drain()
        writer.close()

    server, url = await serve(handler)
    up = client(max_connections=2, connect_timeout_s=0.3)
    first = [asyncio.create_task(up.open("GET", url + "/x", b"", {})) for _ in range(2)]
    await asyncio.sleep(0.1)
    with pytest.raises(UpstreamError) as e:  # a third request waits for a connection, then times out
        await up.open("GET", url + "/x", b"", {})
    assert e.value.kind == "timeout"
    release.set()
    for t in first:
        r = await t
        assert await r.read() == b"{}"
        r.close()
    await up.close()
    server.close()


async def test_a_slow_reader_pauses_the_worker_socket():
    """A 4 MB answer read slowly: the client never buffers much more than its high-water mark."""
    from router import upstream as mod

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (4 << 20))
        for _ in range(64):
            writer.write(b"x" * (64 << 10))
            await writer.drain()
        writer.close()

    server, url = await serve(handler)
    up = client()
    r = await up.open("GET", url + "/big", b"", {})
    total, peak = 0, 0
    async for c in r.chunks():
        total += len(c)
        peak = max(peak, r._buffered)
        await asyncio.sleep(0.001)
    assert total == 4 << 20
    assert peak <= mod.HIGH_WATER + (1 << 20)
    r.close()
    await up.close()
    server.close()


async def test_control_get_reads_a_whole_answer_and_bounds_a_trickle():
    """The registry's health checks and scrapes (``Upstream.get``): a chunked /metrics-like answer comes back
    whole; a worker that keeps sending a byte at a time (never idle long enough for the between-bytes
    timeout) still fails within the pool's timeout in all, as a timeout, and a refused port as a connect."""
    body = b"# HELP x\n" + b"vllm:num_requests_running 3\n" * 2000

    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /metrics"):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 7000):
                part = body[i:i + 7000]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
        else:  # /health: a trickle, a byte every 0.1 s
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
            for _ in range(1000):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.1)
        await writer.drain()

    server, url = await serve(handler)
    up = Upstream(Settings(), timeout_s=0.5)
    assert await up.get(url + "/metrics") == (200, body)
    t = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamError) as e:
        await up.get(url + "/health")
    assert e.value.kind == "timeout" and asyncio.get_running_loop().time() - t < 2.0
    server.close()
    with pytest.raises(UpstreamError) as e:
        await up.get(url.rsplit(":", 1)[0] + ":1/health")
    assert e.value.kind == "connect"
    await up.close()


async def test_an_interim_head_is_skipped_for_the_final_one():
    """A worker may send interim heads (100 Continue, 103 Early Hints) before its answer: the response is
    the final head and its body, not the first head (which has none)."""

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                     b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n" + OK)
        await writer.drain()

    server, url = await serve(handler)
    up = client()
    r = await up.open("POST", url + "/v1/completions", b'{"a":1}', {"content-type": "application/json"})
    assert r.status == 200 and r.headers.get("link") is None and await r.read() == b"{}"
    r.close()
    await up.close()
    server.close()
