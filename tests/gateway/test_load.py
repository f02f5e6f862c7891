"""The per-worker load tracker (router/load.py) and the scheduler model's online calibration
(router/calibrate.py), on hand-built inputs (no servers), and the accuracy figures a user reads."""
from __future__ import annotations

import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from indexer.index.base import WorkerMatch
from router.calibrate import OVERHEAD_WINDOW, EngineCalibration, PredictionErrors
from router.config import RoutingConfig, WorkerConfig
from router.cost import CostModel
from router.load import ActiveSequences
from router.worker import EngineSample, Worker, WorkerLoad
from tests.gateway.conftest import MODEL


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_phases_and_the_deadline_of_a_response_without_a_first_token():
    clock = Clock()
    a = ActiveSequences(default_work=1000.0, clock=clock)
    streamed = a.add(uncached=300, work=350.0, predicted_s=1.0)
    plain = a.add(uncached=200, work=200.0, predicted_s=0.5)
    v = a.view()
    assert (v.inflight, v.prefill_requests, v.prefill_tokens, v.prefill_work, v.decodes) == (2, 2, 500, 550.0, 0)
    a.first_token(streamed)
    assert a.view().prefill_requests == 1 and a.view().decodes == 1
    clock.t += 1.01  # twice the predicted 0.5 s: the non-streamed one counts as decoding now
    v = a.view()
    assert v.prefill_requests == 0 and v.decodes == 2 and v.inflight == 2
    a.finish(plain)
    a.finish(streamed)
    a.finish(streamed)  # twice is harmless
    assert len(a) == 0 and a.view().inflight == 0


def test_a_streamed_request_is_prefilling_until_its_first_token_however_late():
    """Early predictions run on default figures and can be far too short (the capacity-bound run: 60-600 ms
    predicted, 6-12 s observed); a stream's first token will be seen, so no deadline applies to it."""
    clock = Clock()
    a = ActiveSequences(clock=clock)
    s = a.add(uncached=1000, work=1000.0, predicted_s=0.1, streamed=True)
    clock.t += 60
    assert a.view().prefill_requests == 1 and a.view().decodes == 0
    a.first_token(s)
    assert a.view().prefill_requests == 0 and a.view().decodes == 1


def test_the_free_kv_room_follows_the_gateways_requests_between_two_scrapes():
    """vLLM's usage is a scrape (every health_interval_s); the room a placement reads moves by what the
    gateway's requests took (at their first token) and freed (at their end) since, less the leading blocks
    another request in flight shares (a document four questions read is held once), within the capacity."""
    from router.kv_room import kv_room

    a = ActiveSequences(clock=Clock())
    doc = list(range(40))  # 40 blocks of 16 tokens
    first = a.add(0, 0.0, 1.0, streamed=True, tokens=700, max_tokens=16, hashes=doc, block_size=16)
    a.first_token(first)  # before the scrape: the usage has it
    load = WorkerLoad(kv_usage=0.5, num_gpu_blocks=201, updated_at=1.0)  # 1,600 of 3,200 free (+ null block)
    a.mark_scrape()
    assert a.kv_since_scrape() == 0 and kv_room(load, 16, a.kv_since_scrape()) == (0.5, 1600.0)
    second = a.add(0, 0.0, 1.0, streamed=True, tokens=800, max_tokens=16, hashes=doc[:30] + [99, 98],
                   block_size=16)
    assert a.kv_since_scrape() == 0  # sent, not scheduled: the queue's demand, not the room
    a.first_token(second)  # takes 816 tokens, 30 blocks of them held by the first already
    assert a.kv_since_scrape() == -(816 - 30 * 16)
    a.finish(first)  # frees its 715 tokens' 45 blocks less the 30 blocks the second still holds
    assert a.kv_since_scrape() == (720 - 480) - 336
    assert kv_room(load, 16, a.kv_since_scrape()) == pytest.approx(((1600 - 96) / 3200, 1504.0))
    a.mark_scrape()  # the next scrape includes all that
    assert a.kv_since_scrape() == 0
    a.finish(second)
    assert a.kv_since_scrape() == 816
    assert kv_room(load, 16, 5000.0) == (1.0, 3200.0) and kv_room(load, 16, -5000.0) == (0.0, 0.0)  # clamped
    assert kv_room(WorkerLoad(kv_usage=0.5, updated_at=1.0), 16, 300.0) == (0.5, None)  # capacity unknown
    assert kv_room(load, 16, math.nan) == (0.5, 1600.0)


