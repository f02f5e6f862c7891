"""The simulator's KV-event frames against a real vLLM server's, decoded by the same code.

Both sides go through kvgate's own decoder (``indexer.events.wire.decode_batch``) and a plain msgpack
decode; the test compares frame arity, batch layout, event types, the order of the fields on the wire and
their value types. Real frames come from the session's real vLLM server (``capture_frames``). Lives in
tests/e2e so it shares that session's servers.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

pytestmark = pytest.mark.vllm


_BY_VALUE = {"type", "block_size", "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"}


def _shape(v):
    if v is None:
        return "nil"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return ("list", tuple(sorted({_shape(x) for x in v})))
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _structure(frames: list[list[bytes]]) -> dict:
    """Per event type: the wire key order and the value shapes seen."""
    out: dict = {"frames": set(), "batch": set(), "events": {}}
    for fr in frames:
        out["frames"].add((len(fr), len(fr[1])))
        batch = msgspec.msgpack.decode(fr[2])
        out["batch"].add((type(batch).__name__, len(batch), _shape(batch[0]), _shape(batch[2])))
        for ev in batch[1]:
            keys = tuple(ev)
            # small scalar fields are compared by value, the rest by shape
            shapes = tuple((k, ev[k] if k in _BY_VALUE else _shape(ev[k])) for k in keys
                           if k not in ("parent_block_hash",))
            out["events"].setdefault(ev["type"], set()).add((keys, shapes))
    return out


async def _sim_frames(block_size: int, prompt_tokens: int) -> list[list[bytes]]:
    from bench.sim.fleet import FleetConfig, SimFleet
    from bench.sim.timing import DEFAULT_TIMING

    cfg = FleetConfig(workers=1, num_blocks=8, block_size=block_size, timing=DEFAULT_TIMING.with_(time_scale=1000))
    async with SimFleet(cfg) as f:
        w = f.workers[0]
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(w.events_endpoint)
        await asyncio.sleep(0.3)
        frames = []
        try:
            async with httpx.AsyncClient(timeout=30) as c:
                # first prompt: BlockStored; the next ones evict it (BlockRemoved) in the 8-block pool
                for k in range(3):
                    await c.post(w.url + "/v1/completions",
                                 json={"prompt": list(range(k * 1000, k * 1000 + prompt_tokens)), "max_tokens": 1})
            while await sub.poll(500):
                frames.append(await sub.recv_multipart())
        finally:
            sub.close(0)
            ctx.term()
    return frames


def test_simulator_frames_have_the_real_servers_structure(request):
    from indexer.events import wire
    from tests.support import vllm_server as support
    server = request.getfixturevalue("vllm_server")
    B = server.block_size
    real = support.capture_frames(server, 3)
    sim = asyncio.run(_sim_frames(B, 3 * B + 5))
    assert real and sim
    for fr in real + sim:
        batch = wire.decode_batch(fr[2])
        assert batch.malformed == 0 and batch.ignored == 0 and batch.dp_rank == 0
        for ev in batch.events:
            if type(ev).__name__ == "BlockStored":
                assert ev.block_size == B and len(ev.token_ids) == B * len(ev.block_hashes)
    r, s = _structure(real), _structure(sim)
    assert r["frames"] == s["frames"] == {(3, 8)}
    assert r["batch"] == s["batch"]
    assert "BlockStored" in r["events"] and "BlockStored" in s["events"]
    for kind in r["events"].keys() & s["events"].keys():
        assert r["events"][kind] == s["events"][kind], (kind, sorted(r["events"][kind]), sorted(s["events"][kind]))


def test_gateway_reads_prefill_histograms_from_real_vllm(request):
    """Block size and the prefill histograms that calibrate the cost model, parsed by the gateway's own
    code from a real server's /metrics after it computed a fresh prompt (the simulator's side of the same
    parse is in tests/sim/test_server.py)."""
    from router.vllm_metrics import parse_metrics
    from tests.support.vllm_server import unique_prompt

    server = request.getfixturevalue("vllm_server")
    before, _ = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": server.served_model_name, "prompt": unique_prompt(60), "max_tokens": 2})
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    for _ in range(50):  # vLLM records a finished request's histograms in its output loop
        after, block_size = parse_metrics(httpx.get(server.url + "/metrics", timeout=30).text)
        if after.prefill_since(before):
            break
        time.sleep(0.1)
    assert block_size == server.block_size
    tokens, seconds, requests, prompt_tokens = after.prefill_since(before)
    assert requests == 1 and 0 < tokens <= prompt and seconds > 0 and prompt_tokens == prompt
