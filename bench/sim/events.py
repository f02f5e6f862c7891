"""KV-cache events exactly as vLLM 0.32 encodes them (vllm/distributed/kv_events.py), and a ZMQ publisher with
the same frames and replay protocol as vLLM's ``ZmqEventPublisher``.

Frames: ``[topic, seq (8 bytes big-endian), msgpack KVEventBatch]``. The batch is an array
``[ts, [events], dp_rank]``; each event is a tagged map (``"type"``) whose fields without defaults are
always present. Replay: a ROUTER receives ``[identity, b"", start_seq_be8]`` and answers
``[identity, b"", topic, seq, payload]`` for every buffered batch with seq >= start, then
``[identity, b"", b"", 0xff*8, b""]``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

# One definition of vLLM's structs for the whole project (bench/sim/vllm_format.py); the simulator
# only adds an asyncio publisher (one event loop for many workers, no thread per worker).
from bench.sim.vllm_format import (  # noqa: F401 - re-exported
    END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVCacheEvent, KVEventBatch)

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()


def encode_batch(events: list, dp_rank: int = 0, ts: float | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                                        data_parallel_rank=dp_rank))


class ZmqPublisher:
    """PUB + optional ROUTER replay on asyncio sockets; one per simulated engine.

    Bound endpoints only (``tcp://host:port``); ``port`` 0 binds an ephemeral port, reported by
    ``endpoint``/``replay_endpoint`` after ``start``. The replay ring keeps ``buffer_steps`` batches.
    """

    def __init__(self, ctx: zmq.asyncio.Context, host: str = "127.0.0.1", port: int = 0,
                 replay_port: int | None = 0, topic: str = "", buffer_steps: int = 10_000,
                 hwm: int = 100_000, dp_rank: int = 0):
        self.ctx, self.host, self.topic, self.dp_rank = ctx, host, topic, dp_rank
        self._port, self._replay_port = port, replay_port
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._hwm = hwm
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self.published = 0
        self.drop_next = 0  # fault injection (POST /sim/fault): batches kept in the ring but not sent

    def _bind(self, sock: zmq.Socket, port: int) -> str:
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
            return f"tcp://{self.host}:{port}"
        p = sock.bind_to_random_port(f"tcp://{self.host}")
        return f"tcp://{self.host}:{p}"

    def start(self) -> None:
        self._pub = self.ctx.socket(zmq.PUB)
        self._pub.set_hwm(self._hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(self._pub, self._port)
        if self._replay_port is not None:
            self._replay = self.ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, self._replay_port)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list) -> int:
        """Encode and send one batch now (non-blocking: PUB drops beyond HWM like vLLM's). Returns its seq."""
        payload = encode_batch(events, self.dp_rank)
        seq = next(self._seq)
        self._buffer.append((seq, payload))
        frames = [self.topic.encode(), seq.to_bytes(8, "big"), payload]
        if self.drop_next > 0:  # lost on the way, as past the HWM: only the replay ring has it
            self.drop_next -= 1
        else:
            try:
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        self.published += 1
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError as e:  # pragma: no cover - socket closed under us
                log.debug("replay socket: %s", e)
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart([ident, b"", topic, seq.to_bytes(8, "big"), payload])
            await sock.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        if self._task:
            self._task.cancel()
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
