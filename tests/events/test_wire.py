"""Decoding vLLM's KV-event payloads: the frames are produced with msgspec structs shaped exactly like
vLLM 0.32's (bench/sim/vllm_format.py), plus the older array form."""
from __future__ import annotations

import msgspec
import pytest

from bench.sim import vllm_format as vf
from indexer.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    decode_seq,
)

BIG = 9223372036854775813  # >= 2**63: msgpack uint64


def test_map_form_as_vllm_encodes_it():
    payload = vf.encode_batch(vf.KVEventBatch(ts=1.5, events=[
        vf.BlockStored(block_hashes=[BIG, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                       kv_cache_spec_kind="full_attention"),
        vf.BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0),
        vf.AllBlocksCleared(),
    ], data_parallel_rank=0))
    # the wire shape of vllm-interface.md 1.3
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["lora_name"] is None
    assert "extra_keys" not in raw[1][0]
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    b = decode_batch(payload)
    assert b.ts == 1.5 and b.dp_rank == 0 and b.malformed == 0
    st, rm, cl = b.events
    assert isinstance(st, BlockStored) and st.block_hashes == [BIG, 7] and st.parent_block_hash is None
    assert st.token_ids == [1, 2, 3, 4] and st.block_size == 2 and st.medium == "GPU"
    assert st.kv_cache_spec_kind == "full_attention"
    assert isinstance(rm, BlockRemoved) and rm.block_hashes == [7]
    assert isinstance(cl, AllBlocksCleared)


def test_array_form_of_older_vllm():
    class OldBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list[vf.LegacyBlockStored | vf.LegacyBlockRemoved | vf.LegacyAllBlocksCleared]

    payload = msgspec.msgpack.encode(OldBatch(ts=2.0, events=[
        vf.LegacyBlockStored(block_hashes=[5, 6], parent_block_hash=4, token_ids=[1, 2, 3, 4], block_size=2,
                             lora_id=None, medium="CPU"),
        vf.LegacyBlockRemoved(block_hashes=[5]),
        vf.LegacyAllBlocksCleared(),
    ]))
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"
    b = decode_batch(payload)
    assert b.dp_rank is None
    st, rm, cl = b.events
    assert st.block_hashes == [5, 6] and st.parent_block_hash == 4 and st.medium == "CPU"
    assert rm.block_hashes == [5] and rm.medium is None
    assert isinstance(cl, AllBlocksCleared)


def test_hash_forms_int_uint64_negative_and_bytes():
    digest = bytes(range(32))  # sha256-sized: the last 8 bytes, big endian
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockRemoved", "block_hashes": [1, 2**64 - 1, -1, digest, digest[:16]], "medium": "GPU"}
    ], 0])
    (rm,) = decode_batch(payload).events
    last8 = int.from_bytes(digest[-8:], "big")
    assert rm.block_hashes == [1, 2**64 - 1, 2**64 - 1, last8, int.from_bytes(digest[8:16], "big")]


def test_unknown_keys_and_types_are_ignored():
    payload = msgspec.msgpack.encode({"ts": 3, "events": [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [9, 9],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "new_field": {"x": 1}},
        {"type": "SomethingNew", "a": 1},
        ["FutureArrayEvent", 1, 2],
    ], "data_parallel_rank": 2, "whatever": True})
    b = decode_batch(payload)
    assert b.dp_rank == 2 and b.ignored == 2 and b.malformed == 0
    assert [type(e) for e in b.events] == [BlockStored]


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"not msgpack at all \xff\xff", msgspec.msgpack.encode(42),
    msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode(["x", [], 0]),
    msgspec.msgpack.encode([1.0, "events", 0]),
    b"\x91" * 200_000 + b"\xc0",  # nested past msgspec's depth limit (its RecursionError escaped the count)
])
def test_malformed_payloads_raise(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_malformed_events_are_counted_and_skipped():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockRemoved", "block_hashes": "nope", "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [1.5], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": "abc", "block_size": 2},
        42, [], {"no": "type"},
        {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"},
    ], 0])
    b = decode_batch(payload)
    assert b.malformed == 6
    assert [e.block_hashes for e in b.events] == [[3]]


@pytest.mark.parametrize("group_idx", [-1, 1 << 32])
def test_an_event_whose_group_does_not_fit_32_bits_is_malformed(group_idx):
    """The handle map packs a KV cache group's index in 32 bits: a group outside made every save of the
    worker's map fail (OverflowError) and kept the source from syncing again. Counted and skipped."""
    good = {"type": "BlockStored", "block_hashes": [5], "token_ids": [1, 2], "block_size": 2}
    for bad in ({**good, "block_hashes": [4], "group_idx": group_idx},
                {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU", "group_idx": group_idx}):
        b = decode_batch(msgspec.msgpack.encode([1.0, [bad, good], 0]))
        assert b.malformed == 1 and [e.block_hashes for e in b.events] == [[5]]


def test_seq_frame():
    assert decode_seq((2**64 - 2).to_bytes(8, "big")) == 2**64 - 2
    with pytest.raises(DecodeError):
        decode_seq(b"\x00" * 4)
