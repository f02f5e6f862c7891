"""End-to-end behaviour of the gateway between a client and fake vLLM workers over real HTTP."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from indexer.hashing import routable_blocks, sequence_hashes
from indexer.index.base import Tier
from tests.gateway.conftest import BLOCK, MODEL

LONG = " ".join(f"the cache block prefix number {i} is long" for i in range(60))


def chat_body(content: str = "Hello the gateway", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def sse_payloads(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


async def wait_until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_non_streaming_byte_exact_and_headers(fleet, start_gateway):
    st = fleet.add("a")
    gw = start_gateway(fleet)
    body = chat_body()
    async with httpx.AsyncClient(timeout=30) as c:
        via = await c.post(gw.url + "/v1/chat/completions", content=json.dumps(body).encode(),
                           headers={"x-request-id": "req-1", "authorization": "Bearer sk-test",
                                    "content-type": "application/json"})
        st.cache.clear()
        direct = await c.post(fleet.url(0) + "/v1/chat/completions", json=body, headers={"x-request-id": "req-1"})
    assert via.status_code == 200
    a, b = via.json(), direct.json()
    a.pop("created"), b.pop("created")
    assert a == b
    assert via.headers["x-kvgate-worker"] == "a"
    assert via.headers["x-kvgate-policy"] == "kv"
    assert int(via.headers["x-kvgate-cached-tokens"]) >= 0
    assert float(via.headers["x-kvgate-predicted-ttft-ms"]) >= 0
    assert via.headers["x-request-id"] == "req-1"
    fwd = st.requests[0]["headers"]
    assert fwd["authorization"] == "Bearer sk-test"
    assert fwd["x-request-id"] == "req-1"
    assert st.requests[0]["raw"] == json.dumps(body).encode()  # the body is forwarded byte for byte
    # Without X-Request-Id the gateway makes one up and sends it to the worker.
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body)
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and st.requests[-1]["headers"]["x-request-id"] == rid
    assert r.json()["id"] == "chatcmpl-" + rid


async def test_streaming_byte_exact_with_usage(fleet, start_gateway):
    st = fleet.add("a")
    gw = start_gateway(fleet)
    body = chat_body(LONG, stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(timeout=30) as c:
        chunks = []
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": "s-1"}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-kvgate-worker"] == "a"
            async for ch in r.aiter_raw():
                chunks.append(ch)
        st.cache.clear()
        direct = await c.post(fleet.url(0) + "/v1/chat/completions", json=body, headers={"x-request-id": "s-1"})
    via = b"".join(chunks)
    strip = lambda raw: [json.loads(e[6:]) if e != b"data: [DONE]" else "DONE" for e in sse_payloads(raw)]
    va, vb = strip(via), strip(direct.content)
    for x in va + vb:
        if isinstance(x, dict):
            x.pop("created")
    assert va == vb
    assert via.endswith(b"data: [DONE]\n\n")
    # A repeat is cached on the worker; the gateway records what vLLM delivered.
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": "s-2"})
        await r.aread()
    d = gw.state.decisions.get("s-2")
    assert d is not None and d.outcome == "ok"
    assert d.prompt_tokens > 100
    assert d.delivered_cached_tokens == routable_blocks(d.prompt_tokens, BLOCK) * BLOCK
    assert d.observed_ttft_ms is not None


@pytest.mark.parametrize("stream", [True, False])
async def test_the_gateways_own_time_to_the_first_byte(fleet, start_gateway, stream):
    """``timings_ms`` says how long the body took to read and what the gateway itself added before the
    client's first byte: not the worker's time. The worker waits 0.6 s before its first token; the
    client waits at least that, the gateway's own share is the rest (and shows on /metrics)."""
    st = fleet.add("a")
    st.first_token_delay_s = 0.6
    gw = start_gateway(fleet)
    body = chat_body(LONG, stream=stream)
    async with httpx.AsyncClient(timeout=30) as c:
        t0 = time.perf_counter()
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": f"fb-{stream}"}) as r:
            client_ms = None
            async for _ in r.aiter_raw():
                if client_ms is None:
                    client_ms = (time.perf_counter() - t0) * 1e3
        text = (await c.get(gw.url + "/metrics")).text
    d = gw.state.decisions.get(f"fb-{stream}")
    assert d is not None and d.outcome == "ok"
    t = d.to_dict()["timings_ms"]
    assert t["read"] >= 0 and t["total"] >= 0
    assert client_ms >= 600
    # the worker's 0.6 s is not the gateway's: what it added is well under it, and no more than the client saw
    assert 0 <= t["first_byte"] < client_ms - 450
    assert t["first_byte"] >= t["total"]  # routing is on the way to the first byte
    assert 'kvgate_routing_overhead_seconds_count{stage="first_byte"} 1.0' in text
    assert 'kvgate_routing_overhead_seconds_count{stage="read"} 1.0' in text


