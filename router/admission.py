"""Prefill admission: the gateway holds a request while its worker already prefills enough of the gateway's
prompts, and sends the shortest held prefill first when one of them ends.

Why: vLLM serves its waiting queue first come, first served, one step at a time of at most
``max_num_batched_tokens`` prompt tokens. A short prompt that arrives behind a long one waits for all of
the long one's chunks, and the long one's new blocks are taken from the free queue before the short one's
cached prefix is read again: under capacity pressure a follow-up turn loses the prefix it came back for.
The gateway sees every prompt's uncached length before vLLM does (router/cost.py), so it keeps the
worker's queue short and lets the cheapest prefill go next: shortest job first, which lowers the mean TTFT
of any mix of long and short prompts, and runs the cached follow-ups before the cold prompts that would
evict them. (vLLM's own ``--scheduling-policy priority`` cannot do this: a prompt it already runs keeps
the step budget until it is done, whatever the priority of the requests behind it.)

How short (:func:`gate_budget`): one step's ``max_num_batched_tokens`` of the gateway's prompts (or
``routing.prefill_gate_tokens``). vLLM then always has the next step's prompts queued, and the rest wait at
the gateway, shortest first. Shorter was tried: one prompt at a time (a budget of a step's fixed time x the
prefill speed, a few dozen tokens on a CPU server) is shortest first exactly and won on the virtual clock,
but lost on real vLLM (docs/BENCHMARKS.md, session 22): each hand-over then waits for the first byte to
reach the gateway and the next prompt to reach the engine, time the engine's prefill stands still.

It stands aside where it cannot order (:func:`gate_orders`): where one step's budget of prefill outlasts
``max_wait_s`` at the worker's calibrated speed (slow CPU servers), every request goes at once.

It is not a rate limit: a worker with none of the gateway's prompts prefilling takes the next one at once
whatever its size, a request held ``max_wait_s`` goes whatever the queue, and only prompts from this
gateway count (vLLM's waiting gauge still prices the others, router/load.py). Held requests are in the
worker's load tracker as prefilling, so the cost model prices the shorter ones as queue ahead of a request
(router/cost.py: the longer ones go after it), and a G4 prefetch ordered for a held request
(router/prefetch.py) runs while it waits. A worker out of routing (failed, draining, gone) releases its held
requests at once (:meth:`PrefillGate.release_all`), and the proxy sends them to their next candidate.
"""
from __future__ import annotations

import asyncio
import heapq
import time
from itertools import count

from router.load import ActiveSequences, Sequence


def gate_budget(routing, max_batched: int) -> int:
    """How many uncached prompt tokens of this gateway's a worker may be prefilling for another request to
    join them: ``routing.prefill_gate_tokens``, else one step's ``max_batched``; at most that, at least 1."""
    return max(1, min(max_batched, routing.prefill_gate_tokens or max_batched))


def gate_orders(budget: int, tokens_per_s: float, max_wait_s: float) -> bool:
    """Whether holding can order anything on a worker: one step's ``budget`` of prefill, at its calibrated
    speed, ends within the longest wait. On slower prefill a held request's wait runs out before the
    prefill it waits for ends; the gate would order little and add a hand-over to every request. Measured
    (docs/BENCHMARKS.md, session 28): at ~134 tokens/s (a CPU server without AMX; 2,048 tokens take 15 s
    against 5 s) kv had 0.87x sglang-router's mean TTFT with the gate and 0.75x without, +2.4 and +9.3
    points of hits; at ~1,500 tokens/s (sessions 22-27) the gate wins. The virtual clock agrees at every
    step time: the prefill speed separates them."""
    return tokens_per_s > 0 and budget / tokens_per_s <= max_wait_s


