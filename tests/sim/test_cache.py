"""The simulator's prefix cache follows vLLM's block-pool semantics (see bench/sim/cache.py)."""
from __future__ import annotations

import pytest

from bench.sim.cache import PrefixCache, SharedG4Store
from bench.sim.events import BlockRemoved, BlockStored
from indexer.hashing import sequence_hashes

B = 16


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run(cache: PrefixCache, tokens: list[int], extra: int = 0):
    a = cache.allocate(tokens, len(tokens) + extra)
    return a, cache.take_events()


def test_only_full_blocks_are_hashed_and_announced():
    c = PrefixCache(64, B)
    a, ev = run(c, toks(0, 40))
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    st = ev[0]
    assert len(st.block_hashes) == 2 and st.token_ids == toks(0, 32)
    assert st.parent_block_hash is None and st.block_size == B and st.medium == "GPU"
    assert all(0 <= h < 2**64 for h in st.block_hashes)


def test_engine_hashes_are_opaque_not_kvgates():
    c = PrefixCache(64, B)
    _, ev = run(c, toks(0, 32))
    assert set(ev[0].block_hashes).isdisjoint(sequence_hashes(toks(0, 32), B))


def test_last_prompt_token_is_never_a_hit_and_repeats_store_again():
    c = PrefixCache(64, B)
    a, _ = run(c, toks(0, 32))
    c.free(a)
    a2, ev = run(c, toks(0, 32))
    assert a2.hit_blocks == 1  # 32 tokens = 2 full blocks, but at most (32-1)//16 = 1 can hit
    # vLLM does not de-duplicate: the recomputed block is cached (and announced) a second time
    assert len(ev) == 1 and len(ev[0].block_hashes) == 1
    first = c.digests(toks(0, 32))
    from bench.sim.cache import external
    assert ev[0].block_hashes == [external(first[1])] and ev[0].parent_block_hash == external(first[0])
    a3, _ = run(c, toks(0, 33))
    assert a3.hit_blocks == 2


def test_freed_blocks_stay_cached_until_their_space_is_needed():
    c = PrefixCache(5, B)  # 4 blocks and vLLM's null block
    a, _ = run(c, toks(0, 32))
    c.free(a)
    assert c.num_free == 4
    b, ev = run(c, toks(0, 33), extra=15)
    assert b.hit_blocks == 2 and ev == []


def test_lru_eviction_one_removal_per_block_before_the_store():
    c = PrefixCache(5, B)  # 4 blocks and vLLM's null block
    a, ev_a = run(c, toks(0, 32))
    c.free(a)
    b, ev_b = run(c, toks(1000, 32))
    c.free(b)
    # C needs 2 blocks: the least recently used are A's, tail first.
    _, ev = run(c, toks(2000, 32))
    kinds = [type(e).__name__ for e in ev]
    assert kinds == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    removed = [e.block_hashes for e in ev if isinstance(e, BlockRemoved)]
    assert removed == [[ev_a[0].block_hashes[1]], [ev_a[0].block_hashes[0]]]
    assert c.longest_hit(c.digests(toks(1000, 33)), 33) == 2  # B survived
    assert c.longest_hit(c.digests(toks(0, 33)), 33) == 0


def test_a_hit_refreshes_recency():
    c = PrefixCache(5, B)  # 4 blocks and vLLM's null block
    a, _ = run(c, toks(0, 32)); c.free(a)
    b, ev_b = run(c, toks(1000, 32)); c.free(b)
    a2, _ = run(c, toks(0, 17)); c.free(a2)  # touches A's first block (and reuses one free block)
    _, ev = run(c, toks(2000, 32))
    removed = {e.block_hashes[0] for e in ev if isinstance(e, BlockRemoved)}
    assert ev_b[0].block_hashes[1] in removed
    assert c.longest_hit(c.digests(toks(0, 17)), 17) == 1


def test_no_room_while_blocks_are_held():
    c = PrefixCache(5, B)  # 4 blocks and vLLM's null block
    a, _ = run(c, toks(0, 48))
    assert c.allocate(toks(500, 32), 32) is None
    c.free(a)
    assert c.allocate(toks(500, 32), 32) is not None


