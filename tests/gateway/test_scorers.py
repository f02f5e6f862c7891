"""The kv policy's scorers (router/policies/scorers.py), one by one and composed, on hand-built candidates."""
from __future__ import annotations

import math

import pydantic
import pytest

from router.config import RoutingConfig
from router.cost import Candidate
from router.kv_room import kv_room
from router.policies import RouteRequest, create_policy
from router.policies.kv import kv_order, scorers_of
from router.policies.scorers import (ContinuityScorer, DelayScorer, Fleet, FootprintScorer, LoadScorer,
                                     RecomputeScorer, kv_pressure, roominess)
from router.worker import WorkerLoad

REQ = RouteRequest("m", "/v1/chat/completions", {})
TPS = 10_000.0
ONE_TURN = RoutingConfig(future_turns=1.0, stay_margin=0.1)  # the hysteresis the figures below are worked for
FOOTPRINT = RoutingConfig(footprint_weight=1.0)


def cand(name, cached=0, uncached=1000, ttft=100.0, blocks=None, **kw) -> Candidate:
    """Work = uncached tokens (linear); local blocks of 16 tokens cover the cached part."""
    return Candidate(worker=name, cached_tokens=cached, uncached_tokens=uncached, prefill_work=float(uncached),
                     predicted_ttft_ms=ttft, prefill_tokens_per_s=TPS,
                     local_blocks=cached // 16 if blocks is None else blocks, **kw)


def first(cfg: RoutingConfig, *cands: Candidate) -> str:
    return create_policy(cfg, "kv").order(REQ, list(cands))[0].worker


def test_the_holder_is_the_longest_local_prefix_when_it_is_a_meaningful_share():
    h, o = cand("h", cached=800, uncached=200), cand("o", cached=160, uncached=840)
    fleet = Fleet.of([o, h], overlap_share=0.1)
    assert fleet.holder is h and not fleet.low_overlap and fleet.least_work == 200
    # 5% of the prompt is not meaningful: low overlap, no holder
    fleet = Fleet.of([cand("a", cached=48, uncached=952), cand("b")], overlap_share=0.1)
    assert fleet.holder is None and fleet.low_overlap
    # a prefix every candidate holds (a system prompt) makes no holder either; a meaningful share beyond it does
    shared = [cand(n, cached=512, uncached=488) for n in "abc"]
    assert Fleet.of(shared, 0.1).holder is None and Fleet.of(shared, 0.1).low_overlap
    longer = cand("d", cached=640, uncached=360)
    assert Fleet.of(shared + [longer], 0.1).holder is longer
    assert Fleet.of(shared + [cand("e", cached=576, uncached=424)], 0.1).holder is None  # 6.4% beyond
    # G4 blocks are every worker's: they make no holder
    g4 = cand("g", cached=800, uncached=200, blocks=0, g4_blocks=50)
    assert Fleet.of([g4, cand("b")], 0.1).holder is None


def test_recompute_term_is_the_work_beyond_the_best_holder():
    h, o = cand("h", cached=800, uncached=200), cand("o", cached=0, uncached=1000)
    fleet = Fleet.of([h, o], 0.1)
    s = RecomputeScorer(2.0)
    assert s.ms(h, fleet) == 0 and s.ms(o, fleet) == pytest.approx(2 * 800 / TPS * 1000)


def test_continuity_term_prices_future_turns_and_the_margin_for_non_holders_only():
    h, o = cand("h", cached=800, uncached=200, ttft=300.0), cand("o", cached=0, uncached=1000)
    fleet = Fleet.of([h, o], 0.1)
    s = ContinuityScorer(future_turns=2.0, margin=0.1, margin_ms=5.0)
    assert s.ms(h, fleet) == 0
    assert s.ms(o, fleet) == pytest.approx(2 * 80.0 + 30.0 + 5.0)  # 2 turns x 800 tokens, 10% of 300, 5
    twin = cand("t", cached=800, uncached=200)  # holds as much as the holder: no cost to go there
    assert s.ms(twin, Fleet.of([h, twin, o], 0.1)) == 0
    assert s.ms(o, Fleet.of([cand("a"), o], 0.1)) == 0  # no holder, nothing to leave


def test_a_holder_with_a_roomy_cache_keeps_the_conversation_a_tight_one_loses():
    """``stay_margin_roomy``: the holder's margin grows by up to that share of its TTFT when its KV cache holds
    many prompts of this size (``roomy_prompts``), since its prefix outlives the turns to come there; with a
    cache that holds a few (the capacity-bound run's), or an unknown capacity, it is ``stay_margin``."""
    def holder(capacity):
        free = None if capacity is None else 0.5
        return cand("h", cached=800, uncached=200, ttft=1000.0, kv_free=free,
                    kv_free_tokens=None if capacity is None else 0.5 * capacity)
    idle = cand("i", cached=0, uncached=1000, ttft=110.0)
    assert roominess(holder(1_000_000), 8.0) == pytest.approx(1 - 8 * 1000 / 1_000_000)
    assert roominess(holder(6_560), 8.0) == 0 and roominess(holder(None), 8.0) == 0
    assert roominess(holder(16_000), 8.0) == pytest.approx(0.5)
    cfg = RoutingConfig()  # future_turns 3, stay_margin 0.3, stay_margin_roomy 1.2, roomy_prompts 8
    # the holder: 1000 ms less 8% affinity = 920; the idle worker: 110 + 80 (recompute) + 240 (3 future turns)
    # + the margin: 300 ms (tight) -> 730, it leaves; 0.3 + 1.2 x 0.992 of 1000 ms (roomy) -> 1,920, it stays
    assert first(cfg, holder(6_560), idle) == "i" and first(cfg, holder(None), idle) == "i"
    assert first(cfg, holder(1_000_000), idle) == "h"
    assert first(RoutingConfig(stay_margin_roomy=0), holder(1_000_000), idle) == "i"


def test_a_roomy_holder_loses_the_conversation_to_an_idle_worker_when_it_is_many_times_slower():
    """``stay_margin_idle``: the roomy margin passes 1 (here 1.49 x the holder's TTFT), and no queue on the
    holder would let the conversation go; towards a worker with nothing queued the margin is at most 0.8:
    a holder 5 s away loses the turn to a worker that answers in 110 ms, not to one with a queue."""
    holder = cand("h", cached=800, uncached=200, ttft=5000.0, kv_free=0.5, kv_free_tokens=500_000.0)
    idle = cand("i", cached=0, uncached=1000, ttft=110.0)
    queued = cand("q", cached=0, uncached=1000, ttft=110.0, queue_ms=50.0)
    cfg = RoutingConfig()
    # holder: 5000 less 8% affinity = 4600; idle: 110 + 80 + 240 + 0.8 x 5000 = 4430
    assert first(cfg, holder, idle) == "i"
    assert first(cfg, holder, queued) == "h"  # 110 + 80 + 240 + 1.49 x 5000
    assert first(RoutingConfig(stay_margin_idle=10.0), holder, idle) == "h"  # the cap off: it stayed
    # a holder twice as slow keeps it
    assert first(cfg, cand("h", cached=800, uncached=200, ttft=1000.0, kv_free=0.5,
                           kv_free_tokens=500_000.0), idle) == "h"


def test_no_margin_for_a_lead_the_candidate_loads_from_g4():
    """With G4, leaving the holder splits nothing: the other worker loads the holder's lead (it is its own
    the next turn), so only the part it would compute keeps the margin; the load time is in its TTFT."""
    h = cand("h", cached=800, uncached=200, ttft=300.0)
    s = ContinuityScorer(future_turns=2.0, margin=0.1, margin_ms=5.0)
    loads_all = cand("g", cached=800, uncached=200, blocks=0, g4_blocks=50)
    assert s.ms(loads_all, Fleet.of([h, loads_all], 0.1)) == 0
    loads_half = cand("g", cached=400, uncached=600, blocks=0, g4_blocks=25)
    # 2 turns x 400 tokens it computes, and half the margin (half the lead is computed)
    assert s.ms(loads_half, Fleet.of([h, loads_half], 0.1)) == pytest.approx(2 * 40.0 + 0.5 * (30.0 + 5.0))


def test_a_lead_loaded_from_g4_pays_the_g4_margin():
    """``stay_margin_g4``: loading the holder's lead from G4 costs the load, parks the request a step, and
    keeps the prefix on two workers' caches: the part of the lead loaded pays that share of the holder's
    TTFT."""
    h = cand("h", cached=800, uncached=200, ttft=300.0)
    s = ContinuityScorer(future_turns=2.0, margin=0.1, margin_ms=5.0, g4=1.0)
    loads_all = cand("g", cached=800, uncached=200, blocks=0, g4_blocks=50)
    assert s.ms(loads_all, Fleet.of([h, loads_all], 0.1)) == pytest.approx(300.0)
    loads_half = cand("g", cached=400, uncached=600, blocks=0, g4_blocks=25)
    assert s.ms(loads_half, Fleet.of([h, loads_half], 0.1)) == pytest.approx(
        2 * 40.0 + 0.5 * (30.0 + 5.0) + 0.5 * 300.0)
    # a worker 200 ms faster that would load it all stays behind the holder
    fast = cand("g", cached=800, uncached=200, blocks=0, g4_blocks=50, ttft=100.0)
    assert first(RoutingConfig(stay_margin_g4=1.0), h, fast) == "h"
    assert first(RoutingConfig(stay_margin_g4=0.0), h, fast) == "g"


def test_a_conversation_stays_under_a_small_queue_and_leaves_under_a_large_one():
    """The holder has 800 of 1000 tokens; an idle worker would compute all 1000 (80 ms more). One queued
    request on the holder (+100 ms) sends the turn away without hysteresis; with it, it stays; a queue of
    four (+400 ms) still sends it away."""
    idle = cand("i", cached=0, uncached=1000, ttft=110.0)
    small, large = cand("h", cached=800, uncached=200, ttft=130.0), cand("h", cached=800, uncached=200, ttft=430.0)
    before = RoutingConfig(future_turns=0, stay_margin=0)
    # session 4's terms alone: idle 110 + 80 (recompute) = 190; a holder at 215 ms counts 215 x 0.92 = 198
    small_busier = cand("h", cached=800, uncached=200, ttft=215.0)
    assert first(before, idle, small_busier) == "i"
    assert first(ONE_TURN, idle, small_busier) == "h"  # idle + 80 (one more turn) + 21.5 (10% margin)
    assert first(ONE_TURN, idle, small) == "h"
    assert first(ONE_TURN, idle, large) == "i"
    assert first(RoutingConfig(future_turns=1.0, stay_margin=0.1, stay_margin_ms=1000.0), idle, large) == "h"
    # the defaults (3 turns, 30%) keep it under the large queue too, not under one twice as long
    assert first(RoutingConfig(), idle, large) == "h"
    assert first(RoutingConfig(), idle, cand("h", cached=800, uncached=200, ttft=1000.0)) == "i"


def test_low_overlap_prompts_go_to_the_worker_with_the_most_free_kv():
    full = cand("f", kv_free=0.1, kv_free_tokens=10_000.0)
    roomy = cand("r", kv_free=0.8, kv_free_tokens=80_000.0)
    fleet = Fleet.of([full, roomy], 0.1)
    assert kv_pressure(full) == pytest.approx(0.1) and kv_pressure(roomy) == pytest.approx(1000 / 80_000)
    assert FootprintScorer().ms(roomy, fleet) == 0
    assert FootprintScorer().ms(full, fleet) == pytest.approx(100.0 * (0.1 - 1000 / 80_000))
    p = create_policy(FOOTPRINT, "kv")
    assert {p.order(REQ, [full, roomy])[0].worker for _ in range(4)} == {"r"}  # not in turn
    off = create_policy(RoutingConfig(), "kv")  # off by default (docs/BENCHMARKS.md)
    assert {off.order(REQ, [full, roomy])[0].worker for _ in range(4)} == {"f", "r"}
    # capacity unknown: the share in use
    assert first(FOOTPRINT, cand("a", kv_free=0.2), cand("b", kv_free=0.7)) == "b"


def test_free_kv_does_not_outweigh_a_queue_longer_than_the_prompt():
    """The footprint term is at most the prompt's own prefill time (100 ms): a worker with a queue of 150 ms
    more loses the prompt even with all its KV free."""
    busy_roomy = cand("r", ttft=250.0, kv_free=1.0, kv_free_tokens=1e6)
    idle_full = cand("f", ttft=100.0, kv_free=0.0, kv_free_tokens=0.0)
    assert first(FOOTPRINT, busy_roomy, idle_full) == "f"
    assert first(FOOTPRINT, cand("r", ttft=150.0, kv_free=1.0, kv_free_tokens=1e6), idle_full) == "r"


def test_footprint_is_off_when_a_worker_holds_a_meaningful_share():
    h = cand("h", cached=800, uncached=200, kv_free=0.0, kv_free_tokens=0.0)
    o = cand("o", kv_free=1.0, kv_free_tokens=1e6)
    assert FootprintScorer().ms(h, Fleet.of([h, o], 0.1)) == 0


def test_load_term_counts_requests_beyond_the_least_loaded():
    a, b = cand("a", load=1.0), cand("b", load=4.0)
    assert LoadScorer(10.0).ms(b, Fleet.of([a, b], 0.1)) == 30.0
    assert first(RoutingConfig(load_weight=10.0), cand("a", load=4.0, ttft=100.0),
                 cand("b", load=1.0, ttft=120.0)) == "b"
    assert first(RoutingConfig(), cand("a", load=4.0, ttft=100.0), cand("b", load=1.0, ttft=120.0)) == "a"


def test_going_before_held_prompts_costs_them_this_prompts_prefill_each():
    """Session 35's fleet case: a 74K-token prompt priced 3.1 s on a worker whose gate holds an 89K-token
    one (it would go first, the held one would wait its 2.5 s prefill more) and 3.4 s on an idle worker: it
    goes to the idle one. Without held prompts, or with the weight at 0, the faster prediction wins."""
    busy = cand("busy", uncached=74_000, ttft=3113.0, prefill_ms=2500.0, jumped_requests=1)
    idle = cand("idle", uncached=74_000, ttft=3370.0, prefill_ms=3300.0)
    fleet = Fleet.of([busy, idle], 0.1)
    assert fleet.least_delay == 0.0 and DelayScorer().ms(busy, fleet) == 2500.0 and DelayScorer().ms(idle, fleet) == 0
    assert first(RoutingConfig(), busy, idle) == "idle"
    assert first(RoutingConfig(held_delay_weight=0.0), busy, idle) == "busy"
    two = cand("two", uncached=74_000, ttft=3000.0, prefill_ms=2000.0, jumped_requests=2)
    fleet = Fleet.of([busy, two], 0.1)  # relative to the fleet's least: 2,500 ms vs 4,000 ms
    assert fleet.least_delay == 2500.0 and DelayScorer().ms(two, fleet) == 1500.0
    assert first(RoutingConfig(), busy, two) == "busy"


def test_terms_are_recorded_and_sum_to_the_score():
    cs = [cand("h", cached=800, uncached=200, ttft=130.0), cand("i", ttft=110.0)]
    kv_order(cs, 0, scorers_of(RoutingConfig()))
    for c in cs:
        assert set(c.terms_ms) == {"ttft", "affinity", "recompute", "continuity", "footprint", "load", "delay"}
        assert c.score_ms == pytest.approx(sum(c.terms_ms.values()), abs=1e-2)
    assert cs[0].terms_ms["affinity"] == pytest.approx(-0.1 * 0.8 * 130.0)


def test_missing_or_malformed_metrics_are_neutral_and_said():
    never = WorkerLoad()  # never scraped: a kv_usage of 0 is no evidence of room
    assert kv_room(never, 16) == (None, None)
    for bad in (float("nan"), -0.5, 1.5, float("inf")):
        assert kv_room(WorkerLoad(kv_usage=bad, updated_at=1.0, num_gpu_blocks=100), 16)[0] is None
    ok = kv_room(WorkerLoad(kv_usage=0.25, updated_at=1.0, num_gpu_blocks=101), 16)
    assert ok == (0.75, 1200.0)  # vLLM's usage is over its blocks less the null block
    known, unknown = cand("k", kv_free=0.9, kv_free_tokens=1e5), cand("u")
    kv_order([known, unknown], 0, scorers_of(FOOTPRINT))
    assert unknown.terms_ms["footprint"] == 0 and "footprint" in unknown.score_notes[0]
    assert known.terms_ms["footprint"] == 0 and not known.score_notes


def test_bad_candidate_figures_never_make_a_score_nan_or_infinite():
    nan, inf, stalled = cand("nan", ttft=float("nan")), cand("inf", ttft=float("inf")), cand("z")
    stalled.prefill_tokens_per_s = 0.0
    endless = Candidate(worker="w", prefill_work=float("inf"), prefill_tokens_per_s=0.0, local_blocks=3,
                        cached_tokens=48, uncached_tokens=0, kv_free=0.5, kv_free_tokens=float("nan"))
    bad = [nan, inf, stalled, endless]
    ordered = kv_order(list(bad), 0, scorers_of(RoutingConfig(load_weight=1.0, footprint_weight=1.0)))
    for c in bad:
        assert math.isfinite(c.score_ms) and all(math.isfinite(v) for v in c.terms_ms.values()), c
    # a TTFT that is not a number counts as the worst, never as 0
    assert nan.terms_ms["ttft"] == inf.terms_ms["ttft"] > stalled.terms_ms["ttft"]
    assert "ttft: not a number" in nan.score_notes[0] and "clamped" in inf.score_notes[0]
    assert ordered[0] is stalled and ordered[-1] is not stalled


@pytest.mark.parametrize("field,value", [("future_turns", -1), ("future_turns", float("nan")),
                                         ("stay_margin", float("inf")), ("stay_margin_ms", -5),
                                         ("overlap_share", 1.5), ("footprint_weight", float("nan")),
                                         ("load_weight", -1), ("recompute_weight", float("inf")),
                                         ("stay_margin_idle", -0.1), ("held_delay_weight", -1),
                                         ("held_delay_weight", float("nan"))])
def test_routing_knobs_are_validated(field, value):
    with pytest.raises(pydantic.ValidationError):
        RoutingConfig(**{field: value})
