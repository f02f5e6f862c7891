"""Blocks a worker is about to hold because kvgate has just sent it the prompt.

vLLM announces a prompt's blocks (BlockStored) when it schedules the prefill, and the events need a few
milliseconds to a second to reach the index. A follow-up turn sent right after an answer can be routed
before that, and would go wherever load points. The gateway therefore remembers, for a short TTL, the
block hashes it forwarded to each worker beyond what the index already showed there, and the planner
counts them as that worker's GPU prefix where they extend the index's run.

Cost per request is in new blocks, not prompt blocks: a forward records only the blocks past the chosen
worker's known prefix, and a lookup costs one probe per worker plus a bisection when something is pending.
That works because block hashes are chained: a worker sent block ``i`` of a prompt was sent blocks
``0..i`` with it, so any live entry proves the whole run before it. Bounded (oldest entries dropped first);
the index is the source of truth once the events arrive: a prompt's entries expire shortly after its first
token (:meth:`settle`), when its blocks were computed and announced.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from indexer.hashing import chained_run


# how long a computed prompt's entries outlive its first token: the events' usual delay, with room
SETTLE_S = 2.0


class PendingBlocks:
    def __init__(self, ttl_s: float = 30.0, max_entries: int = 100_000, settle_s: float = SETTLE_S) -> None:
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.max_entries = max_entries
        self._w: dict[tuple[str, str], OrderedDict[int, float]] = {}  # (model, worker) -> hash -> expiry
        self._n = 0

    def record(self, namespace: str, hashes: Sequence[int], worker: str, start: int = 0,
               now: float | None = None) -> None:
        """``worker`` was sent a prompt whose routable blocks are ``hashes``, of which it was known to hold
        the first ``start`` (index or earlier record): only the rest is recorded."""
        if self.ttl_s <= 0 or len(hashes) <= start:
            return
        now = time.monotonic() if now is None else now
        d = self._w.get((namespace, worker))
        if d is None:
            d = self._w[(namespace, worker)] = OrderedDict()
        exp = now + self.ttl_s
        before = len(d)
        for i in range(max(0, start), len(hashes)):
            h = hashes[i]
            if h in d:
                d.move_to_end(h)
            d[h] = exp
        self._n += len(d) - before
        while d and next(iter(d.values())) < now:  # expired entries leave from the front
            d.popitem(last=False)
            self._n -= 1
        while self._n > self.max_entries:  # over the bound: the oldest entry of any worker goes
            oldest = min((x for x in self._w.values() if x), key=lambda x: next(iter(x.values())))
            oldest.popitem(last=False)
            self._n -= 1

    def settle(self, namespace: str, hashes: Sequence[int], worker: str, start: int = 0,
               now: float | None = None) -> None:
        """``worker`` has computed the blocks recorded for this prompt (its first token came): their
        events follow within moments, and from then on the index, which also sees them evicted, is the
        truth. The entries expire ``settle_s`` from now instead of at the TTL (a capacity-bound vLLM can
        evict a prompt's blocks seconds after computing them; a 30 s entry kept claiming them)."""
        d = self._w.get((namespace, worker))
        if not d:
            return
        now = time.monotonic() if now is None else now
        exp = now + self.settle_s
        for i in range(max(0, start), len(hashes)):
            e = d.get(hashes[i])
            if e is not None and e > exp:
                d[hashes[i]] = exp  # out of expiry order: leading() checks each entry's own expiry

    def leading(self, namespace: str, hashes: Sequence[int], worker: str, start: int = 0,
                now: float | None = None) -> int:
        """Leading blocks of ``hashes`` that ``worker`` holds, given that it holds the first ``start``
        (the index's run): ``start``, or more when the block after it was sent there recently."""
        d = self._w.get((namespace, worker))
        if not d:
            return start
        now = time.monotonic() if now is None else now

        def live(i: int) -> bool:
            e = d.get(hashes[i])
            return e is not None and e >= now

        return chained_run(start, len(hashes), live)

    def forget_worker(self, worker: str) -> None:
        """Drop a worker's entries (it restarted or left)."""
        for key in [k for k in self._w if k[1] == worker]:
            self._n -= len(self._w.pop(key))

    def __len__(self) -> int:
        return self._n
