"""EventIngestor: vLLM KV events from every worker into the block index.

Per source, one task receives from the SUB socket into a bounded queue (when the queue is full the task
waits; ZMQ then buffers, and past vLLM's HWM messages are lost, which shows up as a sequence gap) and one
task applies the queue in order. Sources never wait on each other.

Sequence numbers (vllm-interface.md 1.2, 1.7):
- ``seq == last + 1``: apply;
- ``seq > last + 1`` (lost messages): ask the replay endpoint for ``last + 1 ..`` and apply the missing
  batches first; if it cannot fill the gap (no endpoint, timeout, ring already past it), reset;
- ``seq <= last`` (vLLM restarted: its counter starts at 0 again): reset.
Reset = drop the worker's local-tier index entries and its state, call ``on_reset(worker)``, and rebuild
from the events that follow. On the first message of a source with ``seq > 0`` the ingestor replays what
the publisher still buffers, best effort (no reset if it cannot).
Malformed messages are counted (``dropped``) and skipped; an index error marks the source dirty and the
next message resets it, so the index never keeps entries the state has forgotten.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from indexer.events.state import G4, WorkerState
from indexer.events.subscriber import ReplayError, Subscriber, resolve_endpoint
from indexer.events.wire import DecodeError, decode_batch, decode_seq
from indexer.index.base import BlockIndex

log = logging.getLogger("kvgate.events")
YIELD_EVERY_S = 0.0005

_COUNTERS = ("applied", "blocks_stored", "blocks_removed", "dropped", "gaps", "replays", "resets", "errors")


@dataclass
class EventSource:
    """One vLLM event stream (one worker, one data-parallel rank). ``worker_url`` (optional) fills in a
    wildcard host in the endpoints (``tcp://*:5557``)."""

    worker: str
    model: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int | None = None
    worker_url: str | None = None


class _Source:
    def __init__(self, src: EventSource, sub: Subscriber, queue_size: int) -> None:
        self.src = src
        self.sub = sub
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
        self.state = WorkerState(block_size=src.block_size)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.last_seq: int | None = None
        self.dirty = False
        self.closed = False
        self.tasks: list[asyncio.Task] = []


class EventIngestor:
    def __init__(
        self,
        index: BlockIndex,
        *,
        queue_size: int = 10_000,
        on_reset: Callable[[str], object] | None = None,
        observer: Callable[[str, str, list[int]], object] | None = None,
        replay_timeout_s: float = 5.0,
    ) -> None:
        self.index = index
        self.queue_size = queue_size
        self.on_reset = on_reset
        self.observer = observer
        self.replay_timeout_s = replay_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._sources: dict[str, _Source] = {}
        self._last_yield = 0.0

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()

    async def stop(self) -> None:
        for worker in list(self._sources):
            await self.remove_source(worker, clear=False)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def add_source(self, src: EventSource) -> None:
        """Subscribe to a source (replacing a previous one of the same worker, without clearing it)."""
        await self.start()
        if src.worker in self._sources:
            await self.remove_source(src.worker, clear=False)
        endpoint = resolve_endpoint(src.endpoint, src.worker_url)
        replay = resolve_endpoint(src.replay_endpoint, src.worker_url) if src.replay_endpoint else None
        sub = Subscriber(self._ctx, endpoint, src.topic, replay, timeout_s=self.replay_timeout_s)
        s = _Source(src, sub, self.queue_size)
        self._sources[src.worker] = s
        s.tasks = [
            asyncio.create_task(self._receive(s), name=f"kv-events-recv-{src.worker}"),
            asyncio.create_task(self._apply_loop(s), name=f"kv-events-apply-{src.worker}"),
        ]

    async def remove_source(self, worker: str, clear: bool = True) -> None:
        s = self._sources.pop(worker, None)
        if s is None:
            return
        s.closed = True
        # Cancel until the tasks are done: a client library that swallows one CancelledError (seen with
        # redis-py mid-command) would otherwise leave the apply task waiting on its queue for ever.
        for _ in range(100):
            pending = [t for t in s.tasks if not t.done()]
            if not pending:
                break
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=0.1)
        s.sub.close()
        if clear:
            await self.index.clear_worker(s.src.model, worker)

    def sources(self) -> list[EventSource]:
        return [s.src for s in self._sources.values()]

    # -- status -----------------------------------------------------------------------------------------
    def status(self, worker: str) -> dict:
        s = self._sources.get(worker)
        if s is None:
            raise KeyError(worker)
        st = s.state.counters
        return {
            "model": s.src.model,
            "endpoint": s.sub.endpoint,
            "connected": s.sub.connected,
            "last_seq": s.last_seq,
            **s.counters,
            "unknown_parent": st["unknown_parent"],
            "size_mismatch": st["size_mismatch"],
            "unmapped": st["unmapped"],
            "skipped": st["skipped"],
            "handles": len(s.state),
            "queued": s.queue.qsize(),
        }

    def statuses(self) -> dict[str, dict]:
        return {w: self.status(w) for w in self._sources}

    # -- tasks ------------------------------------------------------------------------------------------
    async def _receive(self, s: _Source) -> None:
        while not s.closed:
            try:
                frames = await s.sub.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:  # the socket was closed under us
                log.warning("events from %s: %s", s.src.worker, e)
                return
            await s.queue.put(frames)

    async def _apply_loop(self, s: _Source) -> None:
        while not s.closed:
            frames = await s.queue.get()
            try:
                await self.handle_message(s, frames)
                await self._yield()
            except asyncio.CancelledError:
                raise
            except Exception:  # an index error: never fatal, but the index may have diverged
                s.counters["errors"] += 1
                s.dirty = True
                log.exception("applying events from %s failed", s.src.worker)

    async def handle_message(self, s: _Source, frames: list[bytes]) -> None:
        """One live message: sequence checks, replay or reset, then the batch."""
        if len(frames) == 3:
            seq_frame, payload = frames[1], frames[2]
        elif len(frames) == 2:
            seq_frame, payload = frames
        else:
            s.counters["dropped"] += 1
            return
        try:
            seq = decode_seq(seq_frame)
        except DecodeError:
            s.counters["dropped"] += 1
            return
        if s.dirty:
            await self._reset(s, "index error")
        elif s.last_seq is None:
            if seq > 0 and s.sub.replay_endpoint:
                await self._fill(s, 0, seq, first=True)
        elif seq <= s.last_seq:
            log.info("%s: sequence went from %d to %d (restart)", s.src.worker, s.last_seq, seq)
            await self._reset(s, "restart")
            if seq > 0 and s.sub.replay_endpoint:  # the restarted publisher's first batches were missed
                await self._fill(s, 0, seq, first=True)
        elif seq > s.last_seq + 1:
            s.counters["gaps"] += 1
            if not await self._fill(s, s.last_seq + 1, seq):
                await self._reset(s, "unfillable gap")
        await self._apply_payload(s, seq, payload)

    async def _fill(self, s: _Source, start: int, upto: int, first: bool = False) -> bool:
        """Replay ``start .. upto-1``; True when all of it was applied."""
        if not s.sub.replay_endpoint:
            return False
        try:
            got = await s.sub.replay(start)
        except ReplayError as e:
            log.warning("%s: %s", s.src.worker, e)
            return False
        batches = [(q, p) for q, p in got if start <= q < upto]
        seqs = [q for q, _ in batches]
        if not batches or seqs != list(range(seqs[0], upto)):
            return False
        if seqs[0] != start and not first:
            return False
        s.counters["replays"] += 1
        for q, p in batches:
            await self._apply_payload(s, q, p)
            await self._yield()
        return seqs[0] == start

    async def _yield(self) -> None:
        """Let requests run between event batches: an in-memory index applies a batch without suspending,
        so a burst (a replay, a queue backlog) would otherwise hold the loop until all of it is applied."""
        now = time.perf_counter()
        if now - self._last_yield > YIELD_EVERY_S:
            await asyncio.sleep(0)
            self._last_yield = time.perf_counter()

    async def _reset(self, s: _Source, reason: str) -> None:
        s.counters["resets"] += 1
        s.state.reset()
        s.last_seq = None
        s.dirty = True
        await self.index.clear_worker(s.src.model, s.src.worker)
        s.dirty = False
        log.info("%s: cleared (%s)", s.src.worker, reason)
        if self.on_reset is not None:
            r = self.on_reset(s.src.worker)
            if inspect.isawaitable(r):
                await r

    async def _apply_payload(self, s: _Source, seq: int, payload: bytes) -> None:
        # last_seq moves once the batch is in the index (or failed: then the source is dirty and resets)
        try:
            try:
                batch = decode_batch(payload)
            except DecodeError:
                s.counters["dropped"] += 1
                return
            malformed_before = s.state.counters["malformed"]
            ops = s.state.apply(batch.events)
            s.counters["dropped"] += batch.malformed + s.state.counters["malformed"] - malformed_before
            s.counters["applied"] += len(batch.events)
            await self._write(s, ops.items)
        finally:
            s.last_seq = seq

    async def _write(self, s: _Source, items) -> None:
        model, worker = s.src.model, s.src.worker
        for op, tier, hashes in items:
            if op == "store":
                await self.index.store(model, worker, tier, hashes)
                s.counters["blocks_stored"] += len(hashes)
                self._observe(worker, tier.value, hashes)
            elif op == "remove":
                await self.index.remove(model, worker, tier, hashes)
                s.counters["blocks_removed"] += len(hashes)
            elif op == "g4":
                await self.index.store_g4(model, hashes)
                self._observe(worker, G4, hashes)
            elif op == "g4_remove":
                await self.index.remove_g4(model, hashes)
            elif op == "clear":
                await self.index.clear_worker(model, worker)

    def _observe(self, worker: str, tier: str, hashes: list[int]) -> None:
        if self.observer is not None:
            try:
                self.observer(worker, tier, hashes)
            except Exception:
                log.exception("event observer failed")

    async def feed(self, worker: str, frames: list[bytes]) -> None:
        """Apply one message (``[topic, seq, payload]``) of a source directly, bypassing its socket and
        queue (benchmarks, tests); not to be mixed with a live source's own receiving."""
        await self.handle_message(self._sources[worker], frames)
