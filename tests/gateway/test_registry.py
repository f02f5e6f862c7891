"""The worker registry against live fake workers: discovery, health, restarts, run-time changes; the
router's plan (explain) without sending; metrics scraped and parsed."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from indexer.events.state import WorkerState
from indexer.events.wire import BlockStored
from indexer.hashing import sequence_hashes
from indexer.index import create_index
from indexer.index.base import Tier
from router.config import IndexConfig, Settings, WorkerConfig
from router.registry import DuplicateWorker, WorkerRegistry
from router.upstream import UpstreamError
from router.vllm_metrics import parse_metrics
from tests.gateway.conftest import BLOCK, MODEL
from tests.gateway.test_proxy import LONG, chat_body, wait_until


class RecordingIngestor:
    """Stands in for indexer.events.EventIngestor (which needs live ZMQ publishers): records the calls the
    registry makes through the shared interface."""

    def __init__(self):
        self.added, self.removed, self.resynced = [], [], []

    def resync(self, worker):
        self.resynced.append(worker)
        return True

    async def start(self):
        pass

    async def stop(self):
        pass

    async def add_source(self, src):
        self.added.append(src)

    async def remove_source(self, worker, clear=True):
        self.removed.append((worker, clear))

    def statuses(self):
        return {s.worker: {"applied": 3, "dropped": 1, "replays": 0, "resets": 0, "gaps": 0} for s in self.added}


def test_parse_metrics():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:cache_config_info{block_size="32",engine="0"} 1.0\n')
    load, bs = parse_metrics(text)
    assert (load.running, load.waiting, load.kv_usage, bs) == (3.0, 4.0, 0.5, 32)
    # a broken exporter's +Inf, NaN or negative sample is dropped and counted: the others still count
    # (a +Inf running gauge made every plan over the model a 500)
    bad = text + ('vllm:num_requests_running{engine="2",model_name="m"} +Inf\n'
                  'vllm:num_requests_waiting{engine="1",model_name="m"} NaN\n'
                  'vllm:kv_cache_usage_perc{engine="1",model_name="m"} -0.5\n')
    load, bs = parse_metrics(bad)
    assert (load.running, load.waiting, load.kv_usage, bs, load.rejected) == (3.0, 4.0, 0.5, 32, 3)


def test_a_finite_but_absurd_gauge_is_dropped_and_never_makes_a_plan_raise():
    """A finite sample no vLLM can report (a waiting gauge of 1e306; two engines' running gauges of 1e308,
    whose sum is inf) is dropped and counted like +Inf: kept, it made every request over the model raise
    OverflowError in the cost model (found by a review). Every candidate still gets a finite prediction."""
    from indexer.index.base import WorkerMatch
    from router.config import RoutingConfig
    from router.cost import CostModel
    from router.worker import Worker

    page = ('vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
            'vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_waiting 1e306\n'
            'vllm:num_requests_running{engine="0"} 1e308\nvllm:num_requests_running{engine="1"} 1e308\n'
            'vllm:request_prefill_kv_computed_tokens_sum 1e308\n')
    load, _ = parse_metrics(page)
    assert (load.waiting, load.running, load.prefill_tokens, load.rejected) == (0.0, 0.0, 0.0, 4)
    w = Worker("w", "http://w:8000", WorkerConfig(url="http://w:8000"))
    w.load = load
    c = CostModel(RoutingConfig()).score(w, WorkerMatch(gpu=4, local=4), 0, 2000, 16, hashes=list(range(125)))
    assert 0 < c.predicted_ttft_ms < 3_600_000


def test_a_page_without_a_valid_kv_usage_leaves_the_room_unknown_not_all_free():
    """A page whose kv_cache_usage_perc is NaN, or absent (an exporter with another name), said 0% used:
    every prefix on a full worker priced as kept. The room is unknown instead (the candidate's kv_free is
    null), so no eviction is priced from it either way."""
    from router.kv_room import kv_room

    full = ('vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
            'vllm:num_requests_waiting 6\nvllm:kv_cache_usage_perc 0.97\n')
    load, _ = parse_metrics(full)
    assert kv_room(load, 16)[0] == pytest.approx(0.03)
    for page in (full.replace("0.97", "NaN"), full.replace("vllm:kv_cache_usage_perc 0.97\n", "")):
        load, _ = parse_metrics(page)
        assert load.usage_known is False and kv_room(load, 16) == (None, None)


async def test_discovery_events_restart_and_runtime_changes(fleet, start_gateway):
    fleet.add("a", events_endpoint="tcp://*:5557")
    fleet.states[0].block_size = 32
    rec = RecordingIngestor()
    gw = start_gateway(fleet, ingestor=rec)
    reg = gw.state.registry
    a = reg.get("a")
    assert a.healthy and a.block_size == 32 and reg.block_size(MODEL) == 32
    assert [(s.worker, s.model, s.endpoint, s.topic) for s in rec.added] == \
        [("a", MODEL, "tcp://127.0.0.1:5557", "kv-events")]
    # A health flap is no restart: the entries survive it, and the events are asked to replay.
    hashes = sequence_hashes(list(range(64)), 32)
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, hashes))
    fleet.states[0].mode = "unhealthy"
    await wait_until(lambda: not a.healthy)
    assert gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == 2
    fleet.states[0].mode = "ok"
    await wait_until(lambda: a.healthy)
    assert a.restarts == 0 and rec.resynced == ["a"] and rec.removed == [] and len(rec.added) == 1
    assert gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == 2
    # A new process_start_time_seconds is a restart: entries dropped, events subscribed afresh.
    fleet.states[0].started += 100
    await wait_until(lambda: a.restarts == 1 and len(rec.added) == 2)
    assert gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == 0
    assert rec.removed and rec.removed[0][0] == "a" and len(rec.added) == 2
    # The ingestor's own reset (sequence went backwards) counts a restart without a second clear.
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, hashes))
    gw.call(reg.on_events_reset("a", "restart"))
    assert a.restarts == 2 and gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == 2
    # Add, drain and remove at run time.
    b_state = fleet.add("b")
    b = gw.call(reg.add(WorkerConfig(url=fleet.url(1), name="b")))
    assert b.healthy and MODEL in b.models
    gw.call(reg.drain("a"))
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(3):
            r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
            assert r.headers["x-kvgate-worker"] == "b"
        gw.call(reg.remove("b"))
        assert reg.get("b") is None
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 503  # only a draining worker is left
        gw.call(reg.drain("a", False))
        r = await c.post(gw.url + "/v1/chat/completions", json=chat_body())
        assert r.status_code == 200
    assert len(b_state.requests) == 3


async def test_plan_sends_nothing_and_matches_choice(fleet, start_gateway, tokenizer_dir):
    sa, sb = fleet.add("a"), fleet.add("b")
    gw = start_gateway(fleet)
    body = chat_body(LONG)
    from router.config import TokenizerConfig
    from router.local_tokenizer import LocalTokenizer

    toks = LocalTokenizer(tokenizer_dir, TokenizerConfig()).tokenize_chat(body).tokens
    hashes = sequence_hashes(toks, BLOCK)
    gw.call(gw.state.index.store(MODEL, "b", Tier.GPU, hashes[:5]))
    gw.call(gw.state.index.store_g4(MODEL, hashes[:8]))
    d = gw.call(gw.state.router.plan(MODEL, body, {}, "/v1/chat/completions"))
    assert sa.requests == [] and sb.requests == []
    assert d.chosen == "b" and d.num_tokens == len(toks) and len(d.hashes) == d.num_blocks
    b, a = d.candidate("b"), d.candidate("a")
    assert (b.gpu_blocks, b.local_blocks, b.g4_blocks) == (5, 5, 3)
    assert (a.local_blocks, a.g4_blocks) == (0, 8)
    assert b.cached_tokens == 8 * BLOCK and b.g4_load_ms > 0
    assert set(d.timings_ms) == {"tokenize", "hash", "lookup", "decide", "total"}
    assert "hashes" in d.to_dict(include_hashes=True)
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": "m1"})
    assert r.headers["x-kvgate-worker"] == d.chosen
    rec = gw.state.decisions.get("m1").to_dict()
    assert rec["chosen"] == "b" and rec["delivered_cached_tokens"] is not None
    assert rec["candidates"][0]["worker"] == "b"


async def test_prefetch_ordered_for_g4_plan(fleet, start_gateway, tokenizer_dir):
    """The G4 part of the plan is ordered from the chosen worker, and ``kvgate_prefetch_orders_total``
    counts the order's outcome as the prefetcher gave it (a connector that answered, not accepting it, is
    ``declined``; before, every order not accepted was, an unreachable connector too)."""
    fleet.add("a")
    gw = start_gateway(fleet)
    orders = []

    class Recorder:
        async def order(self, worker, model, hashes):
            orders.append((worker.name, model, list(hashes)))
            return "declined"

    gw.state.prefetcher = gw.state.datapath.prefetcher = Recorder()
    body = chat_body(LONG)
    from router.config import TokenizerConfig
    from router.local_tokenizer import LocalTokenizer

    toks = LocalTokenizer(tokenizer_dir, TokenizerConfig()).tokenize_chat(body).tokens
    hashes = sequence_hashes(toks, BLOCK)
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, hashes[:2]))
    gw.call(gw.state.index.store_g4(MODEL, hashes[:6]))
    async with httpx.AsyncClient(timeout=30) as c:
        assert (await c.post(gw.url + "/v1/chat/completions", json=body)).status_code == 200
    await wait_until(lambda: orders)
    assert orders == [("a", MODEL, hashes[2:6])]
    prefetch = gw.state.metrics.prefetch
    await wait_until(lambda: prefetch.labels("a", "declined")._value.get() == 1)
    assert prefetch.labels("a", "sent")._value.get() == 0 and prefetch.labels("a", "failed")._value.get() == 0


async def test_metrics_scraped_and_parsed(fleet, start_gateway):
    fleet.add("a")
    gw = start_gateway(fleet)
    async with httpx.AsyncClient(timeout=30) as c:
        await c.post(gw.url + "/v1/chat/completions", json=chat_body(LONG, stream=True,
                                                                      stream_options={"include_usage": True}))
        await c.post(gw.url + "/v1/chat/completions", json=chat_body(LONG))
        text = (await c.get(gw.url + "/metrics")).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kvgate_requests", "kvgate_routing_overhead_seconds", "kvgate_predicted_cached_tokens",
                 "kvgate_delivered_cached_tokens", "kvgate_cache_hit_rate", "kvgate_ttft_seconds",
                 "kvgate_inflight_requests", "kvgate_index_blocks", "kvgate_worker_healthy",
                 "kvgate_retries", "kvgate_prefetch_orders", "kvgate_prompt_tokens"):
        assert name in fams, name
    ok = [s for s in fams["kvgate_requests"].samples if s.name == "kvgate_requests_total"
          and s.labels == {"model": MODEL, "worker": "a", "policy": "kv", "outcome": "ok"}]
    assert ok and ok[0].value == 2
    stages = {s.labels["stage"] for s in fams["kvgate_routing_overhead_seconds"].samples if "stage" in s.labels}
    assert {"tokenize", "hash", "lookup", "decide"} <= stages
    delivered = [s.value for s in fams["kvgate_delivered_cached_tokens"].samples if s.name.endswith("_total")]
    assert delivered and delivered[0] > 0
    assert [s.value for s in fams["kvgate_worker_healthy"].samples] == [1.0]


async def test_vllm_prefill_histograms_calibrate_non_streamed_traffic(fleet, start_gateway):
    """Non-streamed responses show no first token, so the TTFT calibration never sees them; vLLM's own
    prefill histograms on /metrics do. The fake worker takes 1 s to prefill 2,000 tokens (2,000 tokens/s
    against the configured 10,000), and the gateway's estimate, and so its predictions, follow."""
    fleet.add("a")
    fleet.states[0].first_token_delay_s = 1.0
    gw = start_gateway(fleet)
    body = {"model": MODEL, "prompt": list(range(1000, 3000)), "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as c:
        before = (await c.post(gw.url + "/admin/explain", json={"body": body})).json()["candidates"][0]
        assert (await c.post(gw.url + "/v1/completions", json=body)).status_code == 200
        await wait_until(lambda: gw.state.registry.get("a").prefill_samples >= 1)
        w = next(x for x in (await c.get(gw.url + "/admin/workers")).json()["workers"] if x["name"] == "a")
        after = (await c.post(gw.url + "/admin/explain",
                              json={"body": body | {"prompt": list(range(5000, 7000))}})).json()
    load = w["load"]
    assert load["ttft_samples"] == 0 and load["prefill_samples"] == 1
    assert before["prefill_tokens_per_s"] == 10_000
    work = 2_000 * (1 + 1_000 / 16_384)  # 2,000 cold tokens at the default attention knee (router/cost.py)
    step_s = load["engine"]["step_ms"] / 1000  # one engine step's own cost is not prefill compute
    # the first measurement replaces the configured prior (router/cost.py _calibrate)
    assert load["prefill_tokens_per_s"] == pytest.approx(work / (1.0 - step_s), rel=1e-3)
    assert after["candidates"][0]["prefill_ms"] > before["prefill_ms"]


async def test_the_first_scrape_calibrates_from_what_the_server_ran_before(fleet, start_gateway):
    """A gateway (re)started in front of a running server learns its speed from the server's history at
    the first scrape, before any request: on capacity-bound real vLLM the priors (10,000 tokens/s) priced
    the first burst at a tenth of what it took. A server with no history keeps the prior."""
    fleet.add("a")
    fleet.add("b")
    fleet.states[0].prefill = [8_000, 8.0, 8_000, 4]  # four 2,000-token prefills at 1,000 tokens/s
    gw = start_gateway(fleet)
    await wait_until(lambda: gw.state.registry.get("a").prefill_samples >= 1)
    assert gw.state.registry.get("b").prefill_samples == 0
    body = {"model": MODEL, "prompt": list(range(1000, 3000)), "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as c:
        cands = (await c.post(gw.url + "/admin/explain", json={"body": body})).json()["candidates"]
    assert all(x["prefill_tokens_per_s"] < 9_000 for x in cands)  # the fleet-wide estimate moved


async def test_discovery_readiness_flap_keeps_entries_and_a_long_absence_removes(fleet, start_gateway):
    """Kubernetes drops a pod from its EndpointSlice while it is not ready: out of routing at once, its
    entries kept if it comes back within lost_grace_s, removed with them if it does not."""
    fleet.add("a")
    gw = start_gateway(fleet, lost_grace_s=1.0)
    reg = gw.state.registry
    a = reg.get("a")
    hashes = sequence_hashes(list(range(64)), BLOCK)
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, hashes))
    gw.call(reg._on_lost("a"))
    assert reg.candidates(MODEL) == []
    gw.call(reg._on_discovered(WorkerConfig(url=fleet.url(0), name="a")))
    assert reg.get("a") is a and reg.candidates(MODEL) == [a]
    assert gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == len(hashes)
    gw.call(reg._on_lost("a"))
    await wait_until(lambda: reg.get("a") is None)
    # out of the registry first; its entries go in the same removal, a few index calls later
    await wait_until(lambda: gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == 0)


