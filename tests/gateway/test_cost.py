"""The cost model and policies on hand-built inputs (no servers)."""
from __future__ import annotations

import pytest

from indexer.index.base import WorkerMatch
from router.config import RoutingConfig, WorkerConfig
from router.cost import MIN_COMPUTE_SHARE, STEP_FLOOR_SHARE, CostModel
from router.policies import RouteRequest, create_policy
from router.calibrate import EngineCalibration
from router.load import ActiveSequences
from router.worker import EngineSample, Worker


def model(cfg: RoutingConfig, engine=(0.0, 0.0, 0.0)) -> CostModel:
    """A cost model whose (fleet-wide) step figures are ``engine``: (step s, per-decode s, overhead s);
    zero by default, so the prefill-speed tests see prefill compute alone."""
    cm = CostModel(cfg)
    cm.fleet_engine = EngineCalibration(*engine)
    return cm


def worker(name, prefilling=(), decoding=0, mean=500.0, **config):
    """A worker with requests the gateway sent: ``prefilling`` (uncached tokens = work of each, no first
    token yet) and ``decoding`` ones."""
    w = Worker(name=name, url=f"http://{name}", config=WorkerConfig(url=f"http://{name}", **config),
               healthy=True, active=ActiveSequences(clock=lambda: 100.0))  # a still clock: none prefilled yet
    for tokens in prefilling:
        w.active.add(tokens, tokens, predicted_s=1e6)
    for _ in range(decoding):
        w.active.first_token(w.active.add(0, 0.0, predicted_s=1e6))
    w.active.mean_work = w.active.mean_tokens = mean
    return w


def test_prediction_steps_the_queue_forward():
    cfg = RoutingConfig(prefill_tokens_per_s=1000.0, g4_bytes_per_block=1000, g4_bytes_per_s=1e6,
                        attention_knee_tokens=0, max_num_batched_tokens=512)
    cm = model(cfg, engine=(0.002, 0.001, 0.003))
    w = worker("a", prefilling=[1000], decoding=2)
    w.load.waiting, w.load.running = 3, 1
    c = cm.score(w, WorkerMatch(gpu=2, cpu=0, local=2), g4=5, num_tokens=200, block_size=16)
    # queue: 1000 own tokens + (3-1) waiting the gateway did not send x 500 = 2000 tokens, 2 decodes
    assert (c.queue_requests, c.queue_tokens, c.decodes) == (3, 2000, 2)
    # 510 prompt tokens a step (512 less 2 decodes): 4 steps for the queue, a 5th ends this prefill;
    # a step costs 2 ms + 2 x 1 ms
    assert c.steps == 5 and c.step_ms == pytest.approx(4.0)
    assert c.queue_ms == pytest.approx(2000 + 4 * 4)
    assert c.cached_tokens == 5 * 16 and c.uncached_tokens == 120 and c.g4_blocks == 3
    assert c.prefill_ms == pytest.approx(120 + 4 + 3) and c.g4_load_ms == 3.0  # compute, 1 step, overhead
    assert c.predicted_ttft_ms == c.queue_ms + c.prefill_ms + c.g4_load_ms
    assert c.calibration == "defaults" and not c.clamped
    # the worker's own budget (its --max-num-batched-tokens) counts
    big = worker("b", prefilling=[1000], decoding=2, max_num_batched_tokens=4096)
    big.load.waiting, big.load.running = 3, 1
    assert cm.score(big, WorkerMatch(local=2), 5, 200, 16).steps == 2


def test_requests_held_at_the_prefill_gate_that_are_longer_queue_behind_a_short_one():
    """The prefill gate (router/admission.py) sends the shortest held request first: a short prompt is
    priced behind the prompt the worker prefills and the shorter held ones only, a long one behind all."""
    cfg = RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, max_num_batched_tokens=512)
    cm = model(cfg)
    w = worker("a", prefilling=[400, 300, 50])
    sent, long_held, short_held = w.active._live.values()
    long_held.gated = short_held.gated = True
    short = cm.score(w, WorkerMatch(), 0, 100, 16)
    assert (short.queue_requests, short.queue_tokens, short.queue_ms) == (2, 450, pytest.approx(450.0))
    assert short.jumped_requests == 1  # it goes before the long held one (the delay scorer prices that)
    long = cm.score(w, WorkerMatch(), 0, 1000, 16)
    assert (long.queue_requests, long.queue_tokens, long.queue_ms) == (3, 750, pytest.approx(750.0))
    assert long.jumped_requests == 0
    assert w.view().gated_requests == 2 and w.view().prefill_requests == 3


