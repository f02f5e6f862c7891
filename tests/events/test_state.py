"""Engine hash -> kvgate hash mapping, reference counting and the seed rule (pure logic, no sockets)."""
from __future__ import annotations

from indexer.events.state import WorkerState, cache_salt_of
from indexer.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from indexer.hashing import sequence_hashes
from indexer.index.base import Tier

B = 4
TOK = list(range(100, 100 + 6 * B))  # 6 blocks
SEQ = sequence_hashes(TOK, B)


def stored(hashes, tokens, parent=None, medium="GPU", **kw):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=B,
                       medium=medium, **kw)


def items(ops):
    return [(op, t.value if t else None, h) for op, t, h in ops.items]


def test_stored_maps_to_sequence_hashes_across_events():
    s = WorkerState(block_size=B)
    ops = s.apply([stored([11, 12], TOK[: 2 * B])])
    assert items(ops) == [("store", "GPU", SEQ[:2])]
    # a later event continues the chain from its parent's engine hash
    ops = s.apply([stored([13, 14, 15], TOK[2 * B: 5 * B], parent=12)])
    assert items(ops) == [("store", "GPU", SEQ[2:5])]


def test_duplicate_stores_then_one_removal_keeps_the_block():
    s = WorkerState(block_size=B)
    s.apply([stored([11], TOK[:B])])
    assert s.apply([stored([11], TOK[:B])]).items == []  # second copy: no index write
    assert s.apply([BlockRemoved(block_hashes=[11], medium="GPU")]).items == []  # one copy left
    ops = s.apply([BlockRemoved(block_hashes=[11], medium="GPU")])
    assert items(ops) == [("remove", "GPU", SEQ[:1])]
    assert len(s) == 0
    # removing an unknown or already removed handle is harmless
    assert s.apply([BlockRemoved(block_hashes=[11, 99], medium="GPU")]).items == []


def test_refcount_is_per_tier():
    s = WorkerState(block_size=B)
    s.apply([stored([11], TOK[:B]), stored([11], TOK[:B], medium="CPU")])
    ops = s.apply([BlockRemoved(block_hashes=[11], medium="GPU")])
    assert items(ops) == [("remove", "GPU", SEQ[:1])]
    ops = s.apply([BlockRemoved(block_hashes=[11], medium="CPU")])
    assert items(ops) == [("remove", "CPU", SEQ[:1])]


def test_store_and_remove_in_one_batch_cancel_out():
    s = WorkerState(block_size=B)
    ops = s.apply([stored([11, 12], TOK[: 2 * B]), BlockRemoved(block_hashes=[12], medium="GPU")])
    assert items(ops) == [("store", "GPU", SEQ[:1])]


def test_all_blocks_cleared_clears_in_order():
    s = WorkerState(block_size=B)
    ops = s.apply([stored([11], TOK[:B]), AllBlocksCleared(), stored([21], TOK[:B])])
    assert items(ops) == [("store", "GPU", SEQ[:1]), ("clear", None, None), ("store", "GPU", SEQ[:1])]


def test_unknown_parent_is_counted_and_skipped():
    s = WorkerState(block_size=B)
    assert s.apply([stored([13], TOK[2 * B: 3 * B], parent=12)]).items == []
    assert s.counters["unknown_parent"] == 1


def test_block_size_mismatch_is_dropped():
    s = WorkerState(block_size=B)
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=TOK[:8], block_size=8, medium="GPU")
    short = stored([1, 2], TOK[:B])  # 2 hashes, 1 block of tokens
    assert s.apply([ev, short]).items == []
    assert s.counters["size_mismatch"] == 2
    # an unconfigured state learns the size from the first event
    s2 = WorkerState()
    assert items(s2.apply([ev])) == [("store", "GPU", sequence_hashes(TOK[:8], 8))]