async def test_a_name_that_stops_resolving_is_no_refused_port(fleet, start_gateway):
    """Only a refused port says the worker's process is gone (its entries dropped, a restart counted when it
    answers again). A DNS or routing failure says nothing about the process: two health checks during a
    resolver blip took a live worker down, dropped its entries and counted a restart when it resolved."""
    fleet.add("a")
    gw = start_gateway(fleet)
    reg = gw.state.registry
    a = reg.get("a")
    hashes = sequence_hashes(list(range(64)), 32)
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, hashes))
    real = reg._get

    async def unresolvable(w, path):
        return await reg.control.get("http://kvgate-test.invalid:8000" + path)

    reg._get = unresolvable
    try:
        await wait_until(lambda: not a.healthy and "gaierror" in (a.last_error or ""))
        for _ in range(3):
            gw.call(reg._probe(a, full=False))
        assert not a.down
    finally:
        reg._get = real
    await wait_until(lambda: a.healthy)
    assert a.restarts == 0 and gw.call(gw.state.index.lookup(MODEL, hashes)).match("a").local == 2


@pytest.mark.parametrize("models", [b'{"data": null}', b'{"data": 5}', b'{"data": [{"id": ["x"]}]}',
                                    b'{"data": [{"id": 5}]}'])
async def test_a_malformed_model_list_leaves_the_worker_out_and_says_why(fleet, start_gateway, models):
    """A /v1/models answer of another shape raised out of the probe (TypeError): the health loop swallowed
    it, and an admin add answered 500 and kept the worker. Now the worker serves nothing known and stays
    out of routing."""
    fleet.add("a")
    gw = start_gateway(fleet)
    reg = gw.state.registry
    w = gw.call(reg.add(WorkerConfig(url="http://127.0.0.1:9", name="odd"), probe=False))

    async def answers(w, path):
        return {"/v1/models": (200, models), "/health": (200, b"")}.get(path, (404, b""))

    reg._get = answers
    gw.call(reg._probe(w, full=True))  # raised before
    assert not w.healthy and not w.models