def test_reconciled_with_what_vllm_reports():
    a = ActiveSequences(default_work=800.0)
    a.add(uncached=100, work=100.0, predicted_s=60)
    # vLLM: 3 waiting (2 the gateway did not send), 5 running (the gateway's one is waiting, so 5 decode)
    v = a.view(running=5, waiting=3)
    assert v.unknown_waiting == 2 and v.decodes == 5 and v.queue_requests == 3
    assert v.queue_work == pytest.approx(100 + 2 * a.mean_work)
    # the gateway's prefilling request is running at vLLM (nothing waiting): it is not a decode
    v = a.view(running=1, waiting=0)
    assert v.unknown_waiting == 0 and v.decodes == 0


def test_step_time_is_learnt_from_inter_token_latency():
    cal = EngineCalibration(step_s=0.05, seq_s=0.0, request_s=0.0)
    assert cal.source == "defaults"
    for d in (1, 4, 8, 2, 6, 10, 3):  # the engine: 12 ms a step plus 0.8 ms per running request
        cal.observe_steps(d, 0.012 + 0.0008 * d)
    assert cal.step_s == pytest.approx(0.012, rel=0.02) and cal.seq_s == pytest.approx(0.0008, rel=0.05)
    assert cal.source == "partial"
    flat = EngineCalibration(step_s=0.05, seq_s=0.001, request_s=0.0)
    for _ in range(5):  # the running count never varied: no slope to learn, the prior slope stays
        flat.observe_steps(4, 0.020)
    assert flat.seq_s == 0.001 and flat.step_time_s(4) == pytest.approx(0.020)


def test_a_noisy_slope_never_prices_an_idle_step_at_zero():
    """Step time that grows much faster with the running count than a decode costs (prefill time left in
    the samples) fitted a slope whose intercept went negative: an idle server's step came out at 0."""
    cal = EngineCalibration(step_s=0.01, seq_s=0.0005, request_s=0.0)
    for d, itl in ((1, 0.05), (2, 0.6), (3, 1.4), (4, 2.0), (2, 0.7), (3, 1.2)):
        cal.observe_steps(d, itl)
    mean_d, mean_itl = cal._x / cal._w, cal._y / cal._w
    assert cal.step_time_s(0) >= mean_itl / (mean_d + 1) - 1e-9  # at least one decode's share of a step
    assert cal.step_time_s(mean_d) == pytest.approx(mean_itl)  # the line goes through the mean


def test_bad_samples_are_clamped_and_counted_never_zero_or_infinite():
    cal = EngineCalibration(step_s=0.01, seq_s=0.0, request_s=0.005)
    cal.observe_steps(2, float("inf"))
    cal.observe_steps(2, -1.0)  # ignored
    cal.observe_steps(-3, 0.01)  # ignored
    cal.observe_request_overhead(float("nan"))  # ignored
    cal.observe_request_overhead(1e9)
    assert cal.clamped == 2 and 0 < cal.step_s <= 5.0 and 0 <= cal.request_s <= 10.0
    assert math.isfinite(cal.step_time_s(1000))


def test_engine_figures_between_two_scrapes():
    before = WorkerLoad(running=2, itl=(1.0, 100), ttft=(10.0, 10), queue=(2.0, 10), prefill_seconds=5.0,
                        prefill_requests=10)
    after = WorkerLoad(running=4, itl=(2.5, 200), ttft=(16.0, 15), queue=(3.0, 15), prefill_seconds=9.5,
                       prefill_requests=15)
    e = after.engine_since(before)
    assert e.itl_s == pytest.approx(0.015) and e.running == 3.0
    # without e2e and inference histograms: first tokens of the interval against the finished requests
    assert e.overhead_s == pytest.approx(6.0 / 5 - 1.0 / 5 - 4.5 / 5)
    assert e.prefill_tokens_per_step is None  # no per-step figures exported
    nothing = WorkerLoad().engine_since(WorkerLoad())  # nothing new: no sample
    assert (nothing.itl_s, nothing.running, nothing.overhead_s) == (None, 0.0, None)
    restarted = WorkerLoad(itl=(0.1, 5))
    assert restarted.engine_since(after).itl_s is None  # counters went back