def test_decode_blocks_continue_the_chain():
    c = PrefixCache(16, B)
    tokens = toks(0, 20)
    a = c.allocate(tokens, 60)
    c.take_events()
    all_tokens = tokens + toks(5000, 30)
    c.cache_full_blocks(a, all_tokens, 3)
    (st,) = c.take_events()
    from bench.sim.cache import external
    assert st.parent_block_hash == external(a.digests[0]) and st.token_ids == all_tokens[16:48]
    # the chain goes on as if the whole sequence had been the prompt
    assert a.digests == c.digests(all_tokens) and st.block_hashes == [external(d) for d in a.digests[1:3]]


def test_cache_salt_changes_every_block_hash():
    c = PrefixCache(16, B)
    plain = c.digests(toks(0, 48))
    salted = c.digests(toks(0, 48), cache_salt="tenant-a")
    assert all(p != s for p, s in zip(plain, salted))


def test_shared_g4_extends_a_local_miss_and_is_announced_once():
    g4 = SharedG4Store()
    w1, w2 = PrefixCache(64, B, g4=g4), PrefixCache(64, B, g4=g4)
    a = w1.allocate(toks(0, 50), 50)
    w1.take_events()
    w1.write_g4(a, toks(0, 50))
    (st,) = w1.take_events()
    assert st.medium == "STORAGE" and len(st.block_hashes) == 3
    w1.write_g4(a, toks(0, 50))
    assert w1.take_events() == []
    b = w2.allocate(toks(0, 50), 50)
    assert b.hit_blocks == 0 and b.g4_blocks == 3
    assert w2.external_hits == 48


def test_block_zero_is_vllms_null_block():
    """vLLM's block pool sets one block aside: num_gpu_blocks counts it, the usage does not."""
    c = PrefixCache(5, B)
    assert c.num_free == 4 and c.usage() == 0.0
    a, _ = run(c, toks(0, 32))
    assert 0 not in a.blocks and c.usage() == 0.5
    with pytest.raises(ValueError):
        c.allocate(toks(0, 80), 80)  # 5 blocks: more than the pool holds


def test_reset_clears_everything_when_idle():
    c = PrefixCache(8, B)
    a, _ = run(c, toks(0, 32))
    assert c.reset() is False
    c.free(a)
    assert c.reset() is True
    assert type(c.take_events()[-1]).__name__ == "AllBlocksCleared"
    assert c.longest_hit(c.digests(toks(0, 33)), 33) == 0


def test_cache_salt_is_announced_in_block_zeros_extra_keys():
    c = PrefixCache(16, B)
    c.allocate(toks(0, 40), 40, cache_salt="tenant-a")
    (st,) = c.take_events()
    assert st.extra_keys == [("tenant-a",), None]


def test_a_freed_partial_block_is_reused_before_any_cached_block_is_evicted():
    # vLLM's BlockPool.free_blocks: a freed block without a hash goes to the front of the free queue
    # (reused first), a hashed one to its end (LRU). A and B each hold 2 full blocks and a partial one; C
    # needs 3 blocks: the two partial blocks, then one cached block (A's tail), not three of A's.
    c = PrefixCache(7, B)  # 6 blocks and vLLM's null block
    a, ev_a = run(c, toks(0, 40))
    b, ev_b = run(c, toks(1000, 40))
    c.free(a)
    c.free(b)
    _, ev = run(c, toks(2000, 48))
    removed = [e.block_hashes for e in ev if isinstance(e, BlockRemoved)]
    assert removed == [[ev_a[0].block_hashes[1]]]
    assert c.longest_hit(c.digests(toks(0, 33)), 33) == 1
    assert c.longest_hit(c.digests(toks(1000, 33)), 33) == 2


def test_a_chunk_caches_the_blocks_it_fills_and_the_next_chunk_the_one_it_completes():
    # vLLM's KVCacheManager.allocate_slots caches min(computed + new tokens, num_tokens) tokens' full blocks:
    # a first chunk of 100 tokens holds 7 blocks but fills 6; the 12 tokens of the next chunk complete the
    # 7th, which it caches without needing a new block
    c = PrefixCache(64, B)
    tokens = toks(0, 112)
    a = c.allocate(tokens, 112, hold_tokens=100)
    (st,) = c.take_events()
    assert len(a.blocks) == 7 and st.block_hashes == a.hashes[:6] and st.token_ids == toks(0, 96)
    assert c.grow(a, tokens, 112)
    (st,) = c.take_events()
    assert len(a.blocks) == 7 and st.block_hashes == [a.hashes[6]] and st.parent_block_hash == a.hashes[5]
