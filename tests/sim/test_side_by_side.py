"""bench.side_by_side's ``--rounds``: each kvgate target against sglang-router round by round (no servers)."""
from __future__ import annotations

from bench.side_by_side import PEER, vs_peer


def run(hit: float, ttft: float) -> dict:
    return {"hit_rate": hit, "ttft_mean_s": ttft}


def test_ratios_are_taken_within_a_round_and_reported_as_their_median():
    """The host ran the second round 20% slower for everyone: within a round kv is 0.9x, 0.9x and 1.2x the
    peer's mean TTFT, so its median is 0.9x, though across rounds its slow round's figure (2.4 s) is above
    every peer figure but one. A target missing from a round (it failed) is left out of that round."""
    rounds = [
        {"kv": run(0.206, 1.80), PEER: run(0.203, 2.00), "kv, variant": run(0.200, 1.90)},
        {"kv": run(0.205, 2.16), PEER: run(0.204, 2.40)},
        {"kv": run(0.203, 2.40), PEER: run(0.205, 2.00), "kv, variant": run(0.199, 2.10)},
    ]
    lines = vs_peer(rounds)
    assert len(lines) == 2
    kv, variant = lines
    assert kv.startswith(f"kv vs {PEER} over 3 rounds: mean TTFT 0.90x (0.90-1.20x, a 75% interval")
    assert "hit rate +0.1 points (-0.2 to +0.3)" in kv and "faster in 2, ahead on both in 2" in kv
    assert variant.startswith(f"kv, variant vs {PEER} over 2 rounds: mean TTFT 1.00x")
    assert "faster in 1, ahead on both in 0" in variant


def test_no_peer_no_lines():
    assert vs_peer([{"kv": run(0.2, 1.0)}]) == []
    assert vs_peer([]) == []


def test_kvgate_targets_sent_token_ids_say_so_and_keep_their_settings():
    """With ``--token-ids`` every kvgate row was named as if it took text (its tokenize stage not in it):
    the report now says so, and a variant keeps its routing settings under the new name."""
    from bench.side_by_side import BEFORE, ROUTING, RR, ids_name, targets

    names = [t.name for t in targets(False, True, None, before=True)]
    assert "kvgate kv (memory, token ids)" in names and "kvgate kv (redis, token ids)" in names
    assert ids_name(RR) == "kvgate round_robin (token ids)" in names
    assert "sglang-router cache_aware" in names  # peers always get text
    assert ROUTING[ids_name(BEFORE)] == ROUTING[BEFORE]
    assert "kvgate kv (memory)" in [t.name for t in targets(True, False, None)]