class PrefillGate:
    """One worker's held requests (bounded by the requests in flight), shortest uncached prompt first; a
    request whose predicted prefix is a held request's prompt (``Sequence.after``) right after that one."""

    def __init__(self, clock=time.monotonic) -> None:
        # heap of (uncached, arrival, 0, uncached, seq, future); a request held after another takes that
        # one's (uncached, arrival) and its own arrival third: it sorts right behind it
        self._held: list[tuple[int, int, int, int, Sequence, asyncio.Future]] = []
        self._order = count()
        self._clock = clock
        self._timer: asyncio.TimerHandle | None = None
        self._active: ActiveSequences | None = None
        self._budget = 0

    def __len__(self) -> int:
        return len(self._held)

    def outstanding(self, active: ActiveSequences) -> int:
        """Uncached prompt tokens of the gateway's requests the worker is prefilling or has queued (sent,
        no first token yet; one that shows none, not streamed, until its deadline: router/load.py)."""
        now = self._clock()
        return sum(s.uncached for s in active.prefilling(now) if not s.gated)

    def _fits(self, active: ActiveSequences, uncached: int, budget: int) -> bool:
        out = self.outstanding(active)
        return out == 0 or out + uncached <= budget

    async def admit(self, active: ActiveSequences, seq: Sequence, budget: int, max_wait_s: float) -> float:
        """Wait until the worker has room for ``seq``'s prefill in one step's ``budget`` of prompt tokens
        (or ``max_wait_s`` passes); the seconds waited. ``seq`` is in ``active`` already, marked ``gated``
        meanwhile. A cancellation (the client left) takes it out of the queue."""
        self._active, self._budget = active, budget
        seq.gated = True  # not outstanding itself while it asks
        if not self._held and self._fits(active, seq.uncached, budget):
            seq.gated = False
            return 0.0
        t0 = seq.held_since = self._clock()
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._held, self._key(seq) + (seq.uncached, seq, fut))
        self.wake()
        try:
            if not fut.done():
                await asyncio.wait_for(asyncio.shield(fut), timeout=max(0.0, max_wait_s))
        except asyncio.TimeoutError:
            pass  # waited long enough: it goes whatever the queue
        finally:
            if seq.gated:  # its wait ran out (or the client left): it goes now
                self._held = [e for e in self._held if e[4] is not seq]
                heapq.heapify(self._held)
                self._let_go(seq)
        return self._clock() - t0

    def _key(self, seq: Sequence) -> tuple[int, int, int]:
        """Its place: shortest uncached prompt first, equal ones in arrival order. A request planned on the
        blocks a held one will compute (router/pending.py: the same document, a turn sent before the last
        one's prefill) goes right behind it: sent before it, it would compute them itself (it is the
        shorter, so the gate would send it first) and the held one would find them instead, both predictions
        wrong and nothing saved."""
        order = next(self._order)
        after = seq.after
        if after is not None and after.gated:
            for e in self._held:
                if e[4] is after:
                    return e[0], e[1], order
        return seq.uncached, order, 0

    def wake(self) -> None:
        """A prefill on the worker ended (a first token, a request done) or a request joined: send the held
        ones that fit now, shortest first."""
        active = self._active
        if active is None:
            return
        while self._held and self._fits(active, self._held[0][3], self._budget):
            seq, fut = heapq.heappop(self._held)[4:]
            self._let_go(seq)
            if not fut.done():
                fut.set_result(None)
        self._arm(active)

    def _let_go(self, seq: Sequence) -> None:
        """``seq`` is held no more: counted as outstanding from now on (before its task runs), and it reaches
        the worker after those sent while it was held."""
        seq.gated = False
        if seq.held_since is not None:  # it is sent now: its time at the worker starts now
            waited = self._clock() - seq.held_since
            seq.held_since = None
            seq.sent_at += waited
            if seq.deadline != float("inf"):
                # a response with no first token: its prefill starts now (shifted here, not when its task
                # resumes: until then the gate must count it outstanding, or one wake sends every held one)
                seq.deadline += waited
        if self._active is not None:
            self._active.released(seq)

    def release_all(self) -> None:
        """The worker failed, drains or left: every held request goes now (the proxy sends it to its next
        candidate instead, router/proxy.py), not when a prefill there ends or its wait runs out."""
        held, self._held = self._held, []
        for *_, seq, fut in held:
            self._let_go(seq)
            if not fut.done():
                fut.set_result(None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, active: ActiveSequences) -> None:
        """While requests are held, wake at the next deadline of a sent request that shows no first token:
        it stops counting as prefilling then, and nothing else would say so."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        now = self._clock()
        nxt = min((s.deadline for s in active.prefilling(now) if not s.gated and s.deadline != float("inf")),
                  default=None)
        if nxt is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, nxt - now) + 1e-3, self.wake)