def test_the_queue_ahead_counts_only_what_the_worker_has_not_prefilled_yet():
    """vLLM prefills its waiting requests first come, first served: the first one sent has been worked on
    since it was sent (or since the prefill before it ended), and only the rest of it is queue. On the fleet
    simulator the queue was priced whole: with 0.5 s or more of it predicted, the observed TTFT was half
    the predicted (median), and busy holders looked twice as busy as they were."""
    cfg = RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, max_num_batched_tokens=100_000)
    cm = model(cfg)
    now = [100.0]
    w = Worker(name="a", url="http://a", config=WorkerConfig(url="http://a"), healthy=True,
               active=ActiveSequences(clock=lambda: now[0]))
    first = w.active.add(1000, 1000.0, predicted_s=1e6, streamed=True)
    now[0] = 100.2
    w.active.add(500, 500.0, predicted_s=1e6, streamed=True)

    def queue(at: float) -> tuple[float, float]:
        now[0] = at
        c = cm.score(w, WorkerMatch(), 0, 100, 16)
        return round(c.queue_ms, 6), round(c.queue_done_ms, 6)

    assert queue(100.4) == (1100.0, 400.0)  # 0.4 s of the first's 1 s done
    assert queue(101.5) == (500.0, 1000.0)  # late: never more than the first's own prefill
    w.active.first_token(first)  # at 101.5: the second (sent at 100.2) starts now
    assert queue(101.8) == (200.0, 300.0)
    assert queue(103.0) == (0.0, 500.0)
    cm.cfg = cfg.model_copy(update={"queue_progress": False})  # off: priced whole
    assert queue(103.0) == (500.0, 0.0)


def test_a_long_prompt_takes_several_steps_and_decodes_slow_each():
    cm = model(RoutingConfig(prefill_tokens_per_s=10_000.0, attention_knee_tokens=0,
                             max_num_batched_tokens=2048), engine=(0.01, 0.002, 0.0))
    idle = worker("a")
    busy = worker("b", decoding=20)
    c_idle = cm.score(idle, WorkerMatch(), 0, 20_000, 16)
    c_busy = cm.score(busy, WorkerMatch(), 0, 20_000, 16)
    assert c_idle.steps == 10 and c_busy.steps == 10  # ceil(20000 / 2048) and ceil(20000 / 2028)
    assert c_busy.predicted_ttft_ms - c_idle.predicted_ttft_ms == pytest.approx(10 * 20 * 2.0)


def test_bad_inputs_are_clamped_not_zero_or_infinite():
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0), engine=(float("inf"), 0.0, 0.0))
    c = cm.score(worker("a"), WorkerMatch(), 0, 100, 16)
    assert c.clamped and 0 < c.predicted_ttft_ms < float("inf")
    cm.fleet_engine = EngineCalibration(float("nan"), 0.0, 0.0)
    c = cm.score(worker("b"), WorkerMatch(), 0, 100, 16)
    assert c.clamped and 0 < c.predicted_ttft_ms < float("inf")
    empty = cm.score(worker("c"), WorkerMatch(), 0, 0, 16)
    assert empty.predicted_ttft_ms > 0