def test_overhead_from_one_set_of_finished_requests_and_prefill_per_step():
    """vLLM records TTFT at the first token and queue/prefill time at finish: while a queue builds (each
    request decoding for seconds), TTFT minus the finished requests' queue and prefill read seconds of
    "overhead". e2e - queue - inference are all of the finished requests: the time outside the engine."""
    before = WorkerLoad(ttft=(10.0, 10), queue=(2.0, 10), prefill_seconds=5.0, prefill_requests=10,
                        e2e=(30.0, 10), inference=(27.5, 10), steps=100, computed_tokens=4000)
    after = WorkerLoad(ttft=(40.0, 15), queue=(3.0, 15), prefill_seconds=9.5, prefill_requests=15,
                       e2e=(60.0, 15), inference=(56.4, 15), steps=150, computed_tokens=9000)
    e = after.engine_since(before)
    assert e.overhead_s == pytest.approx((30.0 - 1.0 - 28.9) / 5)  # 20 ms, not TTFT's (30-1-4.5)/5 s
    assert e.prefill_tokens_per_step == pytest.approx(100.0)


def test_the_overhead_is_the_floor_not_the_wait_for_the_step_in_progress():
    """vLLM's queue time starts when the engine core takes a request, between steps: the time outside the
    engine also holds the wait for the step in progress, which the queue model prices as the work in
    flight. Interval means from capacity-bound CPU vLLM (session 29): 0.01 s while the server was idle,
    1.4-8 s under load; a small prefill on an idle worker took 0.6 s. Priced at their mean it was 3.8 s."""
    cm = CostModel(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, ttft_fit=False))
    w = Worker(name="a", url="http://a", config=WorkerConfig(url="http://a"), healthy=True)
    for overhead in (0.01, 4.5, 1.72, 2.48, 6.38, 1.61, 1.79, 1.63, 2.82, 6.63, 7.93, 5.9, 0.01, 1.83):
        cm.observe_engine(w, EngineSample(None, 0.0, overhead))
    assert w.engine.request_s == pytest.approx(0.01) and cm.fleet_engine.request_s == pytest.approx(0.01)
    c = cm.score(w, WorkerMatch(), 0, 100, 16)  # idle: 100 ms of compute, a step and the overhead
    assert c.overhead_ms == pytest.approx(10.0) and c.predicted_ttft_ms < 200.0
    # the floor follows the last OVERHEAD_WINDOW intervals: a slower API server moves it
    for _ in range(OVERHEAD_WINDOW):
        cm.observe_engine(w, EngineSample(None, 0.0, 0.3))
    assert w.engine.request_s == pytest.approx(0.3)


def test_prediction_errors_summary():
    e = PredictionErrors()
    assert e.to_dict() == {"samples": 0, "median": None, "p90": None}
    for obs in range(1, 11):
        e.add(obs * 100.0, 500.0)
    assert e.add(100.0, 0.0) is None and e.add(float("inf"), 10.0) is None
    d = e.to_dict()
    assert d["samples"] == 10 and d["median"] == pytest.approx(1.2) and d["p90"] == pytest.approx(2.0)


async def test_streamed_responses_report_prediction_accuracy(fleet, start_gateway):
    """What a user reads: each streamed response's observed / predicted TTFT lands in
    kvgate_ttft_prediction_ratio, the worker's summary in /admin/workers, and the decision record."""
    fleet.add("a")
    fleet.states[0].first_token_delay_s = 0.2
    gw = start_gateway(fleet)
    body = {"model": MODEL, "prompt": list(range(1000, 1400)), "max_tokens": 2, "stream": True}
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(3):
            r = await c.post(gw.url + "/v1/completions", json=body | {"prompt": list(range(i * 500, i * 500 + 400))},
                             headers={"x-request-id": f"acc{i}"})
            assert r.status_code == 200
        w = next(x for x in (await c.get(gw.url + "/admin/workers")).json()["workers"] if x["name"] == "a")
        metrics = (await c.get(gw.url + "/metrics")).text
        d = (await c.get(gw.url + "/admin/decisions/acc2")).json()
    pred = w["load"]["prediction"]
    assert pred["samples"] == 3 and pred["median"] > 0 and pred["p90"] >= pred["median"]
    assert w["load"]["engine"]["source"] in ("defaults", "partial", "vllm-metrics")
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    count = [s.value for s in fams["kvgate_ttft_prediction_ratio"].samples
             if s.name.endswith("_count") and s.labels.get("worker") == "a"]
    assert count == [3.0]
    assert d["observed_ttft_ms"] >= 200 and d["predicted_ttft_ms"] > 0
    chosen = d["candidates"][0]
    assert chosen["steps"] >= 1 and chosen["step_ms"] > 0 and "calibration" in chosen


