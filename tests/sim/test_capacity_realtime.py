"""bench.capacity_realtime: the capacity-bound workload through the real gateway (``kvgate serve``) against
simulated vLLM servers in real time (no vLLM, no mocks: the simulator is the engine under test here)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capacity_realtime as rt


def test_predictions_are_split_by_the_eviction_model_that_priced_the_chosen_worker():
    def d(model, predicted, delivered, outcome="ok"):
        return {"outcome": outcome, "chosen": "a", "predicted_cached_tokens": predicted,
                "delivered_cached_tokens": delivered, "prompt_tokens": 100,
                "candidates": [{"worker": "b", "eviction_model": "lru"}, {"worker": "a", "eviction_model": model}]}

    ds = [d("occupancy", 64, 64), d("occupancy", 64, 32), d("", 0, 32), d("lru", 32, 64), d("lru", 0, None),
          d("lru", 0, 0, outcome="error")]
    assert rt.by_model(ds) == {"lru": {"under": 1}, "none": {"under": 1},
                               "occupancy": {"exact": 1, "over": 1}}
    rows = [rt.summary(ds, [0.5, None, 1.5]), rt.summary(ds[:1], [1.0])]
    # prompt tokens from cache over the requests whose usage said (192 of 400)
    assert rows[0]["hit_rate"] == pytest.approx(192 / 400) and rows[0]["ttft_mean_s"] == 1.0
    assert rows[0]["no_token"] == 1
    q = rt.pooled(rows)
    assert q["decisions"] == 5 and q["exact"] == pytest.approx(2 / 5)
    assert q["by_model"]["occupancy"] == {"exact": 2, "over": 1}


@pytest.mark.slow
def test_a_short_run_goes_through_the_gateway_to_the_simulated_servers(tmp_path, capsys):
    """Two targets, one round of a small mix: every turn gets a token, later turns find their prefixes
    cached (the simulated servers' own count), and the gateway predicted cached tokens from its index (its
    events and its tokenizer's parity with the servers hold: a cache-blind gateway predicts none)."""
    out = tmp_path / "rt.json"
    assert rt.main(["--rounds", "1", "--targets", "kv;round_robin", "--sessions", "2", "--turns", "2",
                    "--first-tokens", "200", "--turn-tokens", "100", "--agents", "1", "--agent-turns", "2",
                    "--rag-docs", "1", "--rag-users", "1", "--rag-questions", "2", "--doc-tokens", "200",
                    "--stagger", "0.1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["targets"]
    assert set(res) == {"kv", "round_robin"}
    for t, r in res.items():
        (row,) = r["rounds"]
        assert row["requests"] == 8 and row["no_token"] == 0, t
        assert row["hit_rate"] > 0, t
    kv = res["kv"]["rounds"][0]
    assert kv["hit_rate"] > 0.2 and kv["predicted_cached_tokens"] > 0
    assert sum(c.get("exact", 0) for c in kv["by_model"].values()) >= 4 and kv["exact"] >= 0.5
    printed = capsys.readouterr().out
    assert "cached == delivered" in printed
    workdir = json.loads(out.read_text())["workdir"]
    assert workdir in printed
    records = json.loads(next(Path(workdir).glob("round1-target1-kv/decisions.json")).read_text())
    assert len(records["decisions"]) == 8  # kept for a look at the misses