def test_calibration_moves_towards_observed_speed():
    """With the TTFT fit off (router/ttft_fit.py), streamed TTFTs calibrate the prefill speed."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, calibration_alpha=0.5, attention_knee_tokens=0,
                             ttft_fit=False))
    w = worker("a")
    c = cm.score(w, WorkerMatch(), g4=0, num_tokens=4000, block_size=16)
    cm.observe_ttft(w, 1.0, c)  # 4000 tokens in 1 s: 4000 t/s observed, the first sample: the prior goes
    assert cm.prefill_speed(w) == 4000.0
    small = cm.score(w, WorkerMatch(), g4=0, num_tokens=10, block_size=16)
    cm.observe_ttft(w, 5.0, small)  # too small to say anything about prefill speed
    assert cm.prefill_speed(w) == 4000.0
    c = cm.score(w, WorkerMatch(), g4=0, num_tokens=4000, block_size=16)
    cm.observe_ttft(w, 2.0, c)  # 2000 t/s: moves halfway (alpha 0.5)
    assert cm.prefill_speed(w) == 3000.0
    assert cm.score(w, WorkerMatch(), g4=0, num_tokens=6000, block_size=16).prefill_ms == 2000.0


def test_the_first_measurement_replaces_a_prior_that_is_far_off():
    """The prior (10,000 tokens/s) is a guess: vLLM's first measured prefills replace it, so the first
    burst after a start is priced at the servers' speed. Capacity-bound CPU vLLM (bfloat16 emulated) ran
    35 tokens/s; moved by the EWMA from the prior, the first wave was priced at 6,724 tokens/s and its
    TTFTs came 180-560x the prediction. Later samples average in, each still clamped to 10x."""
    cm = model(RoutingConfig(attention_knee_tokens=0, calibration_alpha=0.2))
    w = worker("a")
    cm.observe_engine_prefill(w, tokens=5056, seconds=5056 / 35.0, requests=2)  # the warm-up, at idle
    assert cm.prefill_speed(w) == pytest.approx(35.0, rel=0.02)
    queued = cm.score(w, WorkerMatch(), g4=0, num_tokens=900, block_size=32)
    assert queued.predicted_ttft_ms > 900 / 40.0 * 1000  # >= 22 s, not 0.2 s
    cm.observe_engine_prefill(w, tokens=4000, seconds=4000 / 65.0, requests=4)  # under load, batched
    assert cm.prefill_speed(w) == pytest.approx(50.0, rel=0.05)  # a running mean of the two
    cm.observe_engine_prefill(w, tokens=4000, seconds=4000 / 1e9, requests=4)  # absurd: clamped to 10x
    assert cm.prefill_speed(w) < 50.0 * 10


def test_absurd_engine_samples_never_leave_a_calibration_at_zero_or_infinity():
    """Calibration samples from a broken exporter (found by a review): a prefill-token sum of 1e300 (each
    sample moved the fleet's speed up to 10x, past its range after two and to inf after 671, where no honest
    sample brought it back and every prediction lost its compute); a running count of 1e200 (inf in the
    step regression's sums for good: the step time sat at its floor); an inter-token latency whose prefill
    part is NaN (the step learnt at 1% of it). None of them moves anything now; the figures stay in range."""
    from router.calibrate import STEP_RANGE_S
    from router.cost import RATIO_RANGE, TPS_RANGE

    cm = model(RoutingConfig(attention_knee_tokens=0))
    w = worker("a")
    cm.observe_engine_prefill(w, tokens=4000, seconds=4.0, requests=4)
    assert cm.prefill_speed(w) == pytest.approx(1000.0)
    for _ in range(700):
        cm.observe_engine_prefill(w, tokens=4e300, seconds=2.0, requests=4.0)
    assert cm.prefill_speed(w) == pytest.approx(1000.0)
    for _ in range(50):  # a speed far off still moves by at most 10x a sample and stays in range
        cm.observe_engine_prefill(w, tokens=4e7, seconds=1e-3, requests=4)
    assert TPS_RANGE[0] <= cm.fleet_tps <= TPS_RANGE[1]
    assert RATIO_RANGE[0] <= w.prefill_ratio <= RATIO_RANGE[1]
    cal = EngineCalibration(0.02, 0.002, 0.0)
    for running in (2.0, 4.0, 8.0, 1e200, float("inf"), float("nan")):
        cal.observe_steps(running, 0.02 + 0.002 * min(running, 8.0))
    assert cal.step_samples == 3 and STEP_RANGE_S[0] < cal.step_s < 0.05
    cm.observe_engine(w, EngineSample(itl_s=0.05, running=2.0, overhead_s=None, prefill_tokens_per_step=None))
    before = cm.fleet_engine.step_s
    nan_prefill = EngineSample(itl_s=0.05, running=2.0, overhead_s=None, prefill_tokens_per_step=float("nan"))
    from router.worker import WorkerLoad
    now = WorkerLoad(steps=10.0, computed_tokens=float("inf"))
    then = WorkerLoad(steps=5.0, computed_tokens=1e15)
    assert now.engine_since(then).prefill_tokens_per_step is None  # inf - 1e15: not a count
    cm.observe_engine(w, nan_prefill)
    assert cm.fleet_engine.step_s >= before * 0.5


def test_the_predictors_settings_are_bounded():
    """An EWMA weight above 1 drove the speed negative; an infinite overhead or a NaN prior put every
    prediction at a clamp: the settings refuse them (a clear error at load, not a gateway that prices
    nothing)."""
    import pydantic

    for bad in ({"calibration_alpha": 2.0}, {"calibration_alpha": 0.0}, {"request_overhead_ms": float("inf")},
                {"prefill_tokens_per_s": float("nan")}, {"step_ms": float("inf")}, {"g4_bytes_per_s": 0.0}):
        with pytest.raises(pydantic.ValidationError):
            RoutingConfig(**bad)


def test_policies_order():
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0))
    a, b, c = worker("a"), worker("b", decoding=2), worker("c")
    req = RouteRequest("m", "/v1/chat/completions", {"x-session-id": "s"})
    cands = [cm.score(a, WorkerMatch(), 0, 1000, 16), cm.score(b, WorkerMatch(local=50), 0, 1000, 16),
             cm.score(c, WorkerMatch(), 0, 1000, 16)]
    kv = create_policy(RoutingConfig())
    assert kv.order(req, cands)[0].worker == "b"  # cached prefix, negligible queue
    ll = create_policy(RoutingConfig(), "least_loaded")
    assert ll.order(req, cands)[-1].worker == "b"
    rr = create_policy(RoutingConfig(), "round_robin")
    firsts = [rr.order(req, cands)[0].worker for _ in range(3)]
    assert sorted(firsts) == ["a", "b", "c"]
    ss = create_policy(RoutingConfig(), "session")
    ss.chosen(req, "c")
    assert ss.order(req, cands)[0].worker == "c"
    assert ss.order(RouteRequest("m", "/", {}), cands)[0].worker == "b"
    # Ties between identical idle workers rotate.
    idle = [cm.score(worker(n), WorkerMatch(), 0, 100, 16) for n in "xyz"]
    assert len({kv.order(req, idle)[0].worker for _ in range(3)}) == 3


def test_one_calibrated_worker_does_not_take_every_request():
    """The first observation calibrates the fleet-wide speed, which every worker without enough samples of
    its own uses: a freshly calibrated worker does not look faster than its idle twins (a hot spot). (TTFTs
    calibrate the speed with the TTFT fit off; the fit itself is fleet-wide too: test_ttft_fit.py.)"""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, calibration_alpha=0.5, attention_knee_tokens=0,
                             ttft_fit=False))
    a, b = worker("a"), worker("b")
    c = cm.score(a, WorkerMatch(), g4=0, num_tokens=4000, block_size=16)
    cm.observe_ttft(a, 0.5, c)  # 8000 t/s observed on a
    sa = cm.score(a, WorkerMatch(), g4=0, num_tokens=4000, block_size=16)
    sb = cm.score(b, WorkerMatch(), g4=0, num_tokens=4000, block_size=16)
    assert sa.predicted_ttft_ms == sb.predicted_ttft_ms < c.predicted_ttft_ms
    policy = create_policy(RoutingConfig(), "kv")
    firsts = {policy.order(RouteRequest("m", "/v1/completions", {}), [sa, sb])[0].worker for _ in range(4)}
    assert firsts == {"a", "b"}  # ties rotate


def test_attention_makes_long_contexts_cost_more_and_calibration_sees_through_it():
    """Prefill time per token grows with context (attention). The same 1,000 new tokens cost more after a
    30K-token cached prefix than cold; and a worker that serves long conversations is not mistaken for a
    slow worker: observed speeds of short and long prompts on one device calibrate to the same figure."""
    knee = 16_384
    cm = model(RoutingConfig(prefill_tokens_per_s=10_000.0, attention_knee_tokens=knee))
    w = worker("a")
    cold = cm.score(w, WorkerMatch(), 0, 1000, 16)
    long = cm.score(w, WorkerMatch(local=30_000 // 16), 0, 31_000, 16)
    assert long.uncached_tokens == cold.uncached_tokens == 1000
    assert long.prefill_ms > 2.5 * cold.prefill_ms
    # One device: seconds = work / 20,000 for every request (the model's own shape)
    short_s = cm.work(2000, 0) / 20_000
    long_s = cm.work(2000, 60_000) / 20_000
    assert long_s > 4 * short_s  # per token, the long-context request looks over 4x slower
    a, b = worker("a"), worker("b")
    cm.cfg.per_worker_prefill_speed = True
    for _ in range(80):  # a serves short prompts, b long conversations, as sticky routing does
        cm.observe_engine_prefill(a, 2000, short_s, 1, prompt_tokens=2000)
        cm.observe_engine_prefill(b, 2000, long_s, 1, prompt_tokens=62_000)
    assert cm.prefill_speed(a) == pytest.approx(20_000, rel=0.01)
    assert cm.prefill_speed(b) == pytest.approx(20_000, rel=0.01)


def _engine_samples(cm, workers, speeds, rounds):
    """vLLM prefill histograms of ``rounds`` scrape intervals: worker i computes at speeds[k] x its factor."""
    for k in range(rounds):
        for w, factor in workers:
            tps = speeds[k % len(speeds)] * factor
            cm.observe_engine_prefill(w, tokens=4000, seconds=4000 / tps, requests=2)


def test_identical_workers_keep_one_speed_through_a_noisy_mix():
    """Observed prefill speed swings with the request mix (short cold prompts look fast, long or
    context-heavy ones slow). Identical workers that happened to see different parts of the mix must still
    be priced alike, or the one that looks fastest draws far more than its share."""
    cm = model(RoutingConfig(prefill_tokens_per_s=10_000.0, attention_knee_tokens=0,
                                 per_worker_prefill_speed=True))
    a, b = worker("a"), worker("b")
    for k in range(60):  # a sees the fast half of the mix, b the slow half, in turn
        fast, slow = (a, b) if k % 2 else (b, a)
        cm.observe_engine_prefill(fast, 4000, 4000 / 30_000, 2)
        cm.observe_engine_prefill(slow, 4000, 4000 / 10_000, 2)
    for k in range(6):  # then a run of the mix's extremes
        cm.observe_engine_prefill(a, 4000, 4000 / 30_000, 2)
        cm.observe_engine_prefill(b, 4000, 4000 / 10_000, 2)
    ratio = cm.prefill_speed(a) / cm.prefill_speed(b)
    assert 1.0 < ratio < 1.6  # a 3x apart per-worker EWMA would say ~2.5
    fleet_only = model(RoutingConfig(prefill_tokens_per_s=10_000.0))  # the default prices them alike
    _engine_samples(fleet_only, [(a, 1.0), (b, 0.5)], [30_000, 10_000], 40)
    assert fleet_only.prefill_speed(a) == fleet_only.prefill_speed(b)


def test_a_persistently_slower_worker_is_priced_slower():
    cm = model(RoutingConfig(prefill_tokens_per_s=10_000.0, attention_knee_tokens=0,
                                 per_worker_prefill_speed=True))
    a, b = worker("a"), worker("b")
    _engine_samples(cm, [(a, 1.0), (b, 0.5)], [30_000, 10_000, 20_000], 120)
    assert 0.35 < cm.prefill_speed(b) / cm.prefill_speed(a) < 0.65  # half the speed, give or take the mix
    holder, other = (cm.score(w, WorkerMatch(), 0, 4000, 16) for w in (a, b))
    assert create_policy(RoutingConfig(), "kv").order(RouteRequest("m", "/v1/completions", {}),
                                                      [other, holder])[0].worker == "a"


def test_near_tie_goes_to_the_cache_holder_clear_win_does_not():
    from router.cost import Candidate

    def cand(name, cached, uncached, ttft):
        return Candidate(worker=name, cached_tokens=cached, uncached_tokens=uncached, prefill_work=uncached,
                         predicted_ttft_ms=ttft, prefill_tokens_per_s=10_000.0)

    req = RouteRequest("m", "/v1/completions", {})
    holder, idle = cand("h", 600, 240, 81.0), cand("i", 0, 840, 78.0)
    no_redo = RoutingConfig(recompute_weight=0.0)
    assert create_policy(no_redo, "kv").order(req, [idle, holder])[0].worker == "h"
    assert create_policy(RoutingConfig(cache_affinity=0.0, recompute_weight=0.0),
                         "kv").order(req, [holder, idle])[0].worker == "i"
    # A second turn whose holder is busy with one other prompt (the multi-turn case on real vLLM): per
    # request the idle worker is 30% faster, but it would recompute the 600 tokens the holder has, so the
    # turn stays; pricing only this request's TTFT sends it away.
    busy = cand("h", 600, 240, 107.0)
    assert create_policy(RoutingConfig(), "kv").order(req, [idle, busy])[0].worker == "h"
    assert create_policy(no_redo, "kv").order(req, [busy, idle])[0].worker == "i"
    # A holder whose queue costs more than recomputing the prefix twice loses the request.
    swamped = cand("h", 600, 240, 250.0)
    assert create_policy(RoutingConfig(), "kv").order(req, [swamped, idle])[0].worker == "i"


def test_a_prefix_the_queue_would_evict_is_not_counted_as_cached():
    """Capacity-bound: 100 free blocks (1000 at 90% use) and 1,600 tokens (100 blocks) queued ahead evict
    everything free before this request is scheduled; three quarters of that queue, half the prefix; half
    of it or less, none (a prefix in the index was used recently)."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    full = worker("a", prefilling=[1600])
    full.load.kv_usage, full.load.num_gpu_blocks, full.load.updated_at = 0.9, 1000, 1.0
    c = cm.score(full, WorkerMatch(gpu=40, local=40), 0, 1000, 16)
    assert c.evicted_blocks == 40 and c.cached_tokens == 0
    most = worker("b", prefilling=[1200])
    most.load.kv_usage, most.load.num_gpu_blocks, most.load.updated_at = 0.9, 1000, 1.0
    c = cm.score(most, WorkerMatch(gpu=40, local=40), 0, 1000, 16)
    assert c.evicted_blocks == 20 and c.cached_tokens == 20 * 16
    half = worker("b", prefilling=[800])
    half.load.kv_usage, half.load.num_gpu_blocks, half.load.updated_at = 0.9, 1000, 1.0
    assert cm.score(half, WorkerMatch(gpu=40, local=40), 0, 1000, 16).evicted_blocks == 0
    roomy = worker("c", prefilling=[1600])
    roomy.load.kv_usage, roomy.load.num_gpu_blocks, roomy.load.updated_at = 0.1, 100_000, 1.0
    assert cm.score(roomy, WorkerMatch(gpu=40, local=40), 0, 1000, 16).evicted_blocks == 0
    unknown = worker("d", prefilling=[1600])  # no cache_config_info: no discount
    unknown.load.kv_usage, unknown.load.updated_at = 0.99, 1.0
    assert cm.score(unknown, WorkerMatch(gpu=40, local=40), 0, 1000, 16).cached_tokens == 640
    never = worker("e", prefilling=[1600])  # gauges never scraped: no evidence, no discount
    never.load.kv_usage, never.load.num_gpu_blocks = 0.9, 1000
    assert cm.score(never, WorkerMatch(gpu=40, local=40), 0, 1000, 16).cached_tokens == 640


def test_step_figures_are_fleet_wide_unless_per_worker():
    """Every worker's engine samples move the fleet's step figures, which identical workers share: a
    worker whose own estimate came out lower by noise does not draw every cold request."""
    cm = model(RoutingConfig(prefill_tokens_per_s=10_000.0), engine=(0.01, 0.0, 0.005))
    a, b = worker("a"), worker("b")
    for d in range(6):
        cm.observe_engine(a, EngineSample(0.010, d, 0.004))
        cm.observe_engine(b, EngineSample(0.014, d, 0.006))
    assert a.engine.step_s < b.engine.step_s  # each keeps its own, shown in /admin/workers
    sa, sb = (cm.score(w, WorkerMatch(), 0, 100, 16) for w in (a, b))
    assert sa.predicted_ttft_ms == sb.predicted_ttft_ms
    cm.cfg.per_worker_prefill_speed = True
    sa, sb = (cm.score(w, WorkerMatch(), 0, 100, 16) for w in (a, b))
    assert sa.predicted_ttft_ms < sb.predicted_ttft_ms


def test_a_step_figure_that_is_off_takes_at_most_half_the_prefill_seconds():
    """The step figure and the prefill speed are learnt from each other: with a step time of seconds (the
    prefill left in it), subtracting the steps from vLLM's prefill seconds down to a tenth made the speed
    10x too high, which left more prefill in the next step figure. At most half is taken off now."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, calibration_alpha=1.0),
               engine=(5.0, 0.0, 0.0))  # a 5 s step, far above the 2 s the prefills took
    w = worker("a")
    cm.observe_engine_prefill(w, tokens=2000, seconds=2.0, requests=1)
    assert cm.fleet_tps == pytest.approx(2000 / (2.0 * MIN_COMPUTE_SHARE))  # 2,000 tokens/s, not 10,000


def test_prefill_chunks_are_taken_out_of_the_step_time():
    """Capacity-bound real vLLM on CPU: decodes shared their steps with long prefill chunks, the mean
    inter-token latency was ~1 s where a decode-only step took tens of ms, and pricing every queued step
    at that double-counted the queue's prefill. The interval's computed prompt tokens per step, at the
    prefill speed, come off (never below a share of the latency)."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0), engine=(0.01, 0.0, 0.0))
    w = worker("a")
    for _ in range(8):  # each step: 20 ms of its own and a 500-token chunk at 1000 tokens/s (0.5 s)
        cm.observe_engine(w, EngineSample(0.52, 3, None, prefill_tokens_per_step=500))
    assert w.engine.step_time_s(3) == pytest.approx(0.020, rel=0.05)
    raw = worker("b")  # the same latency without the per-step prefill figure (older vLLM): all of it
    cm2 = model(RoutingConfig(prefill_tokens_per_s=1000.0), engine=(0.01, 0.0, 0.0))
    for _ in range(8):
        cm2.observe_engine(raw, EngineSample(0.52, 3, None))
    assert raw.engine.step_time_s(3) == pytest.approx(0.52, rel=0.05)
    slow = worker("c")  # a prefill speed estimate far too low would take it all: a floor share stays
    cm3 = model(RoutingConfig(prefill_tokens_per_s=10.0), engine=(0.01, 0.0, 0.0))
    for _ in range(8):
        cm3.observe_engine(slow, EngineSample(0.52, 3, None, prefill_tokens_per_step=500))
    assert slow.engine.step_time_s(3) == pytest.approx(0.52 * STEP_FLOOR_SHARE, rel=0.05)


def test_a_request_waits_for_running_ones_to_free_kv_it_needs():
    """Capacity-bound real vLLM: a server whose KV is held by decoding requests schedules a new prompt only
    when enough of them finish (16 output tokens at ~1 s a step on CPU: seconds). The model waits for the
    earliest ends that free enough; with room, or with nothing known to end, no wait."""
    clock = [100.0]

    def loaded(name, usage):
        w = worker(name)
        w.active = ActiveSequences(clock=lambda: clock[0])
        for first, n in ((99.0, 16), (97.0, 16)):  # two decoding requests of 1,000 prompt tokens
            w.active.first_token(seq := w.active.add(0, 0.0, 1e6, streamed=True, tokens=1000, max_tokens=n))
            seq.first_at = first
        w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = usage, 200, 1.0  # 3,200 tokens
        w.active.mark_scrape()  # the scrape saw them (as the registry marks it)
        return w

    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0), engine=(0.5, 0.0, 0.0))
    full = cm.score(loaded("a", 0.75), WorkerMatch(), 0, 1000, 16)  # 800 free, 1,000 needed
    # the request that started at 97 s ends first (97 + 16 x 0.5 s), freeing its 1,016 tokens
    assert full.kv_wait_ms == pytest.approx(5000.0)
    assert full.queue_ms == pytest.approx(5000.0) and full.predicted_ttft_ms > 5000.0
    roomy = cm.score(loaded("b", 0.25), WorkerMatch(), 0, 1000, 16)  # 2,400 free
    assert roomy.kv_wait_ms == 0.0
    # an unknown generation length is never waited for
    unknown = worker("c")
    unknown.active.first_token(unknown.active.add(0, 0.0, 1e6, streamed=True, tokens=3000))
    unknown.load.kv_usage, unknown.load.num_gpu_blocks, unknown.load.updated_at = 0.99, 200, 1.0
    assert cm.score(unknown, WorkerMatch(), 0, 1000, 16).kv_wait_ms == 0.0


