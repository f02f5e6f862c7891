"""One load tracker per worker: the requests this gateway has sent it, by phase, reconciled with vLLM's
own gauges. The proxy reports the transitions (sent, first token, done); the cost model (router/cost.py),
the policies and the admin API read :meth:`ActiveSequences.view`. Nothing else counts a worker's load.

A sequence is *prefilling* from the moment it is sent until its first token, *decoding* after. A response
that shows no first token (not streamed) counts as prefilling until twice its predicted TTFT has passed
(a lazy deadline, no timer), then as decoding until it ends: vLLM's own waiting gauge covers a longer wait.

vLLM's gauges see what the gateway does not (another gateway, clients that bypass it): requests vLLM
reports waiting beyond the gateway's prefilling ones are queued work of the worker's mean request size;
running beyond the gateway's ones that must be prefilling are decodes.

It also follows the KV its requests take and free between two scrapes of ``vllm:kv_cache_usage_perc``
(:meth:`ActiveSequences.kv_since_scrape`): a request takes its prompt and generation at its first token and
frees them when it ends, less the blocks another request in flight shares. The generation is what its
response's usage gives, and until then its expected length: ``max_tokens``, or the worker's average answer
where answers stop short of theirs (clients often ask for 4,096 tokens and get 50). A prefilling request
vLLM was running at a scrape (by its waiting gauge: it admits in arrival order) is *admitted*: its prompt
is in that usage, so it is no demand on the room (``LoadView.kv_demand_tokens``) and takes only its
generation at its first token. The free room a placement reads
(router/kv_room.py) is the last scrape's corrected by that, so it is current between scrapes (every
``health_interval_s``, 5 s by default; on the capacity-bound virtual run, bench/capacity_virtual.py, room
5 s old made the footprint term's placement no better than none).

It also keeps the worker's recent releases as an LRU clock (router/eviction.py): vLLM puts a finished
request's blocks at the recent end of its free queue and evicts from the other end, so a cached prefix is
evicted once new allocations exceed the free blocks released *before* it. :meth:`prefix_age` says how many
tokens were released after the last request that held a prefix (or that one still holds it), from the
requests' own block hashes (references, no copies; one probe per recent request, not per block: hashes are
chained, so equal hashes at one position mean equal prefixes).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from itertools import chain, islice

from indexer.hashing import chained_run


@dataclass(slots=True, eq=False)
class Sequence:
    """One request sent to the worker (prompt sizes in tokens; ``work``: prefill work, router/cost.py)."""

    uncached: int
    work: float
    deadline: float  # counted as prefilling until then when no first token is seen
    first_at: float | None = None
    tokens: int = 0  # the whole prompt (the KV it holds once scheduled)
    max_tokens: int = 0  # the tokens it may generate (0: unknown)
    completion_tokens: int | None = None  # the tokens it generated, once its response said (None: unknown)
    # the tokens it is expected to generate: max_tokens, or fewer where this worker's answers end sooner
    # (ActiveSequences.add); what its KV is priced at until its response says (-1: max_tokens)
    expected: int = -1
    hashes: list | None = None  # its routable block hashes (a reference), for the LRU clock
    block_size: int = 0
    prefix_blocks: int = 0  # the cached prefix it was predicted to find (its local blocks)
    prefix_at: float | None = None  # where that prefix sat on the LRU clock when sent (None: held or unknown)
    admitted: bool = False  # vLLM runs it (its KV allocated): seen at a scrape or in its blocks' events
    taken_at: int = -1  # the tracker's scrape-snapshot count when its KV was taken (at its first token)
    taken_gen: int = 0  # the generation its KV was taken at (its expected length then)
    # its prompt's KV counted as taken (less blocks running requests hold), and the scrape-snapshot count
    # then: a scrape that saw it running after all has it in its usage already (mark_scrape)
    prompt_taken: int = 0
    prompt_at: int = -1
    admit_keys: tuple = ()  # the hashes of its first uncached blocks: their BlockStored says vLLM runs it
    gated: bool = False  # waiting at the gateway's prefill gate, not sent yet (router/admission.py)
    # the held request whose blocks its predicted prefix counts (router/pending.py): it goes after it
    after: Sequence | None = None
    sent_at: float = 0.0  # when it went to the worker (after the prefill gate's wait)
    held_since: float | None = None  # when the prefill gate began to hold it (None: not held)

    def __post_init__(self) -> None:
        if self.expected < 0:
            self.expected = self.max_tokens

    @property
    def prefills(self) -> bool:
        """Whether it has a prompt for vLLM to prefill (not a stored response's GET or a token count)."""
        return self.tokens > 0 or self.uncached > 0 or self.work > 0

    def kv_release(self, step_s: float) -> tuple[float, int]:
        """When a decoding sequence is expected to end (``expected`` steps after its first token, or its
        deadline when none was seen) and the KV tokens it frees then."""
        first = self.first_at if self.first_at is not None else self.deadline
        return first + self.expected * step_s, self.tokens + self.expected


@dataclass(slots=True)
class LoadView:
    """What a scorer needs of a worker's load at one instant (the admin API shows it too)."""

    inflight: int = 0
    prefill_requests: int = 0  # the gateway's own, sent and not yet prefilled (or at its prefill gate)
    prefill_tokens: int = 0  # their uncached prompt tokens
    unadmitted_tokens: int = 0  # of those, the ones not yet allocated as of the last scrape (KV demand)
    prefill_work: float = 0.0  # their prefill work
    decodes: int = 0  # gateway's own decoding, or vLLM's running beyond the prefilling ones, the larger
    unknown_waiting: float = 0.0  # waiting at vLLM beyond the gateway's prefilling requests
    mean_work: float = 0.0  # the worker's mean prefill work per request (prices the unknown ones)
    mean_tokens: float = 0.0  # and its mean uncached tokens per request
    now: float = 0.0  # the tracker's clock when the view was taken
    # how long the worker has been prefilling the first of the gateway's requests it was sent that have no
    # first token yet (since it was sent, or since the last first token if later), and that one's work
    head_elapsed_s: float = 0.0
    head_work: float = 0.0
    # the gateway's decoding requests whose generation length is known, for the KV-capacity wait
    # (router/cost.py); None when there are none
    decoding: list[Sequence] | None = None
    # of the prefilling ones, those at the gateway's prefill gate (router/admission.py), None when there are none
    gated: list[Sequence] | None = None

    @property
    def gated_requests(self) -> int:
        return len(self.gated) if self.gated else 0

    @property
    def queue_requests(self) -> float:
        return self.prefill_requests + self.unknown_waiting

    @property
    def queue_work(self) -> float:
        return self.prefill_work + self.unknown_waiting * self.mean_work

    @property
    def queue_tokens(self) -> float:
        return self.prefill_tokens + self.unknown_waiting * self.mean_tokens

    def gated_behind(self, uncached: int, after: Sequence | None = None) -> tuple[int, int, float]:
        """The requests at the prefill gate that a request of ``uncached`` tokens would go before (the gate
        sends the shortest first; equal ones in arrival order; one held ``after`` another goes where that
        one does): their count, uncached tokens and work."""
        if after is not None and after.gated:
            uncached = max(uncached, after.uncached)
        n = tokens = 0
        work = 0.0
        for s in self.gated or ():
            if s.uncached > uncached:
                n += 1
                tokens += s.uncached
                work += s.work
        return n, tokens, work

    @property
    def kv_demand_tokens(self) -> float:
        """The KV the queue will still allocate beyond the last scrape's usage: the gateway's requests vLLM
        was not running then, and the unknown waiting ones."""
        return self.unadmitted_tokens + self.unknown_waiting * self.mean_tokens


HELD = -1.0  # prefix_age: a request in flight holds the prefix (or touches it before a later one runs)
RECENT = 64  # releases remembered per worker
DEDUP = 8  # a release's blocks shared with this many recent releases (or a request in flight) are not new
ADMIT_KEYS = 2  # first uncached block hashes watched per request (the prediction may be a block off)
LIVE_PROBES = 32  # requests in flight probed (the most recent): bounded cost at any concurrency


def shared_blocks(a, b) -> int:
    """Leading blocks two prompts' chained block hashes share (equal at ``i`` means equal up to ``i``)."""
    return chained_run(0, min(len(a), len(b)), lambda i: a[i] == b[i])


def _most_shared(hashes, others) -> int:
    """The most leading blocks ``hashes`` shares with one of ``others`` (block-hash lists)."""
    if not hashes:
        return 0
    return max((shared_blocks(hashes, x) for x in others), default=0)


def _holds(sh, hashes, n: int, held: int = 0) -> bool:
    """Whether a request whose prompt blocks are ``sh`` held the first ``n`` of ``hashes``: it had them in
    its prompt, or its whole prompt is their start and it held about ``n`` blocks in all (``held``: its
    prompt's and its output's full blocks, a block of slack for an answer length estimated; the rest is its
    own output, which the index shows: a conversation's last turn). Not a shorter prompt that is only their
    start: a short chat whose blocks are a system prompt held none of another conversation that begins with
    it (it read every such conversation as held, then as just used; found by a review)."""
    m = len(sh)
    return sh[n - 1] == hashes[n - 1] if m >= n else 0 < m and n <= held + 1 and sh[m - 1] == hashes[m - 1]


def _gate_order(s: Sequence) -> tuple[int, int]:
    """Where the prefill gate sends a held request (router/admission.py): shortest uncached prompt first,
    one held after another right behind that one (at its length), equal ones in arrival order (stable)."""
    a = s.after
    return (a.uncached, 1) if a is not None and a.gated else (s.uncached, 0)


class ActiveSequences:
    """A worker's in-flight requests from this gateway (bounded by what is in flight), and its last
    ``RECENT`` releases."""

    def __init__(self, default_work: float = 1024.0, clock=time.monotonic) -> None:
        self._live: dict[int, Sequence] = {}  # id(seq) -> seq, in arrival order
        self._clock = clock
        self.mean_work = default_work
        self.mean_tokens = default_work
        self.released_tokens = 0.0  # KV tokens released by finished requests, cumulative: the LRU clock
        # (hashes, clock just after its release, full blocks it held: prompt and output), oldest first
        self._recent: deque = deque(maxlen=RECENT)
        # KV tokens taken (at first token) and freed (at the end) by the gateway's requests, cumulative, and
        # both at the last scrape of vLLM's usage
        self.kv_taken = 0.0
        self.kv_freed = 0.0
        self._kv_mark = (0.0, 0.0)
        # scrape snapshots taken so far (a take records the count: :meth:`_since_mark`), and the count of the
        # one the usage was last marked with
        self._scrapes = 0
        self._marked = 0
        # tokens this worker's responses generated (usage.completion_tokens), moving average; None: none said
        self.mean_completion: float | None = None
        # of its responses to requests with a max_tokens, the share that generated all of it (moving average)
        self.full_share: float | None = None
        self._held_memo: dict[bool, float] = {}  # running_tokens / inflight_tokens until the requests change
        # a sent request's first uncached block hashes -> the requests in flight with them (identical
        # prompts share them: vLLM stores a block once)
        self._admit_keys: dict[int, list[Sequence]] = {}
        self._prefilled_at = 0.0  # the tracker's clock at the last first token of a request sent here

    def add(self, uncached: int, work: float, predicted_s: float, streamed: bool = False, tokens: int = 0,
            max_tokens: int = 0, hashes: list | None = None, block_size: int = 0,
            prefix_blocks: int = 0) -> Sequence:
        """``streamed``: its first token will be seen, so it is prefilling until then however long that
        takes (early predictions, on default figures, can be far too short). ``tokens``, ``max_tokens``:
        the prompt's and the generation's length (0: unknown), the KV it will hold and for how long.
        ``prefix_blocks``: the cached prefix it was predicted to find, placed on the LRU clock so that the
        requests behind it see it evicted too when the queue ahead of it outgrows the room
        (:meth:`queue_losses`)."""
        self._held_memo.clear()
        now = self._clock()
        deadline = float("inf") if streamed else now + max(0.01, 2.0 * predicted_s)
        seq = Sequence(uncached=max(0, int(uncached)), work=max(0.0, float(work)), deadline=deadline,
                       tokens=max(0, int(tokens)), max_tokens=max(0, int(max_tokens)), hashes=hashes or None,
                       block_size=block_size, expected=self._expected(max(0, int(max_tokens))), sent_at=now)
        if prefix_blocks > 0 and block_size > 0 and hashes:
            age = self.prefix_age(hashes, prefix_blocks)
            if age is not None and age != HELD:
                seq.prefix_blocks, seq.prefix_at = prefix_blocks, self.released_tokens - age
        self._live[id(seq)] = seq
        if hashes and block_size > 0:
            first = (seq.tokens - seq.uncached) // block_size  # the first block it computes
            seq.admit_keys = tuple(hashes[first:first + ADMIT_KEYS])
            for h in seq.admit_keys:
                self._admit_keys.setdefault(h, []).append(seq)
        if seq.prefills:  # the mean prompt prices the waiting requests the gateway did not send
            self.mean_work = 0.9 * self.mean_work + 0.1 * seq.work
            self.mean_tokens = 0.9 * self.mean_tokens + 0.1 * seq.uncached
        return seq

    def released(self, seq: Sequence) -> None:
        """``seq`` left the gateway's prefill gate (router/admission.py) and goes to the worker now, after every
        request sent while it was held: it moves behind them (vLLM admits in arrival order, which
        :meth:`mark_scrape` and :meth:`queue_losses` follow)."""
        if self._live.pop(id(seq), None) is not None:
            self._live[id(seq)] = seq
            self._held_memo.clear()

    def first_token(self, seq: Sequence) -> None:
        if seq.admit_keys:
            self._drop_keys(seq)
        if seq.first_at is None:
            self._held_memo.clear()
            seq.first_at = self._prefilled_at = self._clock()
            if id(seq) in self._live:
                # admitted at a scrape: its prompt is in that usage already, only its generation is new
                # (only a running request holds blocks: a waiting one that shares them has not taken them)
                if seq.admitted:
                    self.kv_taken += self._kv_tokens(seq, 0) - self._prompt_tokens(seq)
                else:
                    shared = self._shared(seq, self._live_hashes(seq, running=True))
                    self.kv_taken += self._kv_tokens(seq, shared)
                    self._took_prompt(seq, shared)
                seq.taken_at, seq.taken_gen = self._scrapes, seq.expected

    def _expected(self, max_tokens: int) -> int:
        """The tokens a new request is expected to generate: its ``max_tokens`` while this worker's answers
        mostly use all of theirs (a client that asks for what it wants, ``ignore_eos``, a trace replay) or
        before any response said what it generated; else the worker's average answer, at most
        ``max_tokens`` (0: no limit given)."""
        m = self.mean_completion
        if m is None or (max_tokens and (self.full_share is None or self.full_share >= 0.5)):
            return max_tokens
        m = math.ceil(m)
        return min(max_tokens, m) if max_tokens else m

    def finish(self, seq: Sequence, completion_tokens: int | None = None) -> None:
        """``seq`` ended; ``completion_tokens``: what it generated, when its response said (its usage). Its
        KV is then counted at that length, not at ``max_tokens``: what it frees, and what the LRU clock
        counts. Why: clients often ask for far more than they get (``max_tokens`` 4,096 for a 50-token
        answer: 256 blocks of 16 counted free that vLLM never held) or give no limit (none counted)."""
        if completion_tokens is not None and completion_tokens >= 0 and id(seq) in self._live:
            m = self.mean_completion
            self.mean_completion = completion_tokens if m is None else 0.9 * m + 0.1 * completion_tokens
            if seq.max_tokens:
                full = 1.0 if completion_tokens >= seq.max_tokens else 0.0
                f = self.full_share
                self.full_share = full if f is None else 0.9 * f + 0.1 * full
            if seq.first_at is not None and self._since_mark(seq):
                # taken since the last scrape at its expected length: take it at the length it had (a take
                # before that scrape is in the scrape's mark and its usage, which held no more than it had)
                self.kv_taken -= self._kv_tokens(seq, 0, completion=seq.taken_gen) - self._kv_tokens(
                    seq, 0, completion=completion_tokens)
            seq.completion_tokens = completion_tokens
            for s in self._live.values():  # the requests in flight are expected to answer as the others did
                if s.completion_tokens is None:
                    s.expected = self._expected(s.max_tokens)
        self.first_token(seq)
        if self._live.pop(id(seq), None) is None:
            return
        self._held_memo.clear()
        # blocks a running request holds are not freed; and KV taken since the last scrape at its expected
        # length is freed at that length (another response may have moved the expectation since)
        gen = seq.taken_gen if completion_tokens is None and self._since_mark(seq) else None
        self.kv_freed += self._kv_tokens(seq, self._shared(seq, self._live_hashes(seq, running=True)),
                                         completion=gen)
        live = self._shared(seq, self._live_hashes(seq))  # nor new to the free queue: read again soon
        # and blocks another recent release freed too are not new to the free queue (they move to its
        # recent end): the LRU clock does not count them either
        recent = self._shared(seq, (r[0] for r in islice(reversed(self._recent), DEDUP)))
        # nor does a last block the request did not fill: vLLM frees a block without a hash to the free
        # queue's front (reused first, block_pool.free_blocks), not behind the prefixes released before it
        self.released_tokens += self._kv_tokens(seq, max(live, recent), full_only=True)
        if seq.hashes:
            bs = seq.block_size
            held = self._kv_tokens(seq, 0, full_only=True) // bs if bs else len(seq.hashes)
            self._recent.append((seq.hashes, self.released_tokens, held))

    def withdraw(self, seq: Sequence) -> None:
        """``seq`` never ran on the worker (refused, its connection failed, or the client left while the
        gateway held it): it leaves without taking or freeing KV, moving the LRU clock or counting as a
        recent release. Ended as a release, it counted its whole prompt and expected answer as freed after
        every cached prefix there (a prefix's age went from 0 to 5,680 tokens, found by a review) and
        restarted the progress priced on the request at the queue's head. One seen running (a first token,
        its blocks stored, admitted at a scrape) ends as a release."""
        if seq.first_at is not None or seq.admitted:
            self.finish(seq)
            return
        if self._live.pop(id(seq), None) is None:
            return
        if seq.admit_keys:
            self._drop_keys(seq)
        self._held_memo.clear()

    def _live_hashes(self, seq: Sequence | None, running: bool = False):
        """The block hashes of the last ``LIVE_PROBES`` requests in flight other than ``seq`` (references;
        lazily, so a sequence without hashes probes nothing); ``running``: only those vLLM runs (a first
        token seen, or admitted)."""
        return (s.hashes for s in islice(reversed(self._live.values()), LIVE_PROBES)
                if s.hashes and s is not seq and (not running or s.first_at is not None or s.admitted))

    @staticmethod
    def _shared(seq: Sequence, others) -> int:
        """The most leading blocks ``seq``'s prompt shares with one of ``others`` (block-hash lists)."""
        return _most_shared(seq.hashes, others) if seq.block_size else 0

    @staticmethod
    def _prompt_tokens(seq: Sequence) -> int:
        """The KV tokens ``seq``'s prompt holds: whole blocks (vLLM allocates its last, partial block whole)."""
        return ActiveSequences._kv_tokens(seq, 0, generation=False)

    @staticmethod
    def _kv_tokens(seq: Sequence, shared: int, generation: bool = True,
                   completion: int | None = None, full_only: bool = False) -> int:
        """The KV tokens ``seq`` holds less ``shared`` leading blocks: its prompt and (``generation``) all it
        generates (``completion``, else what its response said, else what it is expected to), in whole blocks
        (the generation grows into the prompt's last one; ``full_only``: only the blocks it fills, those
        vLLM hashes). The last token generated is never fed back, so its KV is never written: one less."""
        bs = seq.block_size
        if completion is None:
            completion = seq.completion_tokens if seq.completion_tokens is not None else seq.expected
        held = seq.tokens + (max(0, completion - 1) if generation else 0)
        if bs > 0:
            held = (held // bs if full_only else -(-held // bs)) * bs
        return max(0, held - shared * bs)

    def _since_mark(self, seq: Sequence) -> bool:
        """Whether ``seq``'s KV was taken after the snapshot the usage was last marked with (not in it)."""
        return seq.taken_at >= self._marked

    def scrape_snapshot(self) -> tuple:
        """The tracker's state as a scrape of vLLM's ``/metrics`` starts: KV taken and freed so far, and the
        requests sent and prefilling (not held at the gate), in arrival order. The scrape's usage and waiting
        gauge describe this moment, not the one :meth:`mark_scrape` runs at after the fetch and parse (their
        awaits let first tokens, finishes and new requests in between: marked at the end, KV taken in that
        window was lost until the next scrape, and requests sent in it pushed older waiting ones into
        "admitted"; found by a review)."""
        self._scrapes += 1
        return (self._scrapes, self.kv_taken, self.kv_freed,
                [s for s in self._live.values() if s.first_at is None and not s.gated])

    def mark_scrape(self, waiting: float | None = None, snapshot: tuple | None = None) -> None:
        """vLLM's KV usage was just scraped (as of ``snapshot``, :meth:`scrape_snapshot`; None: now): it
        includes what the gateway's requests took and freed until then, and the prompts of the prefilling
        ones vLLM runs: with its ``waiting`` gauge, all but the last ``waiting`` of them (vLLM admits in
        arrival order), which are *admitted*: their KV is in the usage, so they are no demand on the room a
        placement reads (their prefill time still queues). A snapshot older than the last one marked (a
        slow scrape overtaken) marks nothing."""
        count, taken, freed, prefilling = snapshot or self.scrape_snapshot()
        if count < self._marked:
            return
        self._marked = count
        self._kv_mark = (taken, freed)
        self._held_memo.clear()
        if waiting is None or not waiting == waiting:  # NaN: unknown
            return
        for s in prefilling[: max(0, len(prefilling) - int(max(0.0, waiting)))]:
            if id(s) not in self._live:  # finished since
                continue
            if s.prompt_at >= count:  # its prompt counted as taken since: the usage has it already
                self.kv_taken -= s.prompt_taken
                s.prompt_taken = 0
            s.admitted = True

    def stored(self, hashes) -> None:
        """vLLM stored these blocks (its BlockStored events, GPU tier): a request of the gateway's whose
        first uncached blocks are among them is running now (vLLM caches a chunk's full blocks when it
        schedules it): :meth:`admit` it, without waiting for the next scrape of the waiting gauge."""
        keys = self._admit_keys
        if not keys:
            return
        for h in hashes:
            seqs = keys.get(h)
            if seqs:  # admit() takes it out of the list: iterate over a copy
                for seq in seqs.copy():
                    self.admit(seq)

    def _drop_keys(self, seq: Sequence) -> None:
        keys = self._admit_keys
        for h in seq.admit_keys:
            seqs = keys.get(h)
            if seqs is not None and seq in seqs:
                seqs.remove(seq)
                if not seqs:
                    del keys[h]
        seq.admit_keys = ()

    def admit(self, seq: Sequence) -> None:
        """vLLM scheduled ``seq`` since the last scrape: its prompt's KV is taken now, not at its first
        token, and it is no longer demand on the room. Between scrapes (5 s) a request vLLM admitted was
        both demand and free room: the room read the prefix it touched and the blocks it took as free,
        older than the prefix being priced (the virtual clock: 36 blocks read free where only that
        prefix was)."""
        if seq.gated:  # not sent yet: the blocks are another request's
            return
        self._drop_keys(seq)
        if seq.admitted or seq.first_at is not None or id(seq) not in self._live:
            return
        self._held_memo.clear()
        seq.admitted = True
        # the leading blocks a running request holds were not free: only the rest leaves the free room
        self._took_prompt(seq, self._shared(seq, self._live_hashes(seq, running=True)))
        self.kv_taken += seq.prompt_taken

    def _took_prompt(self, seq: Sequence, shared: int) -> None:
        """Record the prompt KV ``seq`` is counted as taking (less ``shared`` blocks) and when."""
        seq.prompt_taken = max(0, self._prompt_tokens(seq) - shared * seq.block_size)
        seq.prompt_at = self._scrapes

    def prefilling(self, now: float):
        """The requests counted as prefilling at ``now`` (those at the gateway's prefill gate too), in arrival
        order."""
        return (s for s in self._live.values() if s.first_at is None and now < s.deadline)

    def kv_since_scrape(self) -> float:
        """KV tokens the gateway's requests freed less those they took since the last scrape (negative: more
        taken than freed)."""
        taken, freed = self._kv_mark
        return (self.kv_freed - freed) - (self.kv_taken - taken)

    def prefix_age(self, hashes, n: int) -> float | None:
        """KV tokens released on this worker since the last of the gateway's requests that held the first
        ``n`` blocks of ``hashes`` ended (new to the free queue: a release's blocks that a recent release or a
        request in flight shares are not counted); ``HELD`` while one of the last ``LIVE_PROBES`` requests
        in flight holds them; None when none of the last ``RECENT`` releases had them (another gateway's,
        or older than the window: unknown)."""
        if n <= 0 or not hashes or n > len(hashes):
            return None
        for s in islice(reversed(self._live.values()), LIVE_PROBES):  # its output is not in a prompt yet
            if s.hashes is not None and _holds(s.hashes, hashes, n):
                return HELD
        for sh, at, held in reversed(self._recent):
            if _holds(sh, hashes, n, held):
                return self.released_tokens - at
        return None

    def queue_losses(self, free_tokens: float, now: float | None = None) -> float:
        """Prompt tokens the queue ahead will recompute beyond what it was predicted to: the gateway's
        requests not admitted as of the last scrape (:meth:`mark_scrape`), in arrival order, each allocating
        its uncached prompt, which evicts the oldest of the ``free_tokens`` first (the LRU model,
        router/eviction.py). A queued request whose own cached prefix that demand reaches loses it from its
        tail and allocates it too: the demand a later request sees cascades. Seen on capacity-bound real
        vLLM (session 15's decision records): behind a queue of 2-4, the prompts ahead delivered 2-5x fewer
        cached tokens than predicted, and the request behind them lost a prefix the uncached demand alone
        left whole. Requests held at the gateway's prefill gate come after the ones sent, shortest first (the
        gate's order)."""
        now = self._clock() if now is None else now
        demand = lost = 0.0
        live = self._live.values()
        held = sorted((s for s in live if s.gated), key=_gate_order)
        for s in chain((s for s in live if not s.gated), held):
            if s.first_at is not None or s.admitted or (now >= s.deadline and not s.gated):
                continue
            if s.prefix_at is not None:
                bs = s.block_size
                prefix = s.prefix_blocks * bs
                older = free_tokens - prefix - (self.released_tokens - s.prefix_at)
                excess = demand - max(0.0, older)
                if excess > 0:
                    gone = min(prefix, -(-excess // bs) * bs)
                    demand += gone
                    lost += gone
            demand += s.uncached
        return lost

    def running_tokens(self) -> float:
        """KV tokens the gateway's requests that vLLM runs now hold (a first token seen: prompt and
        generation; or admitted at the last scrape: prompt), the leading blocks one shares with an earlier
        one counted once. No free room can exceed the capacity less this (router/kv_room.py)."""
        return self._held(True)

    def inflight_tokens(self) -> float:
        """KV tokens all the gateway's requests in flight here hold when a request sent now is admitted
        (counted as :meth:`running_tokens`; those not decoding yet, their prompt): it is scheduled after
        them all, and what its cached prefix needs beyond the capacity left beside them is taken from the
        free queue first (router/cost.py)."""
        return self._held(False)

    def _held(self, running_only: bool) -> float:
        """Memoised until the requests in flight change: every candidate of every request reads it."""
        memo = self._held_memo.get(running_only)
        if memo is not None:
            return memo
        held = 0.0
        seen: list = []
        for s in self._live.values():
            if running_only and s.first_at is None and not s.admitted:
                continue
            shared = _most_shared(s.hashes, seen[-LIVE_PROBES:]) if s.block_size else 0
            # one that has not started decoding holds its prompt when a request sent now is admitted: its
            # generation takes blocks after that, which cannot evict that request's prefix any more
            held += self._kv_tokens(s, shared, generation=s.first_at is not None)
            if s.hashes:
                seen.append(s.hashes)
        self._held_memo[running_only] = held
        return held

    def gated_sender(self, hashes, n: int) -> Sequence | None:
        """The first request in flight whose prompt has block ``n - 1`` of ``hashes`` (so all before it:
        chained hashes), if it is held at the prefill gate (router/admission.py); None when none has it or
        the first is sent already (vLLM computes it before anything sent later)."""
        if n <= 0 or not hashes:
            return None
        h = hashes[n - 1]
        for s in self._live.values():
            if s.hashes and len(s.hashes) >= n and s.hashes[n - 1] == h:
                return s if s.gated else None
        return None

    def held_blocks(self, hashes, n: int) -> int:
        """Leading blocks, of the first ``n`` of ``hashes``, that one of the last ``LIVE_PROBES`` requests in
        flight has in its prompt: held by it (or touched before a later request runs), not evictable."""
        return min(n, _most_shared(hashes, self._live_hashes(None)))

    def __len__(self) -> int:
        return len(self._live)

    def view(self, running: float = 0.0, waiting: float = 0.0, now: float | None = None) -> LoadView:
        """The load now, reconciled with vLLM's ``running`` and ``waiting`` gauges."""
        now = self._clock() if now is None else now
        v = LoadView(inflight=len(self._live), mean_work=self.mean_work, mean_tokens=self.mean_tokens, now=now)
        head = None
        for s in self._live.values():
            if s.first_at is None and (s.gated or now < s.deadline):  # a held one's deadline starts when sent
                if s.gated:
                    if v.gated is None:
                        v.gated = []
                    v.gated.append(s)
                elif head is None or s.sent_at < head.sent_at:
                    head = s
                v.prefill_requests += 1
                v.prefill_tokens += s.uncached
                if not s.admitted:
                    v.unadmitted_tokens += s.uncached
                v.prefill_work += s.work
            elif s.expected:
                if v.decoding is None:
                    v.decoding = []
                v.decoding.append(s)
        own_decodes = v.inflight - v.prefill_requests
        # those at the gateway's prefill gate (router/admission.py) vLLM has not seen
        sent = v.prefill_requests - v.gated_requests
        v.unknown_waiting = max(0.0, waiting - sent)
        # the gateway's prefilling requests that vLLM does not count as waiting are running (prefilling)
        running_prefills = sent - min(float(sent), waiting)
        v.decodes = int(min(max(own_decodes, running - running_prefills, 0), 1e9))  # never int(inf)
        if head is not None:
            # vLLM prefills its waiting requests in arrival order, a step's budget at a time: the first one
            # sent has been worked on since it was sent or since the prefill before it ended
            v.head_elapsed_s, v.head_work = max(0.0, now - max(head.sent_at, self._prefilled_at)), head.work
        return v
