"""The whole loop over real sockets: a worker serves a prompt and announces its blocks as vLLM does
(BlockStored over ZMQ, bench.sim.vllm_format.EventPublisher), the gateway's EventIngestor writes them
into Redis, and the next turn of that conversation goes to that worker, where the delivered cached_tokens
match the prediction."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.sim.vllm_format import EventPublisher
from tests.gateway.conftest import BLOCK
from tests.gateway.test_proxy import LONG, chat_body, wait_until


async def test_events_drive_routing(fleet, start_gateway):
    pubs = [EventPublisher("tcp://*:0", "tcp://127.0.0.1:0") for _ in range(2)]
    try:
        for name, pub in zip("ab", pubs):
            fleet.add(name, publisher=pub)
        gw = start_gateway(fleet, events=True)
        assert gw.state.ingestor is not None
        await wait_until(lambda: set(gw.state.ingestor.statuses()) == {"a", "b"})
        first = chat_body(LONG)
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/chat/completions", json=first)
            owner = r.headers["x-kvgate-worker"]
            assert int(r.headers["x-kvgate-cached-tokens"]) == 0

            def indexed():
                d = gw.call(gw.state.router.plan("tiny", first, {}, "/v1/chat/completions"))
                return d.candidate(owner).local_blocks == d.num_blocks > 0

            deadline = asyncio.get_running_loop().time() + 30
            while not indexed():
                assert asyncio.get_running_loop().time() < deadline, "events never reached the index"
                await asyncio.sleep(0.05)
            for i in range(3):
                turn = dict(first, messages=first["messages"] + [
                    {"role": "assistant", "content": f"reply {i}"}, {"role": "user", "content": f"more {i}"}])
                r = await c.post(gw.url + "/v1/chat/completions", json=turn, headers={"x-request-id": f"e{i}"})
                assert r.headers["x-kvgate-worker"] == owner
                predicted = int(r.headers["x-kvgate-cached-tokens"])
                delivered = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert predicted > 0 and predicted <= delivered
                assert gw.state.decisions.get(f"e{i}").delivered_cached_tokens == delivered
        st = gw.state.ingestor.status(owner)
        assert st["applied"] >= 1
        assert BLOCK == fleet.states[0].block_size
    finally:
        for p in pubs:
            p.close()


async def test_parity_is_checked_once_the_event_stream_is_known(fleet, start_gateway):
    """The worker is healthy before its event sources can be read (``/kv_event_sources`` answers 503, as a
    loaded server may time out on it): the registration-time parity check has no stream to watch, so it
    gives no cache-blind verdict; when a later refresh reads the sources and subscribes, the check runs
    again and passes (it failed CI once as 'no KV events after 3 probes', for good)."""
    pub = EventPublisher("tcp://*:0", "tcp://127.0.0.1:0")
    try:
        st = fleet.add("a", publisher=pub, sources_status=503)
        gw = start_gateway(fleet, events=True, parity=True)
        await wait_until(lambda: (w := gw.state.registry.get("a")) is not None and w.healthy)
        w = gw.state.registry.get("a")
        await wait_until(lambda: w.parity is not None, timeout=30)
        assert w.parity["status"] == "no-events" and not w.cache_blind, w.parity
        st.sources_status = 200
        await wait_until(lambda: w.parity["status"] == "ok", timeout=60)
        assert not w.cache_blind and w.parity["matched_blocks"] == w.parity["expected_blocks"] > 0
    finally:
        pub.close()


async def test_a_long_new_document_is_tokenized_as_far_as_a_worker_holds_it(fleet, start_gateway):
    """A ~60 KB document nobody has seen: the gateway encodes its first stage only (no worker's prefix
    reaches past it, so the rest changes no choice) and estimates the prompt's length. Once the worker
    that served it announces the blocks, another question over the document is encoded in full, goes
    there, and vLLM's (here the fake worker's) cached_tokens bear the prediction out."""
    pubs = [EventPublisher("tcp://*:0", "tcp://127.0.0.1:0") for _ in range(2)]
    try:
        for name, pub in zip("ab", pubs):
            fleet.add(name, publisher=pub)
        gw = start_gateway(fleet, events=True)
        await wait_until(lambda: set(gw.state.ingestor.statuses()) == {"a", "b"})
        doc = " ".join(f"section {i} of the storage tier manual says block {i * 7} is kept" for i in range(1000))
        first = chat_body(doc + "\nQuestion: what is kept?")
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/chat/completions", json=first, headers={"x-request-id": "d1"})
            assert r.status_code == 200
            owner = r.headers["x-kvgate-worker"]
            d1 = gw.state.decisions.get("d1")
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            assert d1.tokens_estimated and d1.new_bytes < len(doc) / 2
            assert 0.8 < d1.num_tokens / prompt_tokens < 1.25
            m = (await c.get(gw.url + "/metrics")).text
            assert 'kvgate_tokenize_cache_deferred_bytes_total{model="tiny"}' in m

            def indexed():
                d = gw.call(gw.state.router.plan("tiny", first, {}, "/v1/chat/completions"))
                return not d.tokens_estimated and d.candidate(owner).local_blocks == d.num_blocks > 0

            await wait_until(indexed, timeout=30)
            second = chat_body(doc + "\nQuestion: which section?")
            r = await c.post(gw.url + "/v1/chat/completions", json=second, headers={"x-request-id": "d2"})
            assert r.headers["x-kvgate-worker"] == owner
            d2 = gw.state.decisions.get("d2")
            usage = r.json()["usage"]
            assert not d2.tokens_estimated and d2.num_tokens == usage["prompt_tokens"]
            delivered = usage["prompt_tokens_details"]["cached_tokens"]
            assert 0 < d2.predicted_cached_tokens <= delivered
            assert d2.predicted_cached_tokens > 0.9 * d1.num_tokens
    finally:
        for p in pubs:
            p.close()


@pytest.mark.parametrize("on", [True, False], ids=["admit_on_events", "scrapes_only"])
async def test_a_request_whose_blocks_vllm_stored_is_running_before_a_scrape_says_so(fleet, start_gateway, on):
    """The worker announces a prompt's new blocks as it starts on it (vLLM stores a chunk's blocks when it
    schedules it) and reports four requests waiting, so no scrape of the waiting gauge tells the gateway it
    runs this one. With ``routing.admit_on_events`` the BlockStored admits it at once: it is no longer
    demand on the worker's free KV while it prefills; without, it stays demand until its first token."""
    pub = EventPublisher("tcp://*:0", "tcp://127.0.0.1:0")
    try:
        fleet.add("a", publisher=pub, first_token_delay_s=2.5, waiting=4)
        gw = start_gateway(fleet, events=True, routing={"admit_on_events": on})
        await wait_until(lambda: set(gw.state.ingestor.statuses()) == {"a"})
        w = gw.state.registry.get("a")

        async def queue():
            v = w.active.view(w.load.running, w.load.waiting)
            return v.prefill_requests, v.unadmitted_tokens

        async with httpx.AsyncClient(timeout=30) as c:
            body = dict(chat_body(LONG), stream=True)
            task = asyncio.create_task(c.post(gw.url + "/v1/chat/completions", json=body))
            await wait_until(lambda: gw.call(queue())[0] == 1)
            await wait_until(lambda: gw.state.ingestor.status("a")["blocks_stored"] > 0)
            await asyncio.sleep(0.5)  # a few scrapes (every 0.2 s) and the event's application
            prefilling, demand = gw.call(queue())
            assert prefilling == 1  # still before its first token
            assert (demand == 0) if on else (demand > BLOCK)
            r = await task
            assert r.status_code == 200
    finally:
        pub.close()