@pytest.mark.parametrize("stream,usage", [(True, True), (True, False), (False, True)])
async def test_a_finished_request_frees_what_it_generated_not_max_tokens(fleet, start_gateway, stream, usage):
    """The worker answers a few words to a request that allowed 4,000 tokens: the gateway's load tracker
    counts the KV it freed (and the LRU clock) at the length the response's usage gives, or, for a stream
    without ``include_usage`` (what most clients send), at the length its events say (one per token, as
    vLLM sends them), and learns the worker's answer length from it."""
    st = fleet.add("a")
    gw = start_gateway(fleet)
    body = chat_body(LONG, max_tokens=4000, stream=stream, **({"stream_options": {"include_usage": True}}
                                                            if stream and usage else {}))
    w = gw.state.registry.get("a")
    rid = f"mt-{stream}-{usage}"
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": rid})
        assert r.status_code == 200
    d = gw.state.decisions.get(rid)
    assert d is not None and d.outcome == "ok" and d.max_tokens == 4000
    prompt = d.prompt_tokens if usage else d.num_tokens  # the gateway's count is exact for this prompt
    assert not d.tokens_estimated and prompt
    prompt_blocks = -(-prompt // BLOCK)
    held = -(-(prompt + st.words - 1) // BLOCK) * BLOCK
    assert st.words < 100 and w.active.kv_freed == held
    # the LRU clock: the blocks it filled (vLLM frees the unfilled last one to the free queue's front)
    assert w.active.released_tokens == (prompt + st.words - 1) // BLOCK * BLOCK
    assert held < (prompt_blocks + 4000 // BLOCK) * BLOCK
    assert w.active.mean_completion == st.words


async def test_streaming_is_not_buffered(fleet, start_gateway):
    """The worker stops mid-stream; the chunks it already sent reach the client meanwhile."""
    st = fleet.add("a", pause_after=3)
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as r:
            got = b""
            it = r.aiter_raw()
            while b"a-says-2" not in got:
                got += await asyncio.wait_for(it.__anext__(), 20)
            assert b"a-says-3" not in got and st.active == 1
            st.release.set()
            async for ch in it:
                got += ch
    assert b"a-says-3" in got and got.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("local_tokenizer", [True, False], ids=["local", "worker-tokenize"])
async def test_prefix_indexed_on_b_goes_to_b(fleet, start_gateway, tokenizer_dir, local_tokenizer):
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet, local_tokenizer=local_tokenizer)
    body = chat_body(LONG)
    from router.config import TokenizerConfig
    from router.local_tokenizer import LocalTokenizer

    toks = LocalTokenizer(tokenizer_dir, TokenizerConfig()).tokenize_chat(body).tokens
    hashes = sequence_hashes(toks, BLOCK, max_blocks=routable_blocks(len(toks), BLOCK))
    gw.call(gw.state.index.store(MODEL, "b", Tier.GPU, hashes))
    # Round robin alternates; kv sends every request to b.
    async with httpx.AsyncClient(timeout=30) as c:
        got = []
        for _ in range(4):
            r = await c.post(gw.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200
            got.append(r.headers["x-kvgate-worker"])
            assert int(r.headers["x-kvgate-cached-tokens"]) == len(hashes) * BLOCK
    assert got == ["b"] * 4
    assert gw.state.decisions.recent(1)[0].tokenizer == ("local" if local_tokenizer else "remote")
    gw.state.set_policy("round_robin")
    async with httpx.AsyncClient(timeout=30) as c:
        rr = [(await c.post(gw.url + "/v1/chat/completions", json=body)).headers["x-kvgate-worker"]
              for _ in range(4)]
    assert set(rr) == {"a", "b"}


async def test_hot_worker_with_long_queue_loses(fleet, start_gateway, tokenizer_dir):
    fleet.add("a")
    hot = fleet.add("b", waiting=400)  # vLLM reports a long queue on b
    gw = start_gateway(fleet)
    await wait_until(lambda: gw.state.registry.get("b").load.waiting == 400)
    body = chat_body(LONG)
    from router.config import TokenizerConfig
    from router.local_tokenizer import LocalTokenizer

    toks = LocalTokenizer(tokenizer_dir, TokenizerConfig()).tokenize_chat(body).tokens
    hashes = sequence_hashes(toks, BLOCK, max_blocks=routable_blocks(len(toks), BLOCK))
    gw.call(gw.state.index.store(MODEL, "b", Tier.GPU, hashes))
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": "hot"})
    assert r.headers["x-kvgate-worker"] == "a"
    d = gw.state.decisions.get("hot")
    b, a = d.candidate("b"), d.candidate("a")
    assert b.cached_tokens > a.cached_tokens  # b holds the prefix ...
    assert b.queue_ms > a.prefill_ms  # ... but its queue costs more than recomputing on a
    # Once the queue drains, the cache hit wins again.
    hot.waiting = 0
    await wait_until(lambda: gw.state.registry.get("b").load.waiting == 0)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body)
    assert r.headers["x-kvgate-worker"] == "b"


async def test_gateway_queue_makes_hot_worker_lose(fleet, start_gateway, tokenizer_dir):
    """In-flight prompt tokens the gateway sent (no first byte yet) count as queue."""
    fast = fleet.add("a")
    slow = fleet.add("b", first_token_delay_s=5.0)
    gw = start_gateway(fleet, routing={"prefill_tokens_per_s": 200.0})
    body = chat_body(LONG, stream=True)
    from router.config import TokenizerConfig
    from router.local_tokenizer import LocalTokenizer

    toks = LocalTokenizer(tokenizer_dir, TokenizerConfig()).tokenize_chat(body).tokens
    hashes = sequence_hashes(toks, BLOCK, max_blocks=routable_blocks(len(toks), BLOCK))
    gw.state.set_policy("round_robin")
    async with httpx.AsyncClient(timeout=60) as c:
        # Pile uncached long prompts onto b (round robin, different texts), then switch to kv.
        tasks = [asyncio.create_task(c.post(gw.url + "/v1/chat/completions",
                                            json=chat_body(f"{i} " + LONG * 3, stream=True)))
                 for i in range(8)]
        # All eight routed, and a's four done at the gateway too (a slow CI core can still be streaming
        # them; then a has the same queue as b and b's cache hit rightly wins).
        await wait_until(lambda: slow.active >= 4 and len(fast.requests) + len(slow.requests) == 8
                         and gw.state.registry.get("a").inflight == 0)
        gw.call(gw.state.index.store(MODEL, "b", Tier.GPU, hashes))
        gw.state.set_policy("kv")
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(LONG), headers={"x-request-id": "q"})
        d = gw.state.decisions.get("q")
        assert r.headers["x-kvgate-worker"] == "a", d.to_dict()
        assert d.candidate("b").pending_tokens > 0
        slow.first_token_delay_s = 0
        await asyncio.gather(*tasks)


async def test_retry_before_first_byte_on_5xx(fleet, start_gateway):
    bad = fleet.add("a", mode="error500")
    good = fleet.add("b")
    gw = start_gateway(fleet, policy="round_robin")
    async with httpx.AsyncClient(timeout=30) as c:
        for stream in (False, True):
            for _ in range(2):
                r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(stream=stream))
                assert r.status_code == 200
                assert r.headers["x-kvgate-worker"] == "b"
    assert len(bad.requests) >= 1 and len(good.requests) == 4
    text = (await httpx.AsyncClient().get(gw.url + "/metrics")).text
    assert "kvgate_retries_total" in text
    # the refusals ran nothing on a: its tracker freed no KV and moved no LRU clock for them (a release
    # of each counted its prompt and expected answer as freed after every prefix cached there)
    a = gw.state.registry.get("a").active
    assert len(a) == 0 and a.released_tokens == 0 and a.kv_freed == 0


