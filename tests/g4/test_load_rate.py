"""The load rate ``load_async: auto`` decides with (cache_tier/load_rate.py): pure arithmetic, no vLLM."""
from __future__ import annotations

import math

from cache_tier.load_rate import LoadRate


def test_no_rate_before_a_load_was_measured_and_malformed_reports_change_nothing():
    r = LoadRate()
    assert r.seconds_for(10) is None
    for blocks, seconds in ((0, 1.0), (-3, 1.0), (5, math.nan), (5, math.inf), (5, -1.0), (5, None)):
        r.observe(blocks, seconds)
    assert r.seconds_for(10) is None
    r.observe(10, 0.01)
    assert math.isclose(r.seconds_for(20), 0.02)


def test_the_rate_follows_a_store_that_slows_down():
    """A thousand fast loads, then the store becomes 20x slower: after ten slow steps a 10-block load is
    expected to take most of its new 20 ms, after forty all of it (a running mean since the start would
    still say ~1 ms, and keep such loads in the step)."""
    r = LoadRate()
    for _ in range(1000):
        r.observe(10, 0.001)  # 0.1 ms a block
    assert r.seconds_for(10) < 0.02
    for _ in range(10):
        r.observe(10, 0.02)  # 2 ms a block
    assert r.seconds_for(10) > 0.01
    for _ in range(30):
        r.observe(10, 0.02)
    assert math.isclose(r.seconds_for(10), 0.02, rel_tol=0.05)
