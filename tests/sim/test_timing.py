"""The default timing model reproduces the reference measurement (gpt-oss-120b, one RTX PRO 6000)."""
from __future__ import annotations

import pytest

from bench.sim.timing import DEFAULT_TIMING, calibrate


def test_default_model_is_calibrated_to_the_reference():
    t = DEFAULT_TIMING
    assert t.ttft_cold(130_000) == pytest.approx(32.0, abs=0.01)
    assert t.ttft_cold(130_000) - t.ttft_cold(30_000) == pytest.approx(29.55, abs=0.01)
    assert t.ttft_cached(130_000) - t.ttft_cached(30_000) == pytest.approx(0.377, abs=0.001)
    # the reference's headline: ~32 s cold -> ~0.5 s cached at 130K tokens
    assert 0.3 < t.ttft_cached(130_000) < 0.8


def test_prefill_grows_with_uncached_tokens_and_context():
    t = DEFAULT_TIMING
    assert t.prefill_s(1000, 0) < t.prefill_s(2000, 0)
    # the same new tokens cost more after a longer cached context (attention)
    assert t.prefill_s(1000, 50_000) > t.prefill_s(1000, 0)
    assert t.prefill_s(1000, 0, g4_tokens=0) < t.prefill_s(1000, 0, g4_tokens=10_000)


def test_recalibration_and_time_scale():
    t = calibrate(cold_hi_s=10.0, cold_delta_s=9.0, cached_delta_s=0.1)
    assert t.ttft_cold(130_000) == pytest.approx(10.0, abs=0.01)
    fast = t.with_(time_scale=50)
    assert fast.wall(10.0) == pytest.approx(0.2)