async def test_retry_on_refused_connection(fleet, start_gateway):
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet, policy="round_robin", health_interval_s=30.0)
    await wait_until(lambda: all(w.healthy for w in gw.state.registry.workers()))
    fleet.servers[0].stop()  # a dies; the gateway has not noticed yet
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(3):
            r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b"
    assert not gw.state.registry.get("a").healthy


async def test_error_event_after_first_byte(fleet, start_gateway):
    st = fleet.add("a", mode="die_mid_stream", pause_after=2)  # dies once released, after two chunks
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=chat_body(stream=True)) as r:
            assert r.status_code == 200
            got = b""
            it = r.aiter_raw()
            while b"a-says-1" not in got:  # content has reached the client
                got += await asyncio.wait_for(it.__anext__(), 20)
            st.release.set()
            async for ch in it:
                got += ch
    events = sse_payloads(got)
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][6:])
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert gw.state.decisions.recent(1)[0].outcome == "upstream_error_mid_stream"


async def test_all_workers_fail_gives_openai_error(fleet, start_gateway):
    fleet.add("a", mode="error500")
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert r.status_code == 502
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_disconnect_cancels_upstream(fleet, start_gateway):
    st = fleet.add("a", mode="hang")
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        # The worker hangs before its first token, so the client is still waiting for headers.
        task = asyncio.create_task(c.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True)))
        await wait_until(lambda: st.active == 1)
        assert gw.state.registry.get("a").inflight == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: st.cancelled == 1 and st.active == 0)
    await wait_until(lambda: gw.state.registry.get("a").inflight == 0)