async def test_a_worker_removed_while_its_probe_waits_is_not_subscribed_again(fleet, start_gateway):
    """DELETE /admin/workers/{name} can land while that worker's probe waits on it (the admin add's own, or a
    health check of a worker coming back). The probe then resumed and subscribed the removed worker's events:
    a source nothing would remove, writing entries for a worker nobody knows, and the add answered 201."""
    fleet.add("a")
    rec = RecordingIngestor()
    gw = start_gateway(fleet, ingestor=rec)
    fleet.add("b")
    reg = gw.state.registry
    real, entered, gate = reg._get, asyncio.Event(), asyncio.Event()

    async def slow_models(w, path):
        if w.name == "b" and path == "/v1/models":
            entered.set()
            await gate.wait()
        return await real(w, path)

    reg._get = slow_models
    loop = gw.server.loop
    adding = asyncio.run_coroutine_threadsafe(
        reg.add(WorkerConfig(url=fleet.url(1), name="b", events_endpoint="tcp://*:5558")), loop)
    await wait_until(entered.is_set)
    gw.call(reg.remove("b"))
    loop.call_soon_threadsafe(gate.set)
    with pytest.raises(Exception, match="removed while it was being added"):
        adding.result(10)
    assert reg.get("b") is None and not [s for s in rec.added if s.worker == "b"]


