"""The learnt TTFT correction (router/ttft_fit.py) through the cost model, on hand-built inputs."""
from __future__ import annotations

import math
import random

from indexer.index.base import WorkerMatch
from router.config import RoutingConfig
from router.ttft_fit import MAX_FACTOR, MIN_SAMPLES
from tests.gateway.test_cost import model, worker


def engine_ttft_s(c) -> float:
    """An engine unlike the model's figures: 0.2 s per request (the model says 1 s), 400 tokens/s for the
    queue's and the request's own tokens (the model says 1,000), 5 ms a step (the model says 20)."""
    return 0.2 + (c.queue_tokens + c.uncached_tokens) / 400.0 + c.steps * 0.005


def run(cm, n: int, seed: int = 0, observe=True, g4=False, engine=engine_ttft_s):
    """``n`` requests of mixed size, cache hit (local, or from G4 with ``g4``) and queue on one worker;
    (candidate, observed ms) each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = worker("a", prefilling=[rng.choice([0, 500, 1500]) for _ in range(rng.randint(0, 3))])
        num = rng.randint(100, 4000)
        hit = rng.randint(0, num // 16) if rng.random() < 0.5 else 0
        match = WorkerMatch() if g4 else WorkerMatch(gpu=hit, local=hit)
        c = cm.score(w, match, hit if g4 else 0, num, 16)
        y = engine(c)
        out.append((c, y * 1000.0))
        if observe:
            cm.observe_ttft(w, y, c)
    return out


def ratios(pairs):
    return sorted(obs / c.predicted_ttft_ms for c, obs in pairs)


def cfg(**kw) -> RoutingConfig:
    return RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0, **kw)


def test_the_fit_learns_what_the_models_figures_get_wrong():
    off = model(cfg(ttft_fit=False), engine=(0.02, 0.0, 1.0))
    on = model(cfg(), engine=(0.02, 0.0, 1.0))
    first = run(on, MIN_SAMPLES - 1)
    assert all(c.fit_ms == 0 and c.predicted_ttft_ms == c.model_ttft_ms for c, _ in first)  # too few yet
    run(off, 150)
    run(on, 150 - len(first))
    held_off, held_on = ratios(run(off, 100, seed=1)), ratios(run(on, 100, seed=1))
    # the model alone, its speed calibrated from the same TTFTs, cannot fit both ends (its 1 s overhead
    # prices small requests too high, so it settles on a speed too high for large ones)
    assert held_off[90] / held_off[10] > 1.45
    assert 0.9 < held_on[50] < 1.1 and held_on[90] / held_on[10] < 1.25
    fit = on.fleet_fit.to_dict()
    assert fit["active"] and fit["intercept_ms"] < -300 and fit["compute_scale"] > 1.8  # 1 s -> 0.2 s; 2.5x
    c, _ = run(on, 1, seed=2, observe=False)[0]
    assert c.predicted_ttft_ms == c.model_ttft_ms + c.fit_ms and c.fit_ms != 0


def test_bad_observations_never_drive_a_prediction_to_zero_or_infinity():
    cm = model(cfg(), engine=(0.02, 0.0, 1.0))
    rng = random.Random(3)
    w = worker("a")
    for i in range(200):
        c = cm.score(w, WorkerMatch(), 0, rng.randint(100, 4000), 16)
        cm.observe_ttft(w, [1e9, 1e-9, float("nan"), float("inf"), -1.0, 0.0][i % 6], c)
    assert cm.fleet_fit.ready and cm.fleet_fit.clipped > 0
    for n in (1, 100, 4000, 100_000):
        c = cm.score(w, WorkerMatch(), 0, n, 16)
        assert math.isfinite(c.predicted_ttft_ms) and c.predicted_ttft_ms > 0
        assert c.model_ttft_ms / MAX_FACTOR <= c.predicted_ttft_ms <= c.model_ttft_ms * MAX_FACTOR
    # a prediction the model clamped (bad figures) is neither corrected nor learnt from
    cm.fleet_engine.request_s = float("nan")
    before = cm.fleet_fit.samples
    c = cm.score(w, WorkerMatch(), 0, 100, 16)
    assert c.clamped and c.fit_ms == 0
    cm.observe_ttft(w, 0.5, c)
    assert cm.fleet_fit.samples == before


def test_one_workers_responses_correct_every_workers_prediction_unless_per_worker():
    """Fleet-wide by default (as the speed and step figures): identical workers stay priced alike."""
    cm = model(cfg(), engine=(0.02, 0.0, 1.0))
    run(cm, 60)  # all on worker "a"
    a, b = worker("a"), worker("b")
    ca, cb = (cm.score(x, WorkerMatch(), 0, 2000, 16) for x in (a, b))
    assert ca.predicted_ttft_ms == cb.predicted_ttft_ms != ca.model_ttft_ms
    cm.cfg.per_worker_prefill_speed = True
    assert cm.score(b, WorkerMatch(), 0, 2000, 16).fit_ms == cb.fit_ms  # b has no fit of its own yet


def test_the_fit_off_leaves_the_models_sum():
    cm = model(cfg(ttft_fit=False), engine=(0.02, 0.0, 1.0))
    pairs = run(cm, 50)
    assert cm.fleet_fit.samples == 0 and all(c.fit_ms == 0 for c, _ in pairs)


def test_the_fit_learns_what_an_asynchronous_g4_load_waits_beyond_its_bytes():
    """A request that loads from G4 is parked until the load is reported at a step's end and scheduled the
    step after: on the engine here 0.8 s beyond the model's price of the bytes. The fit learns that wait
    (``g4_load_ms``) and prices it only where a candidate loads from G4."""
    def g4_engine_s(c) -> float:
        return engine_ttft_s(c) + (0.8 if c.g4_blocks else 0.0)

    on = model(cfg(), engine=(0.02, 0.0, 1.0))
    run(on, 200, g4=True, engine=g4_engine_s)
    fit = on.fleet_fit.to_dict()
    held = run(on, 100, seed=1, observe=False, g4=True, engine=g4_engine_s)
    loading = sorted(obs / c.predicted_ttft_ms for c, obs in held if c.g4_blocks)
    local = sorted(obs / c.predicted_ttft_ms for c, obs in held if not c.g4_blocks)
    assert 0.85 < loading[len(loading) // 2] < 1.15 and 0.85 < local[len(local) // 2] < 1.15
    # priced alike: without the G4 term the loading ones read 7% higher than the rest (1.08 vs 1.01)
    assert abs(loading[len(loading) // 2] / local[len(local) // 2] - 1.0) < 0.04
    assert fit["g4_load_ms"] > 250  # learnt (ridge-shrunk towards 0 beside the other parts' scales)