def test_a_request_running_at_a_scrape_takes_only_its_generation_at_its_first_token():
    """A slow prefill spans scrapes: the usage of the scrape that saw vLLM running it holds its prompt, so
    its first token moves the room by its generation alone (counting the prompt again understated the room
    until the next scrape)."""
    a = ActiveSequences(clock=Clock())
    slow = a.add(700, 700.0, 1.0, streamed=True, tokens=800, max_tokens=16, hashes=list(range(50)), block_size=16)
    queued = a.add(300, 300.0, 1.0, streamed=True, tokens=300, max_tokens=16, hashes=[7] * 18, block_size=16)
    a.mark_scrape(waiting=1)  # vLLM runs the first, the second waits
    assert slow.admitted and not queued.admitted
    a.first_token(slow)
    assert a.kv_since_scrape() == -16
    a.first_token(queued)  # not seen running at a scrape: its prompt and generation are new (315: 20 blocks)
    assert a.kv_since_scrape() == -16 - 320


def test_a_request_whose_first_new_blocks_vllm_stored_is_running_before_the_next_scrape():
    """vLLM stores a chunk's full blocks when it schedules it: the BlockStored of a request's first uncached
    blocks says vLLM runs it. Until the next scrape (5 s) such a request was demand on the room and its
    prefix and new blocks read free; now its prompt is taken at once, it is no demand, and its first token
    takes only its generation. Blocks of a request still at the gateway's prefill gate, or unrelated ones,
    admit nothing."""
    a = ActiveSequences(clock=Clock())
    doc = list(range(100, 140))  # 40 cached blocks, then 10 new ones
    sent = a.add(160, 160.0, 1.0, streamed=True, tokens=800, max_tokens=16, hashes=doc + list(range(10)),
                 block_size=16)
    held = a.add(160, 160.0, 1.0, streamed=True, tokens=800, max_tokens=16, hashes=doc + list(range(10)),
                 block_size=16)
    held.gated = True
    a.mark_scrape(waiting=2)  # both waiting as of the scrape
    assert a.view().unadmitted_tokens == 320
    a.stored([999, 998])  # someone else's blocks
    a.stored(doc[:3])  # cached blocks of its prefix are not its new ones
    assert not sent.admitted and a.kv_since_scrape() == 0
    a.stored([0, 1, 2, 3])  # its first chunk's blocks
    assert sent.admitted and not held.admitted
    assert a.view().unadmitted_tokens == 160  # only the held one is demand
    assert a.kv_since_scrape() == -800  # its prompt (the cached prefix touched, the new blocks allocated)
    assert a.running_tokens() == 800  # its prompt: it generates nothing before its prefill ends
    a.first_token(sent)
    assert a.kv_since_scrape() == -816  # then its generation only
    held.gated = False  # the gate lets it go: its own blocks admit it
    a.stored([0])
    assert held.admitted


def test_a_held_request_loses_its_prefix_to_the_ones_sent_past_it():
    """The queue's cascade follows the order vLLM will see: a request held at the prefill gate goes after
    the shorter one sent past it, whose allocation reaches the held one's cached prefix first (its blocks
    are the oldest free ones but a hundred tokens). In planning order the held one came first and kept it."""
    a = ActiveSequences(clock=Clock())
    doc = list(range(100, 140))  # 40 blocks of 16 tokens
    first = a.add(50, 50.0, 1.0, streamed=True, tokens=40 * 16 + 50, max_tokens=1, hashes=doc + [1, 2, 3],
                  block_size=16)
    a.first_token(first)
    a.finish(first, 1)  # its blocks are free now, the document the most recent of them
    held = a.add(60, 60.0, 1.0, streamed=True, tokens=40 * 16 + 60, max_tokens=1, hashes=doc + [4, 5, 6],
                 block_size=16, prefix_blocks=40)
    held.gated = True
    a.add(500, 500.0, 1.0, streamed=True, tokens=500, max_tokens=1, hashes=list(range(900, 931)), block_size=16)
    assert a.queue_losses(free_tokens=40 * 16 + 100) == 400  # 500 allocated, 100 older than the document
    held.gated = False  # sent: ahead of the other in arrival order, its prefix is read first
    assert a.queue_losses(free_tokens=40 * 16 + 100) == 0


