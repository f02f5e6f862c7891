"""A tiny KV-event subscriber for the G4 tests: vLLM's ZMQ PUB stream decoded with msgspec, and the
mapping of STORAGE BlockStored events onto kvgate hashes (vllm-interface.md 2.9, GPU + STORAGE only).
It stands in for the index helper's ingestion until that lands on main."""

from __future__ import annotations

import threading

import msgspec
import zmq

from indexer import hashing


class EventTap:
    def __init__(self, port: int, topic: str = "kv"):
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self._stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        dec = msgspec.msgpack.Decoder()
        while not self._stop:
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            _ts, events, *_ = dec.decode(frames[2])
            with self.lock:
                self.events.extend(events)

    def close(self):
        self._stop = True
        self.t.join(2)
        self.sock.close(0)
        self.ctx.term()

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.events)


def g4_hashes_from_events(events: list[dict], block_size: int) -> tuple[set[int], set[int]]:
    """(kvgate hashes announced on G4, kvgate hashes removed from G4) from one source's events."""
    e2r: dict[int, int] = {}
    stored: set[int] = set()
    removed: set[int] = set()
    for ev in events:
        if ev.get("type") == "BlockStored":
            toks = ev["token_ids"]
            n = len(ev["block_hashes"])
            if ev["block_size"] != block_size or len(toks) != n * block_size:
                continue
            parent = ev["parent_block_hash"]
            prh = None if parent is None else e2r.get(parent)
            if parent is not None and prh is None:
                continue
            rhs = hashing.chain(hashing.local_hashes(toks, block_size), prh)
            for eh, rh in zip(ev["block_hashes"], rhs):
                e2r[eh] = rh
                if ev.get("medium") == "STORAGE":
                    stored.add(rh)
        elif (
            ev.get("type") == "BlockRemoved"
            and ev.get("medium") == "STORAGE"
            and ev.get("ownership") == "kvgate-g4"
        ):
            removed.update(ev["block_hashes"])
    return stored, removed


class IndexThread:
    """kvgate's real event ingestion (indexer.events.EventIngestor) into a real MemoryIndex, on its own
    event loop in a thread, so the synchronous vLLM tests can ask the index what it learned."""

    def __init__(self):
        import asyncio

        from indexer.events import EventIngestor
        from indexer.index.memory import MemoryIndex

        self.asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        self.t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.t.start()
        self.index = MemoryIndex()
        self.ingestor = self.call(self._make(EventIngestor))

    async def _make(self, cls):
        ing = cls(self.index)
        await ing.start()
        return ing

    def call(self, coro, timeout: float = 30.0):
        return self.asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, worker: str, model: str, zmq_port: int, block_size: int, topic: str = "kv") -> None:
        from indexer.events import EventSource

        self.call(
            self.ingestor.add_source(
                EventSource(
                    worker=worker,
                    model=model,
                    endpoint=f"tcp://127.0.0.1:{zmq_port}",
                    topic=topic,
                    block_size=block_size,
                )
            )
        )

    def g4(self, model: str, hashes: list[int]) -> int:
        """Length of the leading run of ``hashes`` the index records on G4."""
        return self.call(self.index.lookup(model, hashes)).g4

    def on_g4(self, model: str, hashes: list[int]) -> set[int]:
        out = set()
        for h in hashes:
            if self.call(self.index.locate(model, h)).g4:
                out.add(h)
        return out

    def close(self) -> None:
        try:
            self.call(self.ingestor.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.t.join(5)
