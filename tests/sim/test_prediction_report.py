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
    assert accuracy([])["first_byte_ms_mean"] is None


def test_gateway_time_per_stage_and_the_table_columns():
    """The gateway's own time (``timings_ms``) averaged per stage; the replay table shows the engines' TTFT,
    the rest of the client's, and of that what kvgate said it added (scaled to workload seconds)."""
    from bench import replay as rp

    a = accuracy([{"timings_ms": {"read": 1.0, "tokenize": 4.0, "first_byte": 10.0}, "gate_wait_ms": 0.0},
                  {"timings_ms": {"read": 3.0, "tokenize": 2.0, "first_byte": 30.0}, "gate_wait_ms": 40.0},
                  {"timings_ms": {"tokenize": 0.0}}])  # an error before the first byte
    assert (a["read_ms_mean"], a["tokenize_ms_mean"], a["first_byte_ms_mean"]) == (2.0, 2.0, 20.0)
    assert a["gate_wait_ms_mean"] == 20.0
    base = {"hit_rate": 0.5, "ceiling": None, "ttft_p50_s": 1.0, "ttft_p90_s": 1.0, "ttft_p99_s": 1.0,
            "e2e_mean_s": 1.0, "throughput_rps": 1.0, "failed": 0, "requests": 2, "time_scale": 5.0}
    kv = {**base, "name": "kv", "ttft_mean_s": 2.0, "engine": {"ttft_mean_s": 1.5}, "prediction": a}
    peer = {**base, "name": "peer", "ttft_mean_s": 1.8, "engine": {"ttft_mean_s": 1.6}}
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in rp.table([kv, peer]).splitlines()[2:]}
    head = [c.strip() for c in rp.table([kv, peer]).splitlines()[0].split("|")[1:-1]]
    col = {h: i for i, h in enumerate(head)}
    assert rows["kv"][col["engine TTFT s"]] == "1.50" and rows["kv"][col["outside engine s"]] == "0.50"
    assert rows["kv"][col["kvgate's own s"]] == "0.10"  # 20 ms of wall time x 5
    assert rows["kv"][col["kvgate's gate s"]] == "0.10" and rows["peer"][col["kvgate's gate s"]] == "-"
    assert rows["peer"][col["outside engine s"]] == "0.20" and rows["peer"][col["kvgate's own s"]] == "-"