def test_the_free_room_never_exceeds_the_capacity_less_what_running_requests_hold():
    """The scrape-corrected room counts the frees since the scrape at once, but a request vLLM admitted
    since is taken only at its first token: a busy worker could read as empty (6,538 of 6,560 tokens free
    with two running and three sent, on capacity-bound real vLLM). The requests vLLM runs (a first token
    seen, or admitted at a scrape) bound it: their KV, a shared document counted once."""
    from router.kv_room import kv_room

    a = ActiveSequences(clock=Clock())
    doc = list(range(40))  # 40 blocks of 16 tokens
    r1 = a.add(100, 100.0, 1.0, streamed=True, tokens=700, max_tokens=16, hashes=doc + [1, 2], block_size=16)
    r2 = a.add(100, 100.0, 1.0, streamed=True, tokens=700, max_tokens=16, hashes=doc + [3, 4], block_size=16)
    queued = a.add(900, 900.0, 1.0, streamed=True, tokens=900, max_tokens=16, hashes=[9] * 56, block_size=16)
    assert a.running_tokens() == 0  # nothing seen running yet
    load = WorkerLoad(kv_usage=0.5, num_gpu_blocks=201, updated_at=1.0)  # 1,600 of 3,200 free (+ null block)
    a.mark_scrape(waiting=1)  # vLLM runs the first two; the third waits
    assert r1.admitted and r2.admitted and not queued.admitted
    held = 704 + (704 - 40 * 16)  # their prompts (44 blocks each; no generation yet), the document once
    assert a.running_tokens() == held
    # frees since the scrape would lift the room to the whole capacity; the running two still hold theirs
    assert kv_room(load, 16, 3000.0, a.running_tokens()) == pytest.approx(((3200 - held) / 3200, 3200 - held))
    assert kv_room(load, 16, 0.0, a.running_tokens()) == (0.5, 1600.0)  # the scrape is tighter: it stands
    a.first_token(queued)
    assert a.running_tokens() == held + 928  # memo refreshed when a request starts (915 tokens: 58 blocks)
    a.finish(r1)
    assert a.running_tokens() == 704 + 928  # and when one ends


def test_a_prompt_holds_whole_blocks_and_its_generation_grows_into_the_last():
    """vLLM allocates a prompt's last, partial block whole; the generation fills it before taking another. On
    capacity-bound real vLLM, counting tokens instead left the occupancy model 1-2 blocks short on most of
    the requests it priced (session 21)."""
    a = ActiveSequences(clock=Clock())
    a.first_token(a.add(0, 0.0, 1.0, streamed=True, tokens=600, max_tokens=0, hashes=[1] * 38, block_size=16))
    assert a.inflight_tokens() == 608  # 38 blocks
    b = ActiveSequences(clock=Clock())
    b.first_token(b.add(0, 0.0, 1.0, streamed=True, tokens=600, max_tokens=16, hashes=[1] * 38, block_size=16))
    # 15 of the 16 are written (the last one is never fed back): 8 in the prompt's last block, 7 in one more
    assert b.inflight_tokens() == 624
    # a generation that crosses into a new block takes it whole (1,035 tokens: 33 blocks, not 1,036 tokens)
    c = ActiveSequences(clock=Clock())
    crossing = c.add(0, 0.0, 1.0, streamed=True, tokens=1020, max_tokens=16, hashes=[2] * 32, block_size=32)
    # not decoding yet: a request sent now is admitted before it generates, so the occupancy model counts
    # its prompt only (it counted the whole generation)
    assert c.inflight_tokens() == 1024
    c.first_token(crossing)
    assert c.inflight_tokens() == 1056


def test_a_shared_document_is_taken_when_its_first_reader_runs_not_when_the_last_does():
    """Two readers of one document wait at a scrape; when the first runs, vLLM allocates the document. Its
    blocks were left out of the KV taken because the second, still waiting, "shared" them, and again when
    the second ran (the first held them then): the room read the document free until the next scrape
    (found by a review). Only running requests hold blocks."""
    a = ActiveSequences()
    doc = list(range(100))  # 1,600 tokens
    kw = dict(streamed=True, tokens=1600, max_tokens=16, block_size=16)
    first = a.add(1600, 1600.0, 1.0, hashes=doc, **kw)
    second = a.add(1600, 1600.0, 1.0, hashes=list(doc), **kw)
    a.mark_scrape(2.0)  # both waiting at the scrape: none of it in the usage
    a.first_token(first)
    assert a.kv_since_scrape() == -(1600 + 16)  # the document and the first's answer block
    a.first_token(second)
    assert a.kv_since_scrape() == -(1600 + 16 + 16)  # the second adds only its answer's block
    a.finish(first, 16)
    assert a.kv_since_scrape() == -(1600 + 16 + 16) + 16  # the second still holds the document
    a.finish(second, 16)
    assert a.kv_since_scrape() == 0