async def test_a_restart_with_another_block_size_is_indexed_at_the_new_size(fleet, start_gateway):
    """A rolling restart changes the engine's block size (--block-size, attention backend): the events were
    subscribed again with the dead process's size before the scrape's new one was stored, and every block
    of the new process was dropped as a size mismatch, for good. Now they are indexed at its size."""
    pub = EventPublisher("tcp://*:0", "tcp://127.0.0.1:0")
    try:
        st = fleet.add("a", publisher=pub)
        gw = start_gateway(fleet, events=True)
        await wait_until(lambda: set(gw.state.ingestor.statuses()) == {"a"})
        a = gw.state.registry.get("a")
        subscriptions = len(pub.subscriptions)
        pub.restart()  # a new process: sequence from 0, empty cache, another block size
        st.cache.clear()
        st.block_size = 2 * BLOCK
        st.started += 100
        await wait_until(lambda: a.restarts == 1 and a.block_size == 2 * BLOCK)
        await wait_until(lambda: len(pub.subscriptions) > subscriptions)  # the new SUB reached the publisher
        body = chat_body(LONG)
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200

        def indexed():
            d = gw.call(gw.state.router.plan("tiny", body, {}, "/v1/chat/completions"))
            return d.block_size == 2 * BLOCK and d.candidate("a").local_blocks == d.num_blocks > 0

        await wait_until(indexed, timeout=10)
        assert gw.state.ingestor.status("a")["size_mismatch"] == 0
    finally:
        pub.close()
