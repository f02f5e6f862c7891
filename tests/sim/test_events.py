"""The simulator's KV events on the wire: vLLM 0.32's frames, msgpack layout and replay protocol
(../shared/vllm-interface.md sections 1.2, 1.3, 1.7), read with plain pyzmq and a generic msgpack decoder."""
from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]


async def _sub(ctx, endpoint):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    await asyncio.sleep(0.3)  # slow joiner
    return s


async def test_frames_and_batch_layout(fleet):
    w = fleet.workers[0]
    ctx = zmq.asyncio.Context()
    sub = await _sub(ctx, w.events_endpoint)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            # 2 full blocks cached at admission, 1 more filled by decode (40 + 20 - 1 = 59 -> 3 blocks)
            await c.post(w.url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 20})
        frames = [await asyncio.wait_for(sub.recv_multipart(), 10) for _ in range(2)]
    finally:
        sub.close(0)
        ctx.term()
    for i, (topic, seq, payload) in enumerate(frames):
        assert topic == w.publisher.topic.encode()
        assert len(seq) == 8 and int.from_bytes(seq, "big") == i
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, dp = batch
        assert isinstance(ts, float) and dp == 0
        for ev in events:
            assert list(ev) == STORED_KEYS and ev["type"] == "BlockStored"
            assert ev["lora_id"] is None and ev["lora_name"] is None and ev["medium"] == "GPU"
            assert ev["extra_keys"] == [None] * len(ev["block_hashes"]) and ev["group_idx"] == 0
            assert ev["kv_cache_spec_kind"] == "full_attention"
    first = msgspec.msgpack.decode(frames[0][2])[1][0]
    decode = msgspec.msgpack.decode(frames[1][2])[1][0]
    assert first["parent_block_hash"] is None and first["token_ids"] == list(range(32))
    assert decode["parent_block_hash"] == first["block_hashes"][-1] and len(decode["token_ids"]) == 16


async def test_eviction_batch_has_one_removal_per_block_before_the_store():
    from bench.sim.fleet import FleetConfig, SimFleet
    from bench.sim.timing import DEFAULT_TIMING

    # 4 blocks and vLLM's null block
    async with SimFleet(FleetConfig(workers=1, num_blocks=5, timing=DEFAULT_TIMING.with_(time_scale=1000))) as f:
        w = f.workers[0]
        ctx = zmq.asyncio.Context()
        sub = await _sub(ctx, w.events_endpoint)
        try:
            async with httpx.AsyncClient(timeout=30) as c:
                await c.post(w.url + "/v1/completions", json={"prompt": list(range(48)), "max_tokens": 1})
                # 4 blocks: the never-used one and the 3 cached ones (vLLM holds a prompt's blocks, not its
                # output's, until decoding reaches them; this one ends at its first token)
                await c.post(w.url + "/v1/completions", json={"prompt": list(range(1000, 1063)), "max_tokens": 1})
            batches = [msgspec.msgpack.decode((await asyncio.wait_for(sub.recv_multipart(), 10))[2])
                       for _ in range(2)]
        finally:
            sub.close(0)
            ctx.term()
    kinds = [e["type"] for e in batches[1][1]]
    assert kinds == ["BlockRemoved"] * 3 + ["BlockStored"]
    for e in batches[1][1][:3]:
        assert list(e) == ["type", "block_hashes", "medium", "group_idx"] and len(e["block_hashes"]) == 1
    assert {e["block_hashes"][0] for e in batches[1][1][:3]} == set(batches[0][1][0]["block_hashes"])


async def test_replay_endpoint_speaks_vllms_protocol(fleet):
    w = fleet.workers[0]
    async with httpx.AsyncClient(timeout=30) as c:
        for k in range(3):
            await c.post(w.url + "/v1/completions", json={"prompt": list(range(k * 100, k * 100 + 20)),
                                                          "max_tokens": 1})
    ctx = zmq.asyncio.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(w.replay_endpoint)
    try:
        await d.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while True:
            fr = await asyncio.wait_for(d.recv_multipart(), 10)
            if fr[2] == b"\xff" * 8:
                assert fr == [b"", b"", b"\xff" * 8, b""]
                break
            assert len(fr) == 4 and fr[0] == b"" and fr[1] == w.publisher.topic.encode()
            got.append(int.from_bytes(fr[2], "big"))
            msgspec.msgpack.decode(fr[3])
        # malformed requests are ignored, the socket keeps serving
        await d.send_multipart([b"", b"x"])
        await d.send_multipart([b"", (2).to_bytes(8, "big")])
        fr = await asyncio.wait_for(d.recv_multipart(), 10)
        assert int.from_bytes(fr[2], "big") == 2
    finally:
        d.close(0)
        ctx.term()
    assert got == [1, 2]


async def test_kvgates_wire_decoder_reads_simulator_frames(fleet):
    from indexer.events import wire
    w = fleet.workers[0]
    ctx = zmq.asyncio.Context()
    sub = await _sub(ctx, w.events_endpoint)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            await c.post(w.url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 1})
        _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
    finally:
        sub.close(0)
        ctx.term()
    batch = wire.decode_batch(payload)
    assert batch.dp_rank == 0 and len(batch.events) == 1