def test_blocks_sent_but_not_indexed_yet_are_not_discounted():
    """RAG under pressure: the queue ahead is computing the very document this request shares (the gateway
    sent it there, router/pending.py): those blocks are in use, not evictable; only the indexed part is."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    w = worker("a", prefilling=[1600])
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.9, 1000, 1.0
    c = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, pending_blocks=40)
    assert c.evicted_blocks == 0 and c.cached_tokens == 640
    c = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, pending_blocks=10)
    assert c.cached_tokens == 0  # the indexed 30 are evicted: the run is cut before the pending ones


def test_with_waiting_evicts_a_prefix_no_request_holds_is_priced_lost_while_vllm_has_requests_waiting():
    """``waiting_evicts``: vLLM's scrape shows requests waiting, so its free queue (where an unheld cached
    prefix sits) is taken before this request runs: the prefix is priced recomputed; off by default, and
    with nothing waiting the room decides as before."""
    on = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, waiting_evicts=True))
    off = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    w = worker("a", prefilling=[500])
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at, w.load.waiting = 0.2, 1000, 1.0, 2.0
    c = on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16)
    assert (c.cached_tokens, c.evicted_blocks, c.eviction_model) == (0, 40, "waiting")
    assert off.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16).cached_tokens == 640
    w.load.waiting = 0.0
    assert on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16).cached_tokens == 640


def test_a_prefix_that_does_not_fit_beside_the_requests_in_flight_is_priced_evicted_from_its_tail():
    """``occupancy_evicts``: every request in flight is scheduled before a new one and holds its KV then; the
    part of the new prompt's cached prefix that no longer fits beside them is taken from the free queue while
    it waits (session 20's event log: over-predicted blocks were removed 0.2-6 s after their decision). A
    prefix a request in flight holds stays, and this prompt's own uncached tokens do not count (they are
    allocated after it is admitted)."""
    on = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    off = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, occupancy_evicts=False))
    w = worker("a")
    # 101 blocks, one of them vLLM's null block: 1,600 tokens of KV, 400 free
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.75, 101, 1.0
    for base in (1000, 2000):  # two decoding requests of 600 tokens, nothing shared: no queue
        w.active.first_token(w.active.add(600, 600.0, 1e6, streamed=True, tokens=600, max_tokens=0,
                                          hashes=list(range(base, base + 37)), block_size=16))
    w.active.mark_scrape(0.0)
    prefix = list(range(40))  # this prompt: 40 indexed blocks (640 tokens) of 1,000
    c = on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=prefix + [99] * 22)
    # each holds 38 blocks (its last one partial): 1,216 in flight + 640 of prefix = 1,856 > 1,600: 256 tokens
    # (16 blocks) go from its tail
    assert (c.local_blocks, c.evicted_blocks, c.eviction_model) == (24, 16, "occupancy")
    # the decision record has the terms to replay it: 1,216 in flight, none of the prefix held, 256 over
    assert (c.occupancy_tokens, c.occupancy_held_blocks, c.occupancy_excess_tokens) == (1216, 0, 256)
    assert off.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=prefix + [99] * 22).local_blocks == 40
    # a shorter prefix fits beside them: nothing lost (its 600 uncached tokens do not count)
    c = on.score(w, WorkerMatch(gpu=20, local=20), 0, 1000, 16, hashes=prefix[:20] + [99] * 42)
    assert c.local_blocks == 20 and c.occupancy_excess_tokens == 1216 + 320 - 1600
    assert c.occupancy_held_blocks is None  # not probed: it fits
    # a request in flight that holds the prefix: it is not in the free queue
    w.active.add(0, 0.0, 1e6, streamed=True, tokens=640, max_tokens=0, hashes=prefix, block_size=16)
    c = on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=prefix + [99] * 22)
    assert c.local_blocks == 40 and c.eviction_model != "occupancy"


def test_kv_released_after_a_prefix_does_not_spare_it():
    """``occupancy_age``: blocks released after the prefix sit behind it in vLLM's free queue (it evicts the
    least recently released first), so the room they take is not room the prefix keeps. Capacity-bound real
    vLLM, 3 rounds each in one run: with it 59.8-66.0% of prompt tokens cached and 0.76-1.09 s mean TTFT,
    without 57.6-62.2% and 1.06-1.30 s (docs/BENCHMARKS.md, session 21)."""
    on = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    off = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, occupancy_age=False))
    w = worker("a")
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.0, 101, 1.0  # 1,600 tokens of KV, all free
    prefix = list(range(40))  # 640 tokens: the last request that used it ended, then 320 more were released
    done = w.active.add(0, 0.0, 1e6, streamed=True, tokens=640, hashes=prefix, block_size=16)
    w.active.finish(done)
    later = w.active.add(0, 0.0, 1e6, streamed=True, tokens=320, hashes=list(range(500, 520)), block_size=16)
    w.active.finish(later)
    # a request sent since, not yet scheduled, whose 800 tokens will be taken from the free queue
    w.active.add(0, 0.0, 1e6, streamed=True, tokens=800, hashes=list(range(900, 950)), block_size=16)
    hashes = prefix + [99] * 22
    # 800 in flight + 640 of prefix = 1,440 fit in 1,600; the 320 released after it do not: 160 over
    c = on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=hashes)
    assert (c.local_blocks, c.evicted_blocks, c.eviction_model) == (30, 10, "occupancy")
    assert (c.occupancy_tokens, c.occupancy_excess_tokens, c.prefix_age_tokens) == (800, 160, 320)
    assert off.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=hashes).local_blocks == 40
    # only free blocks sit behind the prefix: with 800 free (a scrape shows 800 held), at most 160 of them
    w.load.kv_usage = 0.5
    assert on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=hashes).local_blocks == 40
    # the most recently released prefix has nothing behind it: it stays
    w.active.finish(w.active.add(0, 0.0, 1e6, streamed=True, tokens=640, hashes=prefix, block_size=16))
    assert on.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=hashes).local_blocks == 40