def test_lora_and_cache_salt_identity():
    """Hashes rebuilt from events equal what the router computes from the same tokens."""
    s = WorkerState(block_size=B)
    extra = [["adapterA", "tenant-7"], ["adapterA"]]
    ops = s.apply([stored([1, 2], TOK[: 2 * B], lora_name="adapterA", extra_keys=extra)])
    expect = sequence_hashes(TOK, B, lora_name="adapterA", cache_salt="tenant-7")
    assert items(ops) == [("store", "GPU", expect[:2])]
    assert expect[:2] != SEQ[:2]
    # continuation: the salt is not re-applied, the LoRA seed is
    ops = s.apply([stored([3], TOK[2 * B: 3 * B], parent=2, lora_name="adapterA", extra_keys=[["adapterA"]])])
    assert items(ops) == [("store", "GPU", expect[2:3])]
    # cache_salt alone, with an mm pair in the keys
    s2 = WorkerState(block_size=B)
    ops = s2.apply([stored([1], TOK[:B], extra_keys=[[["mmhash", 0], "salty"]])])
    assert items(ops) == [("store", "GPU", sequence_hashes(TOK, B, cache_salt="salty")[:1])]


def test_cache_salt_of():
    assert cache_salt_of(None, None) is None
    assert cache_salt_of([None], None) is None
    assert cache_salt_of([["lora", "salt"]], "lora") == "salt"
    assert cache_salt_of([["lora"]], "lora") is None
    assert cache_salt_of([["same", "same"]], "same") == "same"
    assert cache_salt_of([[b"embeds", "s"]], None) == "s"


def test_placeholders_map_through_known_handles():
    s = WorkerState(block_size=B)
    s.apply([stored([11, 12], TOK[: 2 * B])])
    ph = BlockStored(block_hashes=[12, 77], parent_block_hash=None, token_ids=[], block_size=0, medium="CPU")
    ops = s.apply([ph])
    assert items(ops) == [("store", "CPU", SEQ[1:2])]
    assert s.counters["unmapped"] == 1


def test_storage_goes_to_g4_and_is_never_removed():
    s = WorkerState(block_size=B)
    ops = s.apply([stored([11, 12], TOK[: 2 * B], medium="STORAGE")])
    assert items(ops) == [("g4", None, SEQ[:2])]
    assert s.apply([BlockRemoved(block_hashes=[11], medium="STORAGE")]).items == []
    # a STORAGE block can be the parent of a later chain, even after a reset of the local tiers
    s.reset()
    ops = s.apply([stored([13], TOK[2 * B: 3 * B], parent=12)])
    assert items(ops) == [("store", "GPU", SEQ[2:3])]


def test_other_groups_and_kinds_are_skipped():
    s = WorkerState(block_size=B)
    ev = stored([11], TOK[:B], kv_cache_spec_kind="sliding_window")
    assert s.apply([ev]).items == []
    assert s.counters["skipped"] == 1
    ev = stored([11], TOK[:B], medium="SOMEWHERE")
    assert s.apply([ev]).items == []
    # groups are separate handle spaces
    s.apply([stored([11], TOK[:B], group_idx=1)])
    assert s.apply([stored([12], TOK[B: 2 * B], parent=11, group_idx=0)]).items == []
    assert s.counters["unknown_parent"] == 1


def test_bad_token_ids_are_malformed_not_fatal():
    s = WorkerState(block_size=2)
    ev = BlockStored(
        block_hashes=[1], parent_block_hash=None, token_ids=["a", None], block_size=2, medium="GPU"
    )
    assert s.apply([ev]).items == []
    assert s.counters["malformed"] == 1


def test_lora_and_salt_identity_through_the_wire():
    """vLLM-shaped BlockStored (extra_keys per block) -> msgpack -> decode -> state == router's hashes."""
    from bench.sim import vllm_format as vf
    from indexer.events.wire import decode_batch

    tok = list(range(7, 7 + 3 * B))
    ev = vf.stored([1, 2, 3], tok, B, None, lora_name="adapterA", lora_id=1, cache_salt="t1")
    assert ev.extra_keys == [("adapterA", "t1"), ("adapterA",), ("adapterA",)]
    batch = decode_batch(vf.encode_batch(vf.KVEventBatch(ts=0.0, events=[ev], data_parallel_rank=0)))
    ops = WorkerState(block_size=B).apply(batch.events)
    assert items(ops) == [("store", "GPU", sequence_hashes(tok, B, lora_name="adapterA", cache_salt="t1"))]


