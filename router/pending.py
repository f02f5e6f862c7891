"""Blocks a worker is about to hold because kvgate has just sent it the prompt.

vLLM announces a prompt's blocks (BlockStored) when it schedules the prefill, and the events need a few
milliseconds to a second to reach the index. A follow-up turn sent right after an answer can be routed
before that, and would go wherever load points. The gateway therefore remembers, for a short TTL, the
block hashes of each prompt it forwarded and the worker it went to, and the planner counts them as that
worker's GPU prefix when they extend what the index says. Bounded (oldest entries dropped first); the
index stays the source of truth once the events arrive.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence


class PendingBlocks:
    def __init__(self, ttl_s: float = 30.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._d: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()

    def record(self, namespace: str, hashes: Sequence[int], worker: str, now: float | None = None) -> None:
        """``worker`` was sent a prompt whose routable blocks are ``hashes``."""
        if self.ttl_s <= 0 or not hashes:
            return
        d = self._d
        entry = (worker, (time.monotonic() if now is None else now) + self.ttl_s)
        for h in hashes:
            key = (namespace, h)
            d[key] = entry
            d.move_to_end(key)
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def leading(self, namespace: str, hashes: Sequence[int], now: float | None = None) -> tuple[str | None, int]:
        """The worker last sent this prompt's first block, and how many leading blocks it was sent."""
        if not hashes or not self._d:
            return None, 0
        now = time.monotonic() if now is None else now
        d = self._d
        first = d.get((namespace, hashes[0]))
        if first is None or first[1] < now:
            return None, 0
        worker, n = first[0], 0
        for h in hashes:
            e = d.get((namespace, h))
            if e is None or e[0] != worker or e[1] < now:
                break
            n += 1
        return worker, n

    def forget_worker(self, worker: str) -> None:
        """Drop a worker's entries (it restarted or left)."""
        for key in [k for k, (w, _) in self._d.items() if w == worker]:
            del self._d[key]

    def __len__(self) -> int:
        return len(self._d)