@pytest.mark.parametrize("mid_stream", [False, True])
async def test_a_client_that_closes_at_done_had_a_complete_response(fleet, start_gateway, mid_stream):
    """The OpenAI SDKs stop reading at [DONE] and close the connection; the worker's end of stream can
    come later. That response is complete: recorded ok, with the worker's usage (delivered cached tokens
    calibrate the eviction model), not as a disconnect. A client that leaves before [DONE] did disconnect."""
    # mid-stream: the worker pauses after two words, so the client leaves before the gateway has [DONE]
    st = fleet.add("a", done_delay_s=5.0, words=4, pause_after=2 if mid_stream else None)
    gw = start_gateway(fleet)
    body = chat_body("Hello the gateway " * 20, stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": "done"}) as r:
            async for line in r.aiter_lines():
                if line.strip() == "data: [DONE]" or (mid_stream and '"content"' in line):
                    break  # leaving the block closes the connection
    d = gw.state.decisions.get("done")
    await wait_until(lambda: d.outcome is not None and st.active == 0)
    if mid_stream:
        assert (d.outcome, d.status, d.delivered_cached_tokens) == ("client_disconnected", 499, None)
    else:
        assert (d.outcome, d.status) == ("ok", 200) and d.delivered_cached_tokens is not None
        assert d.prompt_tokens > 0
    text = (await httpx.AsyncClient().get(gw.url + "/metrics")).text
    assert ('outcome="client_disconnected"' in text) == mid_stream


async def test_the_next_turn_does_not_find_the_last_one_in_flight(fleet, start_gateway):
    """vLLM frees a request's KV when it sends the last event, and a client sends its next turn as soon as
    it has [DONE]; the worker's end of stream can reach the gateway later. The next turn must not find its
    previous turn still in flight on the worker (counted as load and as holding its prefix), and the
    previous turn's outcome is recorded by then."""
    st = fleet.add("a", done_delay_s=5.0, words=4)
    gw = start_gateway(fleet)
    body = chat_body("Hello the gateway " * 20, stream=True, stream_options={"include_usage": True})
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=body,
                            headers={"x-request-id": "turn1"}) as r:
            async for line in r.aiter_lines():
                if line.strip() == "data: [DONE]":
                    break  # the connection stays open: the worker holds it 5 s more
            first = gw.state.decisions.get("turn1")
            assert st.active == 1  # the worker's stream has not ended, the response is complete
            assert (first.outcome, first.delivered_cached_tokens is not None) == ("ok", True)
            nxt = await c.post(gw.url + "/v1/chat/completions", headers={"x-request-id": "turn2"},
                               json=chat_body("Hello the gateway " * 20 + "and once more"))
            assert nxt.status_code == 200
    cand = gw.state.decisions.get("turn2").candidate("a")
    assert (cand.inflight, cand.pending_requests, cand.decodes) == (0, 0, 0)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_trickled_body_is_a_408_at_body_timeout_s_and_closes(fleet, start_gateway, path):
    """A client sending its body a byte at a time, each well within any read timeout: the request gets a 408
    at body_timeout_s (it waited for the whole body before) and the gateway closes the connection."""
    st = fleet.add("a")
    gw = start_gateway(fleet, body_timeout_s=0.5)
    body = json.dumps(chat_body(max_tokens=4)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % (path.encode(), len(body)))

    async def trickle():
        for i in range(len(body)):  # ~0.05 s a byte: the body would take several seconds
            writer.write(body[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.05)

    sender = asyncio.create_task(trickle())
    try:
        raw = await asyncio.wait_for(reader.read(), 30)  # to EOF: the gateway closed the connection
        still_sending = not sender.done()  # answered before the client had sent its whole body
    finally:
        sender.cancel()
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), raw
    assert b"connection: close" in head.lower() and still_sending
    err = json.loads(payload)
    if path == "/v1/messages":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["code"] == "request_timeout"
    assert st.requests == []


