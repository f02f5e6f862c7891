"""The G4 tests' output comparison (tests/g4/real_vllm.py ``same_greedy_output``) on hand-built answers."""
from __future__ import annotations

from tests.g4.real_vllm import same_greedy_output


def answer(ids, tokens, tops):
    return {"choices": [{"token_ids": ids, "logprobs": {"tokens": tokens, "top_logprobs": tops}}]}


def test_equal_outputs_and_a_flip_at_an_exact_tie_are_the_same_output():
    ref = answer([1, 2, 3], ["a", "b", "c"], [{"a": -1.0}, {"b": -7.9556, "x": -7.9556}, {"c": -0.1}])
    assert same_greedy_output(ref, ref)[0]
    tie = answer([1, 9, 4], ["a", "x", "d"], [{"a": -1.0}, {"x": -7.9556, "b": -7.9556}, {"d": -0.2}])
    ok, why = same_greedy_output(tie, ref)
    assert ok and "token 1" in why


def test_a_flip_past_the_margin_or_to_a_token_the_reference_did_not_rank_is_not():
    ref = answer([1, 2], ["a", "b"], [{"a": -1.0}, {"b": -0.5, "x": -2.0}])
    assert not same_greedy_output(answer([1, 9], ["a", "x"], [{"a": -1.0}, {"x": -0.4}]), ref)[0]
    assert not same_greedy_output(answer([1, 8], ["a", "y"], [{"a": -1.0}, {"y": -0.4}]), ref)[0]
    assert not same_greedy_output(answer([7, 2], ["z", "b"], [{"z": -1.0}, {"b": -0.5}]), ref)[0]
