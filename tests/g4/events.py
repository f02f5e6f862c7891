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
            ts, events, *_ = dec.decode(frames[2])
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
        elif ev.get("type") == "BlockRemoved" and ev.get("medium") == "STORAGE" \
                and ev.get("ownership") == "kvgate-g4":
            removed.update(ev["block_hashes"])
    return stored, removed
