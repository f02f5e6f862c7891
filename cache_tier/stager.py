"""Prefetch staging: G4 blocks read into bounded host memory ahead of the request that needs them.

The gateway sends a prefetch order (block hashes) to the worker it picked before forwarding the request;
a background thread reads those blocks (verified by the store) into an LRU capped in bytes. The
connector's load path takes a staged block first and falls back to the store. Orders are idempotent
(staged or in-flight hashes are skipped), bounded (``max_hashes`` per order, a bounded order queue), and
harmless when late or lost: staging is only ever a faster path to the same verified bytes.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from cache_tier.store import G4Error, G4Store


class Stager:
    def __init__(self, store: G4Store, capacity_bytes: int, max_hashes: int = 8192, max_orders: int = 64):
        self.store = store
        self.capacity_bytes = int(capacity_bytes)
        self.max_hashes = max_hashes
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, tuple[np.ndarray, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._q: queue.Queue = queue.Queue(maxsize=max_orders)
        self._queued: set[int] = set()
        self.counters = {
            "orders": 0,
            "orders_dropped": 0,
            "hashes_ordered": 0,
            "staged": 0,
            "stage_misses": 0,
            "stage_errors": 0,
            "taken": 0,
            "token_mismatch": 0,
            "evicted": 0,
        }
        self._thread: threading.Thread | None = None
        if self.capacity_bytes > 0:
            self._thread = threading.Thread(target=self._loop, name="kvgate-g4-stager", daemon=True)
            self._thread.start()

    def order(self, hashes: Sequence[int]) -> dict:
        """Queue a prefetch order; returns what was accepted. Never blocks."""
        hs = [int(h) & 0xFFFFFFFFFFFFFFFF for h in hashes[: self.max_hashes]]
        with self._lock:
            todo = [h for h in hs if h not in self._blocks and h not in self._queued]
            self.counters["orders"] += 1
            self.counters["hashes_ordered"] += len(hs)
            if not todo or self._thread is None:
                return {"accepted": 0, "already": len(hs) - len(todo)}
            try:
                self._q.put_nowait(todo)
            except queue.Full:
                self.counters["orders_dropped"] += 1
                return {"accepted": 0, "dropped": True}
            self._queued.update(todo)
        return {"accepted": len(todo), "already": len(hs) - len(todo)}

    def _loop(self) -> None:
        while True:
            todo = self._q.get()
            if todo is None:
                return
            for h in todo:
                try:
                    toks, payload = self.store.read_block(h)
                    item = (toks, payload.clone())
                except G4Error:
                    with self._lock:
                        self.counters["stage_misses"] += 1
                        self._queued.discard(h)
                    continue
                except Exception:  # noqa: BLE001 - staging is best effort; the load path re-reads
                    with self._lock:
                        self.counters["stage_errors"] += 1
                        self._queued.discard(h)
                    continue
                self._put(h, item)

    def _put(self, h: int, item: tuple[np.ndarray, torch.Tensor]) -> None:
        size = item[1].numel()
        with self._lock:
            self._queued.discard(h)
            if size > self.capacity_bytes or h in self._blocks:
                return
            while self._bytes + size > self.capacity_bytes and self._blocks:
                _, (_, old) = self._blocks.popitem(last=False)
                self._bytes -= old.numel()
                self.counters["evicted"] += 1
            self._blocks[h] = item
            self._bytes += size
            self.counters["staged"] += 1

    def take(self, h: int, token_ids: Sequence[int] | None = None) -> torch.Tensor | None:
        """The staged payload of ``h`` (removed from staging), or None; checks the token ids."""
        with self._lock:
            item = self._blocks.pop(h, None)
            if item is None:
                return None
            self._bytes -= item[1].numel()
        toks, payload = item
        if token_ids is not None and not np.array_equal(toks, np.asarray(token_ids, dtype="<u4")):
            with self._lock:
                self.counters["token_mismatch"] += 1
            return None
        with self._lock:
            self.counters["taken"] += 1
        return payload

    def contains(self, h: int) -> bool:
        with self._lock:
            return h in self._blocks

    def stats(self) -> dict:
        with self._lock:
            d = dict(self.counters)
            d["blocks"] = len(self._blocks)
            d["bytes"] = self._bytes
            d["capacity_bytes"] = self.capacity_bytes
            d["in_flight"] = len(self._queued)
        return d

    def close(self) -> None:
        if self._thread is not None:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                pass
