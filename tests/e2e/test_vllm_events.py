"""What a real vLLM server publishes on its KV event sockets: the wire format kvgate decodes.

Decoded here with plain msgpack (msgspec) rather than kvgate's decoder, so these tests pin vLLM's side of
the contract independently of the ingestion code that consumes it.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import zmq

from indexer.hashing import sequence_hashes
from tests.support.vllm_server import capture_frames, unique_prompt

pytestmark = pytest.mark.vllm

EVENT_TYPES = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def _decode(payload: bytes) -> list:
    return msgspec.msgpack.decode(payload)


def _stored_events(frames: list[list[bytes]]) -> list[dict]:
    return [ev for msg in frames for ev in _decode(msg[2])[1] if ev["type"] == "BlockStored"]


def test_event_frames_have_vllms_wire_structure(vllm_server):
    """Each message is [topic, 8-byte big-endian seq, msgpack [ts, [events], dp_rank]]; events are maps
    tagged by "type"; sequence numbers increase by one."""
    frames = capture_frames(vllm_server, 3)
    seqs = []
    for msg in frames:
        assert len(msg) == 3
        topic, seq, payload = msg
        assert topic == vllm_server.topic.encode()
        assert len(seq) == 8
        seqs.append(int.from_bytes(seq, "big"))
        batch = _decode(payload)
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, dp_rank = batch
        assert isinstance(ts, float) and ts > 1.6e9
        assert dp_rank == 0
        assert events and all(isinstance(ev, dict) and ev["type"] in EVENT_TYPES for ev in events)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    stored = _stored_events(frames)
    assert stored, "a fresh prompt must produce BlockStored"
    for ev in stored:
        # Fields without a default are always on the wire, even when nil.
        for key in (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ):
            assert key in ev
        assert ev["block_size"] == vllm_server.block_size
        assert ev["medium"] == "GPU"
        assert len(ev["token_ids"]) == ev["block_size"] * len(ev["block_hashes"])
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])


def test_stored_blocks_carry_the_prompt_tokens(vllm_server):
    """A prompt sent as token ids comes back in BlockStored as one chain (parent None first) holding those
    exact tokens, so kvgate's hashes of the prompt equal its hashes of the events' tokens."""
    bs = vllm_server.block_size
    tokens = httpx.post(
        f"{vllm_server.url}/tokenize",
        timeout=30.0,
        json={"model": vllm_server.served_model_name, "prompt": unique_prompt(200)},
    ).json()["tokens"]
    n_full = len(tokens) // bs
    assert n_full >= 4

    def send() -> None:
        r = httpx.post(
            f"{vllm_server.url}/v1/completions",
            timeout=60.0,
            json={"model": vllm_server.served_model_name, "prompt": tokens, "max_tokens": 1},
        )
        r.raise_for_status()

    def chain_of_prompt(frames: list[list[bytes]]) -> list[int]:
        """Tokens of the BlockStored chain that starts with the prompt's first block."""
        stored = _stored_events(frames)
        by_parent = {ev["parent_block_hash"]: ev for ev in stored if ev["parent_block_hash"] is not None}
        ev = next(
            (e for e in stored if e["parent_block_hash"] is None and e["token_ids"][:bs] == tokens[:bs]), None
        )
        out: list[int] = []
        while ev is not None:
            out += ev["token_ids"]
            ev = by_parent.get(ev["block_hashes"][-1])
        return out

    frames = capture_frames(vllm_server, trigger=send, until=lambda f: len(chain_of_prompt(f)) >= n_full * bs)
    chain_tokens = chain_of_prompt(frames)
    assert chain_tokens[: n_full * bs] == tokens[: n_full * bs]
    assert sequence_hashes(chain_tokens, bs)[:n_full] == sequence_hashes(tokens, bs)


def test_replay_endpoint_serves_buffered_batches(vllm_server):
    """A DEALER asking the replay endpoint from seq 0 gets [b"", topic, seq, payload] per buffered batch,
    in order, then the end marker [b"", b"", 0xff*8, b""]."""
    capture_frames(vllm_server, 1)  # at least one batch is buffered
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(vllm_server.replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert sock.poll(10_000), "replay stopped without an end marker"
            msg = sock.recv_multipart()
            if msg[2] == b"\xff" * 8:
                assert msg == [b"", b"", b"\xff" * 8, b""]
                break
            assert len(msg) == 4 and msg[0] == b"" and msg[1] == vllm_server.topic.encode()
            seqs.append(int.from_bytes(msg[2], "big"))
            _, events, _ = _decode(msg[3])
            assert all(ev["type"] in EVENT_TYPES for ev in events)
    finally:
        sock.close()
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