def test_kv_taken_at_one_expected_length_is_freed_at_that_length():
    """A response without usage (a client that left mid-stream) was freed at the worker's expected answer as
    it is at its end, which another response may have moved since its KV was taken: 4,032 tokens of room
    misread until the next scrape (found by a review). It is freed at the length it was taken at."""
    a = ActiveSequences()
    long = a.add(1600, 1600.0, 1.0, streamed=True, tokens=1600, max_tokens=4096, block_size=16)
    short = a.add(16, 16.0, 1.0, streamed=True, tokens=16, max_tokens=4096, block_size=16)
    a.mark_scrape(0.0)  # both running at the scrape: their prompts are in its usage
    a.first_token(long)  # its generation taken at max_tokens (nothing learnt yet)
    a.first_token(short)
    a.finish(short, 50)  # answers here are 50 tokens: long's expected length drops to 50
    assert long.expected == 50
    a.finish(long)  # no usage: freed at the 4,096 it was taken at
    assert a.kv_since_scrape() == 1600 + 16  # what the scrape's usage had of them: both prompts


def test_a_scrape_applies_what_its_page_saw_not_what_happened_while_it_was_read():
    """The tracker's side of a scrape taken at the page's request (the registry's side:
    tests/gateway/test_registry.py). A request the page saw waiting that starts while the page is read keeps
    its whole take (the usage has none of it); one it saw running keeps only its answer's; the KV freed
    meanwhile stays counted; a slow scrape overtaken by a later one marks nothing."""
    a = ActiveSequences()
    kw = dict(streamed=True, tokens=1600, max_tokens=160, block_size=16)
    waits = a.add(1600, 1600.0, 1.0, hashes=list(range(100)), **kw)
    snap = a.scrape_snapshot()  # the page: one waiting
    a.first_token(waits)
    a.mark_scrape(1.0, snap)
    assert a.kv_since_scrape() == -(1600 + 160) and not waits.admitted
    runs = a.add(1600, 1600.0, 1.0, hashes=list(range(1000, 1100)), **kw)
    slow = a.scrape_snapshot()
    snap = a.scrape_snapshot()  # the page: nothing waiting
    a.first_token(runs)
    a.finish(waits, 160)
    a.mark_scrape(0.0, snap)
    assert runs.admitted and a.kv_since_scrape() == (1600 + 160) - 160
    a.mark_scrape(0.0, slow)  # older than the one marked: nothing changes
    assert a.kv_since_scrape() == (1600 + 160) - 160


def test_a_request_that_never_ran_leaves_no_trace():
    """A request the worker never ran (refused, not reached, its client gone while the gateway held it)
    was ended as a release: its whole prompt and expected answer moved the LRU clock, so every cached
    prefix there read 5,680 tokens older (found by a review), and the progress priced on the head of the
    queue restarted. Withdrawn, it leaves the tracker with nothing counted; one seen running ends as a
    release."""
    clock = [10.0]
    a = ActiveSequences(clock=lambda: clock[0])
    prefix = list(range(100))
    a.finish(a.add(0, 0.0, 1.0, streamed=True, tokens=1600, max_tokens=16, hashes=prefix, block_size=16), 16)
    head = a.add(2000, 2000.0, 1.0, streamed=True, tokens=2000, hashes=list(range(500, 625)), block_size=16)
    gone = a.add(1600, 1600.0, 1.0, streamed=True, tokens=1600, max_tokens=4096,
                 hashes=list(range(1000, 1100)), block_size=16)
    clock[0] = 13.0
    def state():
        return a.prefix_age(prefix, 100), a.released_tokens, a.kv_since_scrape(), a.view().head_elapsed_s

    before = state()
    a.withdraw(gone)
    assert len(a) == 1 and state() == before
    a.first_token(head)
    a.withdraw(head)  # it ran: a release
    assert len(a) == 0 and a.released_tokens > before[1]