@pytest.mark.parametrize("case", ["invalid_json", "not_object", "missing_model", "unknown_model",
                                  "too_large_declared", "too_large_streamed", "no_healthy", "lone_surrogate",
                                  "lone_surrogate_no_tokenizer", "template_raises", "kv_report_full"])
async def test_bad_input(fleet, start_gateway, case):
    """Each bad request gets its status in the OpenAI error shape. ``lone_surrogate_no_tokenizer``: a gateway
    without a local tokenizer refused it too (before, it reached the worker, whose tokenizer fails on it:
    vLLM answers 500, the client got a 502)."""
    st = fleet.add("a")
    gw = start_gateway(fleet, max_body_bytes=2000, local_tokenizer=case != "lone_surrogate_no_tokenizer")
    url = gw.url + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as c:
        if case == "invalid_json":
            r, want = await c.post(url, content=b"{nope", headers={"content-type": "application/json"}), 400
        elif case == "not_object":
            r, want = await c.post(url, json=[1, 2]), 400
        elif case == "missing_model":
            r, want = await c.post(url, json={"messages": []}), 400
        elif case == "unknown_model":
            r, want = await c.post(url, json={"model": "nope", "messages": []}), 404
        elif case == "too_large_declared":
            r, want = await c.post(url, json=chat_body("x" * 5000)), 413
        elif case == "too_large_streamed":
            async def gen():
                for _ in range(10):
                    yield b"x" * 500
            r, want = await c.post(url, content=gen()), 413  # chunked: no Content-Length
        elif case.startswith("lone_surrogate"):  # valid JSON, but the prompt is not valid UTF-8
            raw = b'{"model": "%s", "messages": [{"role": "user", "content": "bad \\ud800 text"}]}' % MODEL.encode()
            r, want = await c.post(url, content=raw, headers={"content-type": "application/json"}), 400
        elif case == "template_raises":
            r, want = await c.post(url, json={**chat_body(), "chat_template": "{{ raise_exception('no') }}"}), 400
        elif case == "kv_report_full":  # vLLM would re-announce cached blocks: phantom copies in the index
            fine = await c.post(url, json={**chat_body(), "vllm_xargs": {"kv_cache_report_mode": "incremental"}})
            assert fine.status_code == 200 and len(st.requests) == 1
            st.requests.clear()
            r, want = await c.post(url, json={**chat_body(), "vllm_xargs": {"kv_cache_report_mode": "full"}}), 400
            assert r.json()["error"]["param"] == "vllm_xargs.kv_cache_report_mode"
        else:
            st.mode = "unhealthy"
            await wait_until(lambda: not gw.state.registry.get("a").healthy)
            r, want = await c.post(url, json=chat_body()), 503
            assert (await c.get(gw.url + "/ready")).status_code == 503
    assert r.status_code == want, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if case in ("too_large_declared", "too_large_streamed", "lone_surrogate", "lone_surrogate_no_tokenizer",
                "template_raises", "kv_report_full"):
        assert st.requests == []  # refused before anything reached a worker


