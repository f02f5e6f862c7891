"""The G4 tier end to end with real vLLM CPU servers running kvgate's connector on one shared G4 dir.

Worker A and worker B are two vLLM processes; nothing is mocked. kvgate's real event ingestion
subscribes to both servers' KV event streams and feeds an in-memory index, whose G4 entries the tests
check. (Requests go to the workers directly until the gateway is on main.)
"""

from __future__ import annotations

import time

import httpx
import pytest

from bench import tiny_model
from bench.vllm_server import one_core_each, start_all, vllm_python
from indexer.hashing import routable_blocks, sequence_hashes
from tests.g4.events import EventTap, IndexThread, g4_hashes_from_events
from tests.g4.real_vllm import (
    BLOCK,
    MODEL,
    cached,
    complete,
    corrupt,
    g4_server,
    prompt,
    assert_same_output,
    store_of,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not (vllm_python().parent.parent / ".kvgate-ready").exists():  # `make test` builds it
    pytestmark.append(pytest.mark.skip(reason="vLLM env missing: run `make vllm-env`"))


@pytest.fixture(scope="module")
def model():
    return tiny_model.ensure("tiny")


@pytest.fixture(scope="module")
def g4(tmp_path_factory):
    return str(tmp_path_factory.mktemp("g4"))


@pytest.fixture(scope="module")
def servers(model, g4):
    bind_a, bind_b = one_core_each(2)
    a = g4_server(model, g4, "g4-a", omp_threads_bind=bind_a)
    b = g4_server(model, g4, "g4-b", omp_threads_bind=bind_b)
    try:
        start_all([a, b])
        taps = {"a": EventTap(a.events_port, a.topic), "b": EventTap(b.events_port, b.topic)}
        idx = IndexThread()
        idx.add("a", MODEL, a.events_port, BLOCK, a.topic)
        idx.add("b", MODEL, b.events_port, BLOCK, b.topic)
        time.sleep(1.0)  # ZMQ slow joiner
        yield {"a": a, "b": b, "taps": taps, "index": idx}
        idx.close()
        for t in taps.values():
            t.close()
    finally:
        a.close()
        b.close()


P = prompt(1, 20 * BLOCK + 7)  # 20 full blocks + a tail
QUESTION = prompt(2, 24)


def test_1_a_serves_p_blocks_land_in_store_and_events_mark_them_g4(servers, g4):
    a = servers["a"]
    complete(a, P, max_tokens=4)
    want = sequence_hashes(P, BLOCK)[: routable_blocks(len(P), BLOCK)]
    st = store_of(g4)
    assert wait_for(lambda: all(st.contains(h) for h in want)), "P's full blocks are not all in the store"
    for i, h in enumerate(want[:3]):
        hdr = st.header(h)
        assert hdr["token_ids"] == P[i * BLOCK : (i + 1) * BLOCK]
        assert hdr["parent"] == (want[i - 1] if i else None)
    # the connector announced them as STORAGE blocks, which map onto the same kvgate hashes
    stored = wait_for(lambda: set(want) <= g4_hashes_from_events(servers["taps"]["a"].snapshot(), BLOCK)[0])
    assert stored, "no BlockStored(medium=STORAGE) for P's blocks"
    # ... and kvgate's ingestion marks them as on G4 in the index (model-wide)
    idx = servers["index"]
    assert wait_for(lambda: idx.g4(MODEL, want) == len(want)), idx.g4(MODEL, want)
    assert a.g4_stats()["saves_written"] >= len(want)


def test_2_b_serves_p_plus_question_from_g4_with_the_same_output(servers):
    b = servers["b"]
    pq = P + QUESTION
    # reference without G4: the same prompt under a cache_salt shares no block with anything stored
    ref = complete(b, pq, max_tokens=12, cache_salt="no-g4-reference")
    assert cached(ref) == 0
    # the salted blocks were saved too, and indexed under kvgate's salted hashes
    salted = sequence_hashes(pq, BLOCK, cache_salt="no-g4-reference")[: routable_blocks(len(pq), BLOCK)]
    idx = servers["index"]
    assert wait_for(lambda: idx.g4(MODEL, salted) == len(salted)), idx.g4(MODEL, salted)
    before = b.g4_stats()
    got = complete(b, pq, max_tokens=12)
    full_p = (len(P) // BLOCK) * BLOCK
    assert cached(got) >= 0.9 * full_p, got["usage"]
    assert_same_output(got, ref)
    after = b.g4_stats()
    assert after["loads"] - before["loads"] >= 0.9 * full_p // BLOCK
    assert after["load_failures"] == before["load_failures"]


def test_2b_through_kvgate_the_gateway_plans_the_g4_load_on_the_worker_without_p(servers, model):
    """The same through the gateway: A is drained, so kvgate routes P' + question to B, whose plan counts
    the G4 blocks (learned from A's STORAGE events); B loads them."""
    from router.app import create_app
    from router.config import IndexConfig, ModelConfig, Settings, WorkerConfig
    from tests.support.servers import ThreadServer

    a, b = servers["a"], servers["b"]
    p4 = prompt(8, 14 * BLOCK + 5)
    settings = Settings(
        workers=[WorkerConfig(url=a.url, name="a"), WorkerConfig(url=b.url, name="b")],
        models={MODEL: ModelConfig(tokenizer=str(model), block_size=BLOCK)},
        index=IndexConfig(backend="memory"), health_interval_s=0.5, refresh_interval_s=2.0,
    )
    gw = ThreadServer(create_app(settings)).start()
    try:
        st = gw.app.state.kv
        assert wait_for(lambda: {w.name for w in st.registry.workers() if w.routable} == {"a", "b"}, 60)
        time.sleep(1.5)  # event subscriptions (slow joiner)
        complete(a, p4, max_tokens=2)
        hs = sequence_hashes(p4, BLOCK)[: routable_blocks(len(p4), BLOCK)]
        assert wait_for(lambda: gw.call(st.index.lookup(MODEL, hs)).g4 == len(hs), 60)
        gw.call(st.registry.drain("a"))
        ref = complete(b, p4 + QUESTION, max_tokens=8, cache_salt="no-g4-reference-2b")
        r = httpx.post(gw.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": p4 + QUESTION, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 2})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-worker"] == "b"
        got = r.json()
        assert cached(got) >= 0.9 * (len(p4) // BLOCK) * BLOCK, got["usage"]
        assert_same_output(got, ref)
        d = st.decisions.get(r.headers["x-request-id"])
        assert d is not None and d.g4_blocks == len(hs), d and d.to_dict()
    finally:
        gw.stop()


def test_4_corrupted_block_is_recomputed_with_correct_output_and_counted(servers, g4):
    a, b = servers["a"], servers["b"]
    p2 = prompt(3, 12 * BLOCK + 3)
    complete(a, p2, max_tokens=2)
    hs = sequence_hashes(p2, BLOCK)[: routable_blocks(len(p2), BLOCK)]
    st = store_of(g4)
    assert wait_for(lambda: all(st.contains(h) for h in hs))
    bad = hs[5]
    path = st.path(bad)
    corrupt(path)
    q = p2 + QUESTION
    ref = complete(b, q, max_tokens=12, cache_salt="no-g4-reference-4")
    before = b.g4_stats()
    got = complete(b, q, max_tokens=12)
    after = b.g4_stats()
    assert after["load_failures_by_reason"]["corrupt"] - before["load_failures_by_reason"]["corrupt"] == 1
    assert after["load_failures"] - before["load_failures"] >= 1
    assert_same_output(got, ref)
    # never served again: removed, then rewritten from the recomputed KV (a valid block of this namespace)
    assert wait_for(lambda: st.contains(bad)), "the recomputed block was not saved again"
    st.read(bad, q[5 * BLOCK : 6 * BLOCK])


def test_6_prefetch_order_stages_blocks_before_prefill(servers, g4):
    a, b = servers["a"], servers["b"]
    p3 = prompt(4, 10 * BLOCK + 9)
    complete(a, p3, max_tokens=2)
    hs = sequence_hashes(p3, BLOCK)[: routable_blocks(len(p3), BLOCK)]
    st = store_of(g4)
    assert wait_for(lambda: all(st.contains(h) for h in hs))
    before = b.g4_stats()
    r = httpx.post(
        f"http://127.0.0.1:{b.prefetch_port}/kvgate/prefetch",
        json={"model": MODEL, "hashes": [f"{h:016x}" for h in hs]},
        timeout=10,
    )
    assert r.status_code == 202 and r.json()["accepted"] == len(hs)
    staged = wait_for(lambda: b.g4_stats()["staging"]["staged"] - before["staging"]["staged"] >= len(hs))
    assert staged, b.g4_stats()["staging"]
    got = complete(b, p3 + QUESTION, max_tokens=4)
    after = b.g4_stats()
    assert cached(got) >= len(hs) * BLOCK
    assert after["prefetch_hits"] - before["prefetch_hits"] == len(hs)
    # idempotent and bounded: a repeated order for blocks already taken is harmless, bad ones are refused
    assert (
        httpx.post(
            f"http://127.0.0.1:{b.prefetch_port}/kvgate/prefetch",
            json={"model": "other", "hashes": [1]},
            timeout=10,
        ).status_code
        == 404
    )
    assert (
        httpx.post(
            f"http://127.0.0.1:{b.prefetch_port}/kvgate/prefetch", json={"hashes": "x"}, timeout=10
        ).status_code
        == 400
    )


def test_3_both_restarted_p_still_served_from_g4(servers):
    a, b = servers["a"], servers["b"]
    a.stop()
    b.stop()
    start_all([a, b])
    q2 = prompt(5, 16)
    for s in (a, b):
        got = complete(s, P + q2, max_tokens=4)
        assert cached(got) >= 0.9 * (len(P) // BLOCK) * BLOCK, got["usage"]
        assert s.g4_stats()["loads"] >= 0.9 * (len(P) // BLOCK)


def test_5_store_over_capacity_evicts_oldest_and_index_forgets(servers, model, tmp_path):
    # capacity for 12 blocks of this model: the same model's block file size on the module's servers
    block_bytes = servers["a"].g4_stats()["block_bytes"]
    for s in (servers["a"], servers["b"]):  # the last test of the module: at most two servers at once
        s.stop()
    g4 = str(tmp_path / "g4-small")
    cap = 12 * block_bytes
    srv = g4_server(model, g4, "g4-c", g4_config={"capacity_bytes": cap})
    with srv:
        tap = EventTap(srv.events_port, srv.topic)
        time.sleep(1.0)
        first = prompt(6, 8 * BLOCK + 1)
        complete(srv, first, max_tokens=1)
        st = store_of(g4)
        hs_first = sequence_hashes(first, BLOCK)[:8]
        assert wait_for(lambda: all(st.contains(h) for h in hs_first))
        assert srv.g4_stats()["block_bytes"] == block_bytes
        # an index that starts now (its events missed the first prompt) learns its blocks from the inventory
        idx = IndexThread()
        idx.add("c", MODEL, srv.events_port, BLOCK, srv.topic)
        time.sleep(1.0)
        from cache_tier.inventory import rebuild_index

        assert idx.g4(MODEL, hs_first) == 0
        assert idx.call(rebuild_index(idx.index, MODEL, g4)) == 8
        assert idx.g4(MODEL, hs_first) == 8
        second = prompt(7, 8 * BLOCK + 1)  # 8 more blocks: 16 > 12 -> the oldest go first
        complete(srv, second, max_tokens=1)
        hs_second = sequence_hashes(second, BLOCK)[:8]
        st = store_of(g4)
        assert wait_for(lambda: all(st.contains(h) for h in hs_second))
        kept = wait_for(lambda: idx.on_g4(MODEL, hs_second) == set(hs_second)) and set(hs_second)
        # every eviction the store made has been announced (GC runs in rounds as blocks arrive)
        stats = srv.g4_stats()
        wait_for(lambda: len(g4_hashes_from_events(tap.snapshot(), BLOCK)[1]) >= stats["store"]["evictions"])
        ev = g4_hashes_from_events(tap.snapshot(), BLOCK)[1]
        forgotten = wait_for(lambda: ev and not idx.on_g4(MODEL, sorted(ev)))
        tap.close()
        stats = srv.g4_stats()
    idx.close()
    assert forgotten, "the index still lists evicted blocks on G4"
    assert kept == set(hs_second), "the index lost blocks that are still on G4"
    assert ev and ev <= set(hs_first), "evicted blocks must be the oldest (the first prompt's)"
    assert all(not st.contains(h) for h in ev)
    assert all(st.contains(h) for h in hs_second)
    assert stats["store"]["bytes"] <= cap and stats["store"]["evictions"] == len(ev)