async def test_a_broken_exporters_samples_are_counted_where_an_operator_sees_them(fleet, start_gateway):
    """A worker whose /metrics gives a NaN KV usage: the sample is dropped at every scrape and counted in
    ``kvgate_worker_metrics_rejected_total`` and ``/admin/workers`` (a count nobody could read before), which
    also says the usage is unknown (no eviction priced from it)."""
    st = fleet.add("a")
    st.kv_usage = float("nan")
    gw = start_gateway(fleet)
    a = gw.state.registry.get("a")
    await wait_until(lambda: a.metrics_rejected >= 1)
    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(gw.url + "/metrics")).text
        load = (await c.get(gw.url + "/admin/workers")).json()["workers"][0]["load"]
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    [sample] = [s for s in fams["kvgate_worker_metrics_rejected"].samples if s.name.endswith("_total")]
    assert sample.labels == {"worker": "a"} and sample.value >= 1
    assert load["kv_usage_known"] is False and load["rejected_samples"] >= 1


async def test_a_scrape_is_applied_as_of_when_the_page_was_asked_for(fleet, start_gateway):
    """vLLM's /metrics describes the moment it is asked for, and the gateway's own requests go on while it
    fetches and parses the page (slow on a busy server). Applied with the tracker's state from after those
    awaits, KV a request took meanwhile vanished from the room until the next scrape, and a request sent
    meanwhile pushed an older one vLLM still had waiting into "admitted" (its prompt no demand on the room).
    Found by a review; the fake's page is fixed when asked for and answered 0.5 s later."""
    fleet.add("a")
    st = fleet.states[0]
    st.num_gpu_blocks, st.kv_usage, st.waiting = 1001, 0.25, 2  # 16,000 tokens, 12,000 free; B and C wait
    gw = start_gateway(fleet, health_interval_s=3600)  # this test scrapes
    reg = gw.state.registry
    a = reg.get("a")

    def send(base):
        return a.active.add(1600, 1600.0, 1.0, streamed=True, tokens=1600, max_tokens=160,
                            hashes=list(range(base, base + 100)), block_size=BLOCK)

    async def scenario():
        st.metrics_delay_s = 0.5
        first, second, third = send(0), send(1000), send(2000)  # vLLM runs the first
        scrape = asyncio.create_task(reg._scrape(a))
        await asyncio.sleep(0.25)  # the page is asked for; while the gateway waits for it:
        a.active.first_token(first)  # the first one's first token (its prompt is in the page's usage)
        fourth = send(3000)  # and a new request
        await scrape
        return [s.admitted for s in (first, second, third, fourth)]

    assert gw.call(scenario()) == [True, False, False, False]  # the page said two wait: the 2nd and 3rd
    body = {"model": MODEL, "prompt": list(range(5000, 5100)), "max_tokens": 2}
    async with httpx.AsyncClient(timeout=30) as c:
        [cand] = (await c.post(gw.url + "/admin/explain", json={"body": body})).json()["candidates"]
    # the room: the page's 12,000 free tokens less the first one's generation, taken after it was asked
    # for (its prompt was in the page's usage: 160 answer tokens, 10 blocks)
    assert cand["kv_free_tokens"] == 12_000 - 160