def test_medium_spellings_map_to_one_tier_each():
    """vLLM's media in any case: missing/GPU -> GPU, CPU/CPU_TIER -> CPU, STORAGE -> G4, others not indexed."""
    for i, (medium, want) in enumerate([(None, "GPU"), ("gpu", "GPU"), ("cpu", "CPU"), ("cpu_tier", "CPU"),
                                        ("CPU_TIER", "CPU")]):
        s = WorkerState(block_size=B)
        assert items(s.apply([stored([11 + i], TOK[:B], medium=medium)])) == [("store", want, SEQ[:1])], medium
        ops = s.apply([BlockRemoved(block_hashes=[11 + i], medium=medium)])
        assert items(ops) == [("remove", want, SEQ[:1])], medium
    s = WorkerState(block_size=B)
    assert items(s.apply([stored([11], TOK[:B], medium="storage")])) == [("g4", None, SEQ[:1])]
    assert s.apply([stored([12], TOK[:B], medium="nvme")]).items == [] and s.counters["skipped"] == 1


def test_storage_handles_are_bounded_least_recently_used_first():
    """G4 handles outlive resets so later chains can start from them; only ``storage_handles`` are kept."""
    s = WorkerState(block_size=B, storage_handles=2)
    s.apply([stored([11], TOK[:B], medium="STORAGE"), stored([12], TOK[B:2 * B], parent=11, medium="STORAGE")])
    s.apply([stored([13], TOK[2 * B:3 * B], parent=11, medium="STORAGE")])  # 11 used again: 12 is the oldest
    s.reset()
    assert items(s.apply([stored([21], TOK[B:2 * B], parent=11)])) == [("store", "GPU", SEQ[1:2])]
    assert s.apply([stored([22], TOK[2 * B:3 * B], parent=12)]).items == []  # 12 was forgotten
    assert s.counters["unknown_parent"] == 1


def test_an_evicted_storage_handle_of_a_removing_tier_takes_its_entry_with_it():
    """Past the bound a handle is forgotten, so a later BlockRemoved for it names nothing: its entry stayed
    for good (a phantom G4 hit). Evicting it now removes the entry (a lost hit). A tier without a locality
    never removes: its evicted handles leave the entries alone (above)."""
    s = WorkerState(block_size=B, storage_handles=2)
    loc = dict(medium="STORAGE", locality="LOCAL")
    ops = s.apply([stored([11, 12], TOK[: 2 * B], **loc), stored([13], TOK[2 * B: 3 * B], parent=12, **loc)])
    assert ops.items == [("g4", "LOCAL", SEQ[:3]), ("g4_remove", "LOCAL", SEQ[:1])]  # 11 was the oldest
    assert s.counters["storage_evicted"] == 1
    assert s.apply([BlockRemoved(block_hashes=[11], **loc)]).items == []
    # a REMOTE handle evicted within one event (more blocks than the bound): stored, then removed
    ops = s.apply([stored([21, 22, 23], TOK[: 3 * B], medium="STORAGE", locality="REMOTE")])
    assert ops.items == [("g4", None, SEQ[:3]), ("g4_remove", "LOCAL", SEQ[1:3]), ("g4_remove", None, SEQ[:1])]
    assert s.apply([BlockRemoved(block_hashes=[22], medium="STORAGE", locality="REMOTE"),
                    BlockRemoved(block_hashes=[23], medium="STORAGE", locality="REMOTE")]).items == [
        ("g4_remove", None, SEQ[1:2]), ("g4_remove", None, SEQ[2:3])]


# -- STORAGE blocks of vLLM's offloading tiers (locality LOCAL / REMOTE, docs/g4.md) ---------------------

def test_storage_scope_follows_locality_and_bad_input_is_counted():
    s = WorkerState(block_size=B)
    s.apply([stored([11, 12], TOK[: 2 * B])])
    ops = s.apply([stored([11], TOK[:B], medium="STORAGE", locality="REMOTE"),
                   stored([12], TOK[B: 2 * B], parent=11, medium="STORAGE", locality="local"),
                   stored([11], TOK[:B], medium="STORAGE", locality="NEARBY"),
                   stored([11], TOK[:B], medium="TAPE")])
    assert ops.items == [("g4", None, SEQ[:1]), ("g4", "LOCAL", SEQ[1:2])]
    assert s.counters["bad_locality"] == 1 and s.counters["skipped"] == 1
    ops = s.apply([BlockRemoved(block_hashes=[11], medium="STORAGE", locality="SIDEWAYS"),
                   BlockRemoved(block_hashes=[11], medium="TAPE")])
    assert ops.items == [] and s.counters["bad_locality"] == 2 and s.counters["skipped"] == 2


