"""Real vLLM servers for the end-to-end tests, and a raw capture of their KV event frames.

The server class lives in ``bench.vllm_server`` (the benchmarks and the demo start servers too); this
module re-exports it for the tests and adds :func:`capture_frames`, which other tests (e.g. the
simulator's wire-format comparison) use to get real frames to decode with the same decoder.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from bench.vllm_server import VllmServer, VllmStartError, free_port, start_all, vllm_python

__all__ = [
    "VllmServer",
    "VllmStartError",
    "capture_frames",
    "free_port",
    "replay_batches",
    "start_all",
    "stored_chains",
    "unique_prompt",
    "vllm_python",
]


def unique_prompt(words: int = 120, tag: str | None = None) -> str:
    """A prompt nobody sent before (so its blocks are new and vLLM publishes BlockStored for them)."""
    tag = tag or uuid.uuid4().hex
    return " ".join(f"{tag[i % len(tag) :] or tag}{i}" for i in range(words))


def capture_frames(
    server: VllmServer,
    n: int = 1,
    *,
    trigger: Callable[[], Any] | None = None,
    until: Callable[[list[list[bytes]]], bool] | None = None,
    timeout_s: float = 60.0,
    topic: str | None = None,
) -> list[list[bytes]]:
    """Subscribe to ``server``'s KV event PUB socket and return multipart messages ``[topic, seq, payload]``.

    Without ``trigger``: the first ``n`` messages, sending a completion on a fresh prompt every few
    seconds until they arrived. With ``trigger`` (a callable that makes the server publish): first make
    sure the subscription is live (a new SUB socket misses what is published before its subscription
    reaches the publisher: ZMQ's slow joiner) with throw-away requests, then call ``trigger`` once and
    return the messages that follow, at least ``n`` and until ``until(messages)`` is true if given.
    """
    import httpx
    import zmq

    def fresh_request() -> None:
        httpx.post(
            f"{server.url}/v1/completions",
            timeout=60.0,
            json={"model": server.served_model_name, "prompt": unique_prompt(), "max_tokens": 1},
        ).raise_for_status()

    def done(frames: list[list[bytes]]) -> bool:
        return len(frames) >= n and (until is None or until(frames))

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, (server.topic if topic is None else topic).encode())
    sub.connect(server.events_endpoint)
    frames: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        time.sleep(0.3)
        if trigger is not None:
            while not sub.poll(0):  # subscription live once a throw-away request's events arrive
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{server.name}: no KV events on {server.events_endpoint}")
                fresh_request()
                sub.poll(2000)
            while sub.poll(300):
                sub.recv_multipart()
            trigger()
        while not done(frames) and time.monotonic() < deadline:
            if trigger is None:
                fresh_request()
            wait_until = min(deadline, time.monotonic() + 5.0)
            while not done(frames) and time.monotonic() < wait_until:
                if sub.poll(200):
                    frames.append(sub.recv_multipart())
        if not done(frames):
            raise TimeoutError(
                f"{server.name}: {len(frames)} KV event messages in {timeout_s:.0f}s, not what was awaited"
            )
        return frames
    finally:
        sub.close()


def replay_batches(
    server: VllmServer, start_seq: int = 0, timeout_s: float = 20.0
) -> list[tuple[int, bytes]]:
    """Every batch the server's publisher still buffers from ``start_seq`` on, as (seq, msgpack payload),
    asked from its replay endpoint (a DEALER: ``[b"", seq_be8]``; replies ``[b"", topic, seq, payload]``
    up to the end marker). No subscription race: what was published is there."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.replay_endpoint)
    out: list[tuple[int, bytes]] = []
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"{server.name}: replay stopped without its end marker")
            msg = sock.recv_multipart()
            if len(msg) >= 3 and msg[2] == b"\xff" * 8:
                return out
            out.append((int.from_bytes(msg[2], "big"), msg[3]))
    finally:
        sock.close()


def stored_chains(server: VllmServer) -> list[list[dict]]:
    """The BlockStored events the server still buffers, linked into chains (root: parent None)."""
    import msgspec

    stored = [
        ev
        for _, payload in replay_batches(server)
        for ev in msgspec.msgpack.decode(payload)[1]
        if ev.get("type") == "BlockStored"
    ]
    children: dict[int, list[dict]] = {}
    for ev in stored:
        if ev["parent_block_hash"] is not None:
            children.setdefault(ev["parent_block_hash"], []).append(ev)
    chains = []
    for root in (ev for ev in stored if ev["parent_block_hash"] is None):
        chain, ev = [root], root
        while children.get(ev["block_hashes"][-1]):
            ev = children[ev["block_hashes"][-1]][0]
            chain.append(ev)
        chains.append(chain)
    return chains