async def test_planning_bug_answers_in_the_api_shape(fleet, start_gateway, monkeypatch):
    """The data routes run in front of FastAPI's error middleware: a bug while planning must still answer
    a 500 in the OpenAI error shape (no traceback, nothing sent to a worker), and the next request works."""
    st = fleet.add("a")
    gw = start_gateway(fleet)

    async def broken(*a, **kw):
        raise RuntimeError("planner bug")

    async with httpx.AsyncClient(timeout=30) as c:
        monkeypatch.setattr(gw.state.router, "plan", broken)
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "api_error" and "Traceback" not in r.text
        assert st.requests == []
        monkeypatch.undo()
        assert (await c.post(gw.url + "/v1/chat/completions", json=chat_body())).status_code == 200


async def test_models_health_ready_and_other_paths(fleet, start_gateway):
    fleet.add("a")
    st_b = fleet.add("b")
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.get(gw.url + "/health")).status_code == 200
        assert (await c.get(gw.url + "/ready")).json()["healthy_workers"] == 2
        models = (await c.get(gw.url + "/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        r = await c.post(gw.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"})
        assert r.status_code == 200 and r.json()["worker"] in ("a", "b")
        assert r.headers["x-kvgate-worker"] == r.json()["worker"]
        r = await c.post(gw.url + "/v1/embeddings", json={"model": "other", "input": "hi"})
        assert r.status_code == 404
        r = await c.get(gw.url + "/nowhere")
        assert r.status_code == 404 and "error" in r.json()
        st_b.mode = "unhealthy"
        await wait_until(lambda: not gw.state.registry.get("b").healthy)
        for _ in range(3):
            r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
            assert r.headers["x-kvgate-worker"] == "a"
        st_b.mode = "ok"
        await wait_until(lambda: gw.state.registry.get("b").healthy)
        assert gw.state.registry.get("b").restarts == 0  # a flap is no restart


