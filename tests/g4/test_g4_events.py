"""The connector's G4 events through kvgate's ingestion state and the in-memory index: STORAGE blocks
become model-wide G4 entries; the store GC's BlockRemoved (ownership "kvgate-g4", kvgate hashes) removes
them; other STORAGE removals are ignored (G4 is not a worker's tier)."""

from __future__ import annotations

from indexer.events.state import G4_OWNERSHIP, WorkerState
from indexer.events.wire import BlockRemoved, BlockStored
from indexer.hashing import sequence_hashes

B = 4
TOK = list(range(500, 500 + 4 * B))
SEQ = sequence_hashes(TOK, B)


def test_storage_stored_then_gc_removed():
    s = WorkerState(block_size=B)
    gpu = BlockStored(
        block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=TOK, block_size=B, medium="GPU"
    )
    g4 = BlockStored(
        block_hashes=[3, 4], parent_block_hash=2, token_ids=TOK[2 * B :], block_size=B, medium="STORAGE"
    )
    ops = s.apply([gpu, g4])
    assert ("g4", None, SEQ[2:]) in ops.items
    gc = BlockRemoved(block_hashes=[SEQ[2]], medium="STORAGE", ownership=G4_OWNERSHIP)
    assert s.apply([gc]).items == [("g4_remove", None, [SEQ[2]])]
    # a STORAGE removal without kvgate's marker carries engine handles: ignored
    assert s.apply([BlockRemoved(block_hashes=[3], medium="STORAGE")]).items == []


def test_gc_removal_decoded_from_the_wire_as_the_connector_sends_it():
    import msgspec

    from indexer.events.wire import decode_batch

    # the connector's event, as vLLM's msgspec structs encode it: a tagged map with "ownership"
    ev = {
        "type": "BlockRemoved",
        "block_hashes": [SEQ[0], 2**64 - 5],
        "medium": "STORAGE",
        "ownership": G4_OWNERSHIP,
    }
    for events in ([ev], [ev, {"type": "BlockRemoved", "block_hashes": [b"\x00" * 8], "medium": "GPU"}]):
        batch = decode_batch(msgspec.msgpack.encode([1.0, events, 0]))  # typed fast path, then generic
        assert batch.events[0].ownership == G4_OWNERSHIP
        assert WorkerState(block_size=B).apply(batch.events[:1]).items == [
            ("g4_remove", None, [SEQ[0], 2**64 - 5])
        ]
