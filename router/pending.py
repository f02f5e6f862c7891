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

A prompt whose tail was deferred (router/tokenize.py: no worker's prefix reached it, so only its start was
encoded) is recorded by its start's hashes only, though the worker was sent all of it. Its text is kept
beside them (bounded by bytes, for the same lifetime): a later prompt that shares more of that text
(another question over the same document) asks :meth:`shares` how far, encodes that far, and counts those
blocks as the worker's, where vLLM will find them.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from indexer.hashing import chained_run
from router.prefix_cache import common_prefix


# how long a computed prompt's entries outlive its first token: the events' usual delay, with room
SETTLE_S = 2.0


class _Sent:
    """A deferred prompt's text sent to ``worker``: ``key`` is what else decides its blocks (LoRA, salt,
    the ids a tokenizer puts before the text)."""

    __slots__ = ("worker", "key", "data", "expiry", "owner")

    def __init__(self, worker: str, key: tuple, data: bytes, expiry: float, owner=None) -> None:
        self.worker, self.key, self.data, self.expiry, self.owner = worker, key, data, expiry, owner


class PendingBlocks:
    def __init__(self, ttl_s: float = 30.0, max_entries: int = 100_000, settle_s: float = SETTLE_S,
                 max_text_bytes: int = 16 << 20) -> None:
        self.ttl_s = ttl_s
        self.settle_s = settle_s
        self.max_entries = max_entries
        self.max_text_bytes = max_text_bytes
        self._w: dict[tuple[str, str], OrderedDict[int, float]] = {}  # (model, worker) -> hash -> expiry
        self._n = 0
        self._texts: dict[str, OrderedDict[int, _Sent]] = {}  # model -> id(text) -> deferred prompt sent
        self.text_bytes = 0

    def record(self, namespace: str, hashes: Sequence[int], worker: str, start: int = 0,
               now: float | None = None, text: tuple[tuple, bytes] | None = None, owner=None) -> None:
        """``worker`` was sent a prompt whose routable blocks are ``hashes``, of which it was known to hold
        the first ``start`` (index or earlier record): only the rest is recorded. ``text``: (key, UTF-8
        text) of a prompt whose ``hashes`` cover only its start (the tail was not encoded); ``owner``: its
        request (:meth:`text_owner`)."""
        if self.ttl_s <= 0:
            return
        now = time.monotonic() if now is None else now
        if text is not None:
            self._add_text(namespace, worker, text, now, owner)
        if len(hashes) <= start:
            return
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

    def _add_text(self, namespace: str, worker: str, text: tuple[tuple, bytes], now: float, owner) -> None:
        key, data = text
        if len(data) > self.max_text_bytes:
            return
        d = self._texts.get(namespace)
        if d is None:
            d = self._texts[namespace] = OrderedDict()
        old = d.pop(id(data), None)
        if old is not None:
            self.text_bytes -= len(old.data)
        d[id(data)] = _Sent(worker, key, data, now + self.ttl_s, owner)
        self.text_bytes += len(data)
        while self.text_bytes > self.max_text_bytes:  # over the bound: the oldest text of any model goes
            oldest = next(x for x in self._texts.values() if x)
            self.text_bytes -= len(oldest.popitem(last=False)[1].data)

    def shares(self, namespace: str, key: tuple, data: bytes,
               now: float | None = None) -> dict[str, tuple[int, bytes]]:
        """Per worker, the deferred prompt still recorded there (same ``key``) that shares the longest
        start with ``data``: (bytes shared, its text). One memcmp bisection per such prompt."""
        d = self._texts.get(namespace)
        if not d:
            return {}
        now = time.monotonic() if now is None else now
        out: dict[str, tuple[int, bytes]] = {}
        for k, e in list(d.items()):
            if e.expiry < now:
                del d[k]
                self.text_bytes -= len(e.data)
            elif e.key == key and (n := common_prefix(data, e.data, 0, 256)) > out.get(e.worker, (0,))[0]:
                out[e.worker] = (n, e.data)
        return out

    def text_owner(self, namespace: str, data: bytes):
        """The request (``record``'s ``owner``) that sent the deferred prompt ``data`` (a text
        :meth:`shares` returned), or None."""
        e = self._texts.get(namespace, {}).get(id(data))
        return e.owner if e is not None and e.data is data else None

    def settle(self, namespace: str, hashes: Sequence[int], worker: str, start: int = 0,
               now: float | None = None, text: tuple[tuple, bytes] | None = None) -> None:
        """``worker`` has computed the blocks recorded for this prompt (its first token came): their
        events follow within moments, and from then on the index, which also sees them evicted, is the
        truth. The entries expire ``settle_s`` from now instead of at the TTL (a capacity-bound vLLM can
        evict a prompt's blocks seconds after computing them; a 30 s entry kept claiming them); so does
        the prompt's ``text`` when it was recorded with one."""
        now = time.monotonic() if now is None else now
        self._expire(namespace, hashes, worker, start, text, now + self.settle_s)

    def withdraw(self, namespace: str, hashes: Sequence[int], worker: str, start: int = 0,
                 text: tuple[tuple, bytes] | None = None) -> None:
        """``worker`` failed or refused the prompt (an error status, a broken connection): it computed
        none of it, so the prompt's entries end now. (Another prompt in flight there with the same blocks
        loses its claim too; its events, if any, put them back in the index.)"""
        self._expire(namespace, hashes, worker, start, text, float("-inf"))

    def _expire(self, namespace: str, hashes: Sequence[int], worker: str, start: int,
                text: tuple[tuple, bytes] | None, exp: float) -> None:
        if text is not None:
            e = self._texts.get(namespace, {}).get(id(text[1]))
            if e is not None and e.data is text[1] and e.worker == worker:
                e.expiry = min(e.expiry, exp)
        d = self._w.get((namespace, worker))
        if not d:
            return
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
        for d in self._texts.values():
            for k in [k for k, e in d.items() if e.worker == worker]:
                self.text_bytes -= len(d.pop(k).data)

    def __len__(self) -> int:
        return self._n