async def test_expect_continue_nested_json_and_odd_paths_get_answers_not_500s(fleet, start_gateway):
    """A client's ``Expect: 100-continue`` (curl sends it for large bodies) is answered by the gateway and not
    forwarded: forwarded, the worker's interim 100 was relayed as the final answer (content-length 0) and
    the real one dropped. A body nested thousands deep is a 400 on every JSON route (json.loads raised
    RecursionError: a 500). A pass-through path is forwarded as the client encoded it (a decoded non-Latin-1
    character could not be written in the request line: a 500)."""
    fleet.add("a")
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"expect": "100-continue"})
        assert r.status_code == 200 and r.json()["choices"]
        deep = b'{"model":"' + MODEL.encode() + b'","input":' + b"[" * 3000 + b"]" * 3000 + b"}"
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            r = await c.post(gw.url + path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text)
        assert r.json()["type"] == "error"  # the Messages API's own error shape
        r = await c.get(gw.url + "/v1/files/%E2%82%AC%3Fx", params={"model": MODEL})
        assert r.status_code == 404 and r.headers["x-kvgate-worker"] == "a"  # the worker's answer


async def test_token_id_prompt_and_session_policy(fleet, start_gateway):
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet, policy="session")
    prompt = list(range(100))
    async with httpx.AsyncClient(timeout=30) as c:
        seen = set()
        for i in range(4):
            r = await c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                             headers={"x-session-id": "s1", "x-request-id": f"t{i}"})
            assert r.status_code == 200
            seen.add(r.headers["x-kvgate-worker"])
        assert len(seen) == 1
        d = gw.state.decisions.get("t0")
        assert d.tokenizer == "ids" and d.num_tokens == 100 and d.num_blocks == routable_blocks(100, BLOCK)


async def test_a_request_abandoned_at_the_prefill_gate_leaves_no_claim_on_the_workers_blocks(fleet, start_gateway):
    """The pending record (blocks sent, not yet indexed) is written before the prefill gate. A client that
    left while its request was held there (or before the worker's first byte) kept the worker credited
    with the whole prompt for pending_ttl_s, though the worker got none of it: later requests were sent
    there for a prefix it did not have."""
    st = fleet.add("a", mode="hang")
    gw = start_gateway(fleet, pending=True,
                       routing={"prefill_gate": True, "prefill_gate_tokens": 1, "prefill_gate_max_wait_s": 60.0})
    other = " ".join(f"zebra quantum walrus {i} marmalade" for i in range(80))
    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.create_task(c.post(gw.url + "/v1/chat/completions", json=chat_body(LONG, stream=True)))
        await wait_until(lambda: st.active == 1)
        body = chat_body(other, stream=True)
        held = asyncio.create_task(c.post(gw.url + "/v1/chat/completions", json=body))
        await wait_until(lambda: len(gw.state.registry.get("a").gate) == 1)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await wait_until(lambda: len(gw.state.registry.get("a").gate) == 0)
        await asyncio.sleep(0.2)
        assert len(st.requests) == 1  # the worker never got it
        d = gw.call(gw.state.router.plan(MODEL, body, {}, "/v1/chat/completions"))
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    assert d.candidate("a").cached_tokens == 0


async def test_no_error_event_follows_the_last_event_a_client_already_has(fleet, start_gateway):
    """The worker's connection failing after its ``[DONE]`` passed (a read timeout while it holds the stream
    open) appended an error event and a second ``[DONE]`` to a stream the client had whole."""
    fleet.add("a", done_delay_s=3.0, words=3)
    gw = start_gateway(fleet, request_timeout_s=1.0)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body("Hello the gateway", stream=True))
    assert r.content.endswith(b"data: [DONE]\n\n") and r.content.count(b"data: [DONE]") == 1
    assert b'"error"' not in r.content


async def test_a_worker_that_echoes_the_request_id_gives_the_client_one(fleet, start_gateway):
    """vLLM with --enable-request-id-headers answers with the request's x-request-id; kvgate sets its own too:
    the client got the header twice."""
    fleet.add("a", echo_request_id=True)
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "rid-1"})
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["rid-1"]
