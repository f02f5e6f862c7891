"""The kv policy's hysteresis and low-overlap placement through the gateway, on fake vLLM workers whose
/metrics report the queue and KV usage the test sets (default prefill speed and step figures)."""
from __future__ import annotations

import httpx
import pytest

from indexer.hashing import sequence_hashes
from indexer.index.base import Tier
from tests.gateway.conftest import BLOCK, MODEL
from tests.gateway.test_proxy import wait_until as until


def ids(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 10 for i in range(blocks * BLOCK + 1)]


async def send(gw, prompt: list[int], rid: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gw.url + "/v1/completions", headers={"x-request-id": rid},
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.headers["x-kvgate-worker"]


def scraped(gw, name: str, **load) -> bool:
    w = gw.state.registry.get(name)
    return w is not None and w.healthy and all(getattr(w.load, k) == v for k, v in load.items())


@pytest.mark.parametrize("waiting,routing,expected", [
    (3, {}, "h"),  # a small transient queue on the holder: the turn stays (hysteresis)
    (3, {"future_turns": 0.0, "stay_margin": 0.0}, "i"),  # the same queue without it: the turn leaves
    (10, {}, "i"),  # a large queue: it leaves
])
async def test_a_conversation_leaves_its_holder_only_by_a_clear_margin(fleet, start_gateway, waiting, routing,
                                                                       expected):
    """h holds 60 of the prompt's 64 blocks and vLLM reports ``waiting`` requests queued there (about
    100 ms of prefill each); i is idle and would compute the whole prompt (about 100 ms)."""
    fleet.add("h", waiting=waiting)
    fleet.add("i")
    gw = start_gateway(fleet, routing={"pending_ttl_s": 0, "parity_check": False, **routing})
    await until(lambda: scraped(gw, "h", waiting=waiting) and scraped(gw, "i"))
    prompt = ids(1, 64)
    gw.call(gw.state.index.store(MODEL, "h", Tier.GPU, sequence_hashes(prompt, BLOCK)[:60]))
    assert await send(gw, prompt, "turn") == expected
    d = gw.state.decisions.get("turn")
    h, i = d.candidate("h"), d.candidate("i")
    assert h.predicted_ttft_ms > i.predicted_ttft_ms  # per request, the idle worker is faster every time
    assert h.terms_ms["continuity"] == 0
    assert (i.terms_ms["continuity"] > 0) == (routing == {})


@pytest.mark.parametrize("roomy_waiting,footprint_weight,expected", [
    (0, 1.0, "roomy"),  # two unrelated prompts go where they evict the least recently used cache
    (0, 0.0, "full"),  # priced on TTFT alone: the worker without decodes is a little faster
    (3, 1.0, "full"),  # free KV does not outweigh a queue longer than the prompt's own prefill
])
async def test_unrelated_prompts_go_to_the_worker_with_more_free_kv(fleet, start_gateway, roomy_waiting,
                                                                    footprint_weight, expected):
    """full: 90% of its KV in use, idle. roomy: 20% in use, 20 short requests decoding (each step 10 ms
    slower)."""
    fleet.add("full", kv_usage=0.9)
    fleet.add("roomy", kv_usage=0.2, running=20, waiting=roomy_waiting)
    gw = start_gateway(fleet, routing={"pending_ttl_s": 0, "parity_check": False,
                                       "footprint_weight": footprint_weight})
    await until(lambda: scraped(gw, "full", kv_usage=0.9) and scraped(gw, "roomy", kv_usage=0.2,
                                                                       waiting=roomy_waiting))
    got = [await send(gw, ids(seed, 64), f"new-{seed}") for seed in (2, 3)]
    assert got == [expected, expected]
    d = gw.state.decisions.get("new-2")
    full, roomy = d.candidate("full"), d.candidate("roomy")
    assert full.predicted_ttft_ms < roomy.predicted_ttft_ms
    assert full.kv_free == pytest.approx(0.1) and roomy.kv_free == pytest.approx(0.8)
    assert (full.terms_ms["footprint"] > 0) == (footprint_weight > 0) and roomy.terms_ms["footprint"] == 0


async def test_a_worker_with_malformed_kv_usage_is_scored_neutral_noted_and_counted(fleet, start_gateway):
    """A usage outside [0, 1] (a broken exporter) must not steer the footprint term: the request is
    routed, the candidate says why its term is neutral, and /metrics counts the fallback per worker."""
    fleet.add("bad", kv_usage=1.7)
    fleet.add("ok", kv_usage=0.2)
    gw = start_gateway(fleet, routing={"pending_ttl_s": 0, "parity_check": False, "footprint_weight": 1.0})
    await until(lambda: scraped(gw, "bad", kv_usage=1.7) and scraped(gw, "ok", kv_usage=0.2))
    for seed in (4, 5):
        await send(gw, ids(seed, 64), f"bad-{seed}")
    d = gw.state.decisions.get("bad-4")
    bad, ok = d.candidate("bad"), d.candidate("ok")
    assert bad.kv_free is None and bad.terms_ms["footprint"] == 0 and bad.score_notes
    assert ok.kv_free == pytest.approx(0.8) and not ok.score_notes
    async with httpx.AsyncClient(timeout=10) as c:
        m = (await c.get(gw.url + "/metrics")).text
    assert 'kvgate_scoring_fallbacks_total{worker="bad"} 2.0' in m
    assert 'kvgate_scoring_fallbacks_total{worker="ok"}' not in m