def test_storage_prefers_known_handles_which_keep_the_cache_salt():
    """vLLM's offload events carry no extra keys: block 0 of a salted request recomputed from its tokens
    would get the unsalted key; the handle the GPU event left has the salted one."""
    salted = sequence_hashes(TOK[: 3 * B], B, cache_salt="s1")
    s2 = WorkerState(block_size=B)
    s2.apply([stored([11, 12], TOK[: 2 * B], extra_keys=[["s1"], None])])
    ops = s2.apply([stored([11, 12], TOK[: 2 * B], medium="STORAGE", locality="REMOTE"),
                    stored([13], TOK[2 * B: 3 * B], parent=12, medium="STORAGE", locality="REMOTE")])
    assert ops.items == [("g4", None, salted)]
    assert salted[:2] != SEQ[:2]
    # the handles outlive the GPU copies: a later STORAGE event still chains from them
    s2.apply([BlockRemoved(block_hashes=[11, 12], medium="GPU")])
    assert s2.apply([stored([12], TOK[B: 2 * B], parent=11, medium="STORAGE", locality="REMOTE")]).items == [
        ("g4", None, salted[1:2])]
    # without a handle the chain is computed from the tokens (an unsalted request: the same keys)
    s3 = WorkerState(block_size=B)
    assert s3.apply([stored([21, 22], TOK[: 2 * B], medium="STORAGE", locality="REMOTE")]).items == [
        ("g4", None, SEQ[:2])]


def test_a_cpu_offload_of_a_salted_prompt_keeps_its_salt_after_the_gpu_copy_went():
    """The CPU offload tier too: vLLM's offload event carries no extra keys, so block 0 recomputed from the
    tokens got the unsalted key (and the chain after it another tenant's): unsalted prompts were shown CPU
    hits vLLM never serves them, the salted owner none (found by a review). The GPU handles go first."""
    salted = sequence_hashes(TOK[: 3 * B], B, cache_salt="s1")
    st = WorkerState(block_size=B)
    st.apply([stored([11, 12, 13], TOK[: 3 * B], extra_keys=[["s1"], None, None])])
    st.apply([BlockRemoved(block_hashes=[11, 12, 13], medium="GPU")])  # evicted, then offloaded
    ops = st.apply([stored([11, 12, 13], TOK[: 3 * B], medium="CPU")])
    assert ops.items == [("store", Tier.CPU, salted)]
    assert sorted(st.held(Tier.CPU)) == sorted(salted)


def test_offload_tier_removals_are_refcounted_per_scope():
    """An offload tier re-announces a shared hash once per chunk; the block leaves that tier's entry only
    when its last announcement is removed. A STORAGE removal without a locality (not an offload tier's)
    and kvgate's GC removal keep their old meaning."""
    s = WorkerState(block_size=B)
    loc = dict(medium="STORAGE", locality="LOCAL")
    s.apply([stored([11], TOK[:B], **loc), stored([11], TOK[:B], **loc)])
    assert s.apply([BlockRemoved(block_hashes=[11], **loc)]).items == []
    assert s.apply([BlockRemoved(block_hashes=[11], **loc)]).items == [("g4_remove", "LOCAL", SEQ[:1])]
    assert s.apply([BlockRemoved(block_hashes=[11], **loc)]).items == []
    s.apply([stored([11], TOK[:B], medium="STORAGE")])
    assert s.apply([BlockRemoved(block_hashes=[11], medium="STORAGE")]).items == []


def test_storage_after_the_gpu_copy_went_still_chains():
    """The fs tier behind the CPU tier may finish a store after the engine evicted the block: the parent
    of the chunk's event is resolved from the handles that went (bounded), not counted unknown."""
    s = WorkerState(block_size=B)
    s.apply([stored([11, 12], TOK[: 2 * B])])
    s.apply([BlockRemoved(block_hashes=[11], medium="GPU"), BlockRemoved(block_hashes=[12], medium="GPU")])
    ops = s.apply([stored([13, 14], TOK[2 * B: 4 * B], parent=12, medium="STORAGE", locality="REMOTE")])
    assert ops.items == [("g4", None, SEQ[2:4])] and s.counters["unknown_parent"] == 0
    s.reset()  # a restarted engine: what went before is forgotten
    s.apply([stored([15], TOK[4 * B: 5 * B], parent=12, medium="STORAGE", locality="REMOTE")])
    assert s.counters["unknown_parent"] == 1
