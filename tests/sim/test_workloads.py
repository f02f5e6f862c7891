"""Trace handling: deterministic block tokens, shared prefixes, and the workload ceiling (37.4%)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.replay_workloads import (TraceRow, block_tokens, conversation_ids, load_trace, token_ceiling,
                                    select_rows, trace_ceiling, trace_items, trace_path, chat_items, rag_items,
                                    agent_items)

# sha256 of the published conversation_trace.jsonl (Mooncake FAST25-release); bench/traces/NOTICE
MOONCAKE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_the_trace_in_the_repository_is_the_published_file_byte_for_byte():
    import hashlib
    import lzma

    assert trace_path().is_relative_to(Path(__file__).resolve().parents[2] / "bench")
    assert hashlib.sha256(lzma.decompress(trace_path().read_bytes())).hexdigest() == MOONCAKE_SHA256
    assert MOONCAKE_SHA256 in (trace_path().parent / "NOTICE").read_text()


def test_block_tokens_are_fixed_and_distinct():
    a, b = block_tokens(7), block_tokens(7)
    assert a.dtype == np.uint32 and len(a) == 512 and (a == b).all()
    assert not (block_tokens(8) == a).all()
    assert int(a.max()) < 32000


def test_requests_sharing_hash_ids_share_token_prefixes():
    rows = [TraceRow(0, 1100, 5, [1, 2, 3]), TraceRow(10, 700, 5, [1, 2])]
    items = trace_items(rows)
    assert len(items[0].tokens) == 1100 and len(items[1].tokens) == 700
    assert (items[0].tokens[:700] == items[1].tokens).all()


def test_a_follow_up_turn_carries_its_conversations_id():
    """The trace has no session ids; the replayer sends one per conversation so that the ``session``
    policy is not the ``kv`` policy again on the trace (sessions 35-36 compared kv with itself there)."""
    rows = [TraceRow(0, 1100, 5, [0, 1, 2]),             # turn 1: a shared system block, a partial last block
            TraceRow(1, 900, 5, [0, 7]),                 # another conversation on the same system block
            TraceRow(2, 2100, 5, [0, 1, 3, 4, 5]),       # turn 2 of the first: its full blocks, then more
            TraceRow(3, 3000, 5, [0, 1, 3, 4, 5, 6]),    # turn 3: all of turn 2's blocks
            TraceRow(4, 1600, 5, [0, 7, 8, 9])]          # turn 2 of the second
    ids = conversation_ids(rows)
    assert ids[0] == ids[2] == ids[3] and ids[1] == ids[4] and ids[0] != ids[1]
    assert [it.session for it in trace_items(rows)] == ids
    sliced = trace_items(load_trace(), duration_s=300)
    assert 700 < len({it.session for it in sliced}) < len(sliced)  # continuations in the fleet's slice


def test_ceiling_counts_leading_seen_blocks():
    rows = [TraceRow(0, 1024, 1, [1, 2]), TraceRow(0, 1500, 1, [1, 2, 9]), TraceRow(0, 600, 1, [5, 1])]
    # second: 2 leading blocks seen (1024 tokens); third: first block unseen -> 0
    assert trace_ceiling(rows) == pytest.approx(1024 / (1024 + 1500 + 600))


def test_the_lru_reference_evicts_the_least_recently_used_block_first():
    """The fleet bench's "LRU reference": one cache of the fleet's KV with vLLM's eviction rule."""
    rows = [TraceRow(0, 1024, 1, [1, 2]), TraceRow(0, 512, 1, [3]), TraceRow(0, 1024, 1, [1, 2]),
            TraceRow(0, 512, 1, [3])]
    total = 1024 + 512 + 1024 + 512
    assert trace_ceiling(rows, 3 * 512) == pytest.approx((1024 + 512) / total)  # all three fit
    # two blocks: [3] evicts 2 (a prompt's tail goes first, as vLLM frees it), so [1, 2] finds 1; [3] is
    # gone by then
    assert trace_ceiling(rows, 2 * 512) == pytest.approx(512 / total)
    sliced = select_rows(load_trace(), duration_s=300)  # the fleet bench's slice: 16.3% at 4 workers
    assert trace_ceiling(sliced, 4 * 62_500 * 16) < trace_ceiling(sliced) - 0.03
    assert trace_ceiling(sliced, 16 * 62_500 * 16) == trace_ceiling(sliced)


def test_full_trace_ceiling_is_37_4_percent():
    rows = load_trace()
    assert len(rows) == 12031
    assert round(100 * trace_ceiling(rows), 1) == 37.4


def test_token_ceiling_at_engine_block_size_is_close_to_the_trace_ceiling():
    rows = load_trace()[:300]
    items = trace_items(rows)
    c512, c16 = trace_ceiling(rows), token_ceiling(items, 16)
    # finer blocks also reuse the partial tails of shared 512-token blocks; never less than the trace's
    assert c16 >= c512 - 0.01 and c16 < c512 + 0.1


def test_synthetic_workloads_share_prefixes():
    for items in (chat_items(sessions=4, turns=3), rag_items(users=10), agent_items(agents=3, steps=3)):
        assert items and all(items[i].at <= items[i + 1].at for i in range(len(items) - 1))
        assert token_ceiling(items, 16) > 0.3