def test_a_request_in_flight_when_its_worker_is_removed_brings_no_series_back(fleet, start_gateway):
    """A removed worker's metric series are dropped; a request still in flight there updated the in-flight
    gauge, the request counter and the TTFT histogram when it ended, which brought them back for good
    (with a name per pod they grew with every rollout; found by a review). A worker added again under the
    name counts again."""
    fleet.add("a")
    fleet.states[0].first_token_delay_s = 1.0
    gw = start_gateway(fleet)
    reg = gw.state.registry
    body = {"model": MODEL, "prompt": list(range(100)), "max_tokens": 2, "stream": True}

    def labelled_a() -> set[str]:
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        return {s.name for f in text_string_to_metric_families(text) for s in f.samples
                if s.labels.get("worker") == "a"}

    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(httpx.post, gw.url + "/v1/completions", json=body, timeout=30)
        gw.call(wait_until(lambda: reg.get("a").inflight == 1))
        gw.call(reg.remove("a"))
        assert labelled_a() == set()
        assert in_flight.result().status_code == 200  # it ends after the removal
    assert labelled_a() == set()
    fleet.states[0].first_token_delay_s = 0.0
    gw.call(reg.add(WorkerConfig(url=fleet.url(0), name="a")))
    assert httpx.post(gw.url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert "kvgate_requests_total" in labelled_a()


async def test_a_worker_back_from_down_with_another_block_size_gets_its_events_indexed(fleet, start_gateway):
    """A refused port (the process gone) and a new process with another block size on it: the source kept
    for it was subscribed with the dead process's size, never again (the same endpoint), and every block
    of the new process was a size mismatch. Now it learns the size from the new process's events."""
    st = fleet.add("a", events_endpoint="tcp://*:5557")
    rec = RecordingIngestor()
    gw = start_gateway(fleet, ingestor=rec)
    reg = gw.state.registry
    a = reg.get("a")
    real = reg._get

    async def refused(w, path):
        raise UpstreamError("connect", "connection refused", refused=True)

    reg._get = refused
    try:
        await wait_until(lambda: a.down)
        st.block_size = 2 * BLOCK
        st.started += 100
    finally:
        reg._get = real
    await wait_until(lambda: a.healthy and a.block_size == 2 * BLOCK)
    await asyncio.sleep(0.5)  # a few more probes: nothing subscribes it with the old size again
    state = WorkerState(block_size=rec.added[-1].block_size)  # what the source of the new process checks
    tokens = list(range(4 * BLOCK))
    ops = state.apply([BlockStored(block_hashes=[1, 2], token_ids=tokens, block_size=2 * BLOCK, medium="GPU")])
    assert state.counters["size_mismatch"] == 0 and ops.items and ops.items[0][0] == "store"


_PAGE = ("# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.0\n"
         '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16"} 1.0\n')


class _SlowRemoval:
    """An ingestor whose remove_source takes a while (cancelling tasks, clearing a big worker in Redis)."""

    def __init__(self, log):
        self.log = log

    async def add_source(self, src):
        self.log.append(("add", src.worker, src.worker_url))

    async def remove_source(self, name, clear=True):
        self.log.append(("remove", name))
        await asyncio.sleep(0.3)

    def resync(self, name):
        return True

    async def record_incarnation(self, name, inc):
        pass


def _offline_registry(log, **kw):
    """A registry whose workers answer from here (no sockets), over the memory index."""

    class Reg(WorkerRegistry):
        async def _get(self, w, path):
            await asyncio.sleep(0.01)
            if path == "/v1/models":
                return 200, json.dumps({"data": [{"id": MODEL}]}).encode()
            return 200, (_PAGE.encode() if path == "/metrics" else b"")

    idx = create_index(IndexConfig())
    reg = Reg(Settings(workers=[], **kw), idx, _SlowRemoval(log))
    reg.on_removed = lambda name: log.append(("forgotten", name))
    return reg, idx


async def test_a_removal_overlapping_a_same_name_re_add_leaves_the_new_worker_alone():
    """A StatefulSet pod left discovery for longer than lost_grace_s and comes back, same name, new IP, while
    the health loop is still removing the old one: the removal, resuming after its awaits, cleared the new
    worker's entries and forgot its parity verdict and metric series. Its name's entry of the refresh
    times is dropped with the worker."""
    log = []
    reg, idx = _offline_registry(log, lost_grace_s=60)
    reg._task = object()  # the health loop runs: add() probes
    old = await reg.add(WorkerConfig(url="http://10.0.0.1:8000", name="vllm-0", events_endpoint="tcp://*:5557"))
    await reg._on_lost("vllm-0")
    old.lost_at -= 61
    removing = asyncio.create_task(reg._remove_lost("vllm-0"))
    await asyncio.sleep(0.05)
    await reg._on_discovered(WorkerConfig(url="http://10.0.0.2:8000", name="vllm-0",
                                          events_endpoint="tcp://*:5557"))
    new = reg.get("vllm-0")
    assert new is not old and new.url == "http://10.0.0.2:8000"
    await idx.store(MODEL, "vllm-0", Tier.GPU, [11, 12, 13])  # the new process's first blocks
    await removing
    assert reg.get("vllm-0") is new
    assert (await idx.lookup(MODEL, [11, 12, 13], workers=["vllm-0"])).match("vllm-0").local == 3
    # the old worker's series and verdict were forgotten before the new one subscribed, not after
    assert log.index(("forgotten", "vllm-0")) < log.index(("add", "vllm-0", "http://10.0.0.2:8000"))
    assert log.count(("forgotten", "vllm-0")) == 1
    await reg.remove("vllm-0")
    assert "vllm-0" not in reg._last_refresh and reg.get("vllm-0") is None


async def test_concurrent_adds_of_one_name_register_one_worker():
    """The name was checked before add() awaited the removal of a lost worker on the same URL: a second add
    of that name meanwhile passed too, and the first then replaced it in the registry (subscribed, never
    removed)."""
    log = []
    reg, _ = _offline_registry(log, lost_grace_s=60)
    await reg.add(WorkerConfig(url="http://10.0.0.1:8000", name="vllm-1", events_endpoint="tcp://*:5557"))
    await reg._on_lost("vllm-1")
    results = await asyncio.gather(
        reg.add(WorkerConfig(url="http://10.0.0.1:8000", name="vllm-0"), probe=False),  # removes vllm-1 first
        reg.add(WorkerConfig(url="http://10.0.0.2:8000", name="vllm-0"), probe=False),
        return_exceptions=True)
    added = [r for r in results if not isinstance(r, Exception)]
    assert len(added) == 1 and isinstance(next(r for r in results if r not in added), DuplicateWorker)
    assert reg.get("vllm-0") is added[0] and reg.get("vllm-1") is None
