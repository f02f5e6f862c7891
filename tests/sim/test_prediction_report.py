"""The benchmarks' accuracy report (bench/prediction.py) from decision records as /admin/decisions gives them."""
from __future__ import annotations

import pytest

from bench.prediction import accuracy


def test_accuracy_of_decision_records():
    decisions = [
        {"observed_ttft_ms": 100.0, "predicted_ttft_ms": 100.0, "outcome": "ok",
         "predicted_cached_tokens": 32, "delivered_cached_tokens": 32},
        {"observed_ttft_ms": 300.0, "predicted_ttft_ms": 100.0, "outcome": "ok",
         "predicted_cached_tokens": 64, "delivered_cached_tokens": 16},  # evicted meanwhile: over-predicted
        {"observed_ttft_ms": None, "predicted_ttft_ms": 50.0, "outcome": "ok",  # not streamed
         "predicted_cached_tokens": 0, "delivered_cached_tokens": 0},
        {"observed_ttft_ms": 10.0, "predicted_ttft_ms": 20.0, "outcome": "failed",
         "predicted_cached_tokens": 16, "delivered_cached_tokens": None},
    ]
    a = accuracy(decisions)
    assert a["ttft_ratio_samples"] == 3 and a["ttft_ratio_p50"] == pytest.approx(1.0)
    assert a["ttft_ratio_p90"] == pytest.approx(2.6)  # numpy's linear interpolation of 0.5, 1, 3
    assert a["cached_samples"] == 3 and a["cached_exact_share"] == pytest.approx(2 / 3)
    assert a["cached_over_share"] == pytest.approx(1 / 3)
    assert accuracy([])["ttft_ratio_p50"] is None
