"""Scorers: each prices one thing a placement costs, in milliseconds, for one candidate.

The kv policy (router/policies/kv.py) sums their terms into a candidate's ``score_ms`` and keeps each term
in ``terms_ms`` (explain shows them). The cost model prices only this request's TTFT; the other terms price
what the choice costs afterwards, so every term but ``ttft`` is relative to the fleet's best (0 for it):
a scorer says how much worse this candidate is than the best one on its count, never an absolute.

A term whose inputs are missing or malformed is 0 (neutral) and says so in ``score_notes``; a term is never
NaN or infinite, and is clamped to the cost model's range (router/cost.py).
"""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from router.cost import MAX_TTFT_MS, Candidate
from router.kv_room import demand_share

IDLE_QUEUE_MS = 1.0  # a candidate with less queue than this ahead of the request has nothing queued


def prompt_share(c: Candidate) -> float:
    """The share of the prompt the candidate would not compute (local and G4 blocks)."""
    total = c.cached_tokens + c.uncached_tokens
    return c.cached_tokens / total if total > 0 else 0.0


def local_share(c: Candidate) -> float:
    """The share of the prompt the candidate holds itself (G4 blocks are every worker's)."""
    held = c.local_blocks + c.g4_blocks
    return prompt_share(c) * c.local_blocks / held if held > 0 else 0.0


def work_ms(c: Candidate, work: float) -> float:
    """``work`` (tokens at context 0) at the candidate's prefill speed, in ms."""
    return max(0.0, work) / max(1.0, c.prefill_tokens_per_s) * 1000.0


def kv_pressure(c: Candidate) -> float | None:
    """How recently used the cache a placement here would evict is, from 0 (no eviction, or the oldest of
    much free room) to 1 (the queue and this prompt take all free room): the share of the worker's free
    KV they allocate (router/kv_room.py); with no capacity known, the share in use. None: no usable
    metrics."""
    if c.kv_free is None:
        return None
    if c.kv_free_tokens is None:
        return 1.0 - c.kv_free
    if c.kv_free_tokens <= 0:
        return 1.0
    return min(1.0, demand_share(c.kv_demand_tokens + c.uncached_tokens, c.kv_free_tokens))


@dataclass(frozen=True)
class Fleet:
    """What scorers know of all candidates of one request."""

    least_work: float = 0.0  # the smallest prefill work (the best holder's, G4 included)
    # the conversation's holder: the longest local prefix, if it is longer than every candidate's by a
    # meaningful share of the prompt (a system prompt all hold makes no holder)
    holder: Candidate | None = None
    low_overlap: bool = True  # no holder
    least_pressure: float | None = None
    least_load: float = 0.0
    least_delay: float = 0.0  # the smallest DelayScorer term

    @classmethod
    def of(cls, candidates: list[Candidate], overlap_share: float) -> Fleet:
        if not candidates:
            return cls()
        best = floor = candidates[0]
        best_key = (best.local_blocks, -best.predicted_ttft_ms)
        least_work, least_load, least_pressure = best.prefill_work, best.load, None
        least_delay = delay_ms(best)
        for c in candidates:  # one pass: this runs for every request
            key = (c.local_blocks, -c.predicted_ttft_ms)
            if key > best_key:
                best, best_key = c, key
            if c.local_blocks < floor.local_blocks:  # what every candidate holds (a system prompt)
                floor = c
            if c.prefill_work < least_work:
                least_work = c.prefill_work
            if c.load < least_load:
                least_load = c.load
            if least_delay and (d := delay_ms(c)) < least_delay:
                least_delay = d
            p = kv_pressure(c)
            if p is not None and (least_pressure is None or p < least_pressure):
                least_pressure = p
        meaningful = (best.local_blocks > floor.local_blocks
                      and local_share(best) - local_share(floor) >= overlap_share)
        return cls(least_work=least_work, holder=best if meaningful else None, low_overlap=not meaningful,
                   least_pressure=least_pressure, least_load=least_load, least_delay=least_delay)


class Scorer(abc.ABC):
    """One term of the ordering key: ``weight`` times :meth:`term`, in ms (lower is better)."""

    name = "abstract"
    unknown = 0.0  # the term when its inputs are NaN: neutral (relative terms), or the worst (TTFT)

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    @abc.abstractmethod
    def term(self, c: Candidate, fleet: Fleet) -> float:
        """The unweighted term, ms. May append to ``c.score_notes`` when it falls back."""

    def ms(self, c: Candidate, fleet: Fleet) -> float:
        if not self.weight:
            return 0.0
        v = self.weight * self.term(c, fleet)
        if math.isnan(v):
            c.score_notes.append(f"{self.name}: not a number, counted as {self.unknown:g} ms")
            return self.unknown
        if abs(v) > MAX_TTFT_MS:
            c.score_notes.append(f"{self.name}: {v:.0f} ms clamped")
            return math.copysign(MAX_TTFT_MS, v)
        return v


class TTFTScorer(Scorer):
    """This request's predicted TTFT (router/cost.py): queue, prefill of what is not cached, G4 load."""

    name = "ttft"
    unknown = MAX_TTFT_MS

    def term(self, c: Candidate, fleet: Fleet) -> float:
        return c.predicted_ttft_ms


class AffinityScorer(Scorer):
    """The prefix edge: the predicted TTFT counts up to ``weight`` lower in proportion to the share of the
    prompt cached, so near ties stay with the cache (weight: ``routing.cache_affinity``)."""

    name = "affinity"

    def term(self, c: Candidate, fleet: Fleet) -> float:
        return -prompt_share(c) * c.predicted_ttft_ms


class RecomputeScorer(Scorer):
    """Prefill work beyond the best holder's: compute spent again on tokens another worker holds
    (weight: ``routing.recompute_weight``)."""

    name = "recompute"

    def term(self, c: Candidate, fleet: Fleet) -> float:
        return work_ms(c, c.prefill_work - fleet.least_work)


class ContinuityScorer(Scorer):
    """Hysteresis: leaving the conversation's holder costs its expected future turns (the holder's prefix
    this worker would compute, once more per turn: ``routing.future_turns``) plus a margin (a share of the
    holder's predicted TTFT, ``routing.stay_margin``, and ``routing.stay_margin_ms``), so a transient
    queue on the holder does not split the conversation over two workers. The share grows by up to
    ``routing.stay_margin_roomy`` with the holder's cache room for the prompt (:func:`roominess`): where
    the prefix outlives the next turns, leaving loses them all. That margin counts for the part of the
    holder's lead this worker would compute. The part it would load from G4 splits nothing (the blocks it
    loads are its own the next turn) but is not free either: vLLM parks the request a step for the load,
    and the prefix then takes room in two workers' caches, so more of it is loaded again later. That part
    pays ``routing.stay_margin_g4`` x the holder's TTFT instead (with G4 on both capacity-bound servers:
    half the G4 loads of no margin, at the same mean TTFT).

    Towards a candidate with nothing queued ahead of the request the margin is at most
    ``routing.stay_margin_idle``. The roomy margin can pass 1 (1.5 x the holder's TTFT for a small prompt
    on a roomy cache), and then no queue on the holder ever lets the conversation go: on the 16-worker
    fleet simulator turns waited 2-3 s behind a holder's long prefill with idle workers beside that
    would have answered in 0.1-0.3 s. Hysteresis is against a transient queue moving a conversation
    between busy workers; an idle worker is not that, and where no worker is idle (the 4-worker fleet,
    the capacity-bound servers) nothing changes."""

    name = "continuity"

    def __init__(self, future_turns: float, margin: float, margin_ms: float, roomy: float = 0.0,
                 roomy_prompts: float = 8.0, g4: float = 0.0, idle: float | None = None) -> None:
        super().__init__(1.0)
        self.future_turns, self.margin, self.margin_ms = future_turns, margin, margin_ms
        self.roomy, self.roomy_prompts, self.g4 = roomy, roomy_prompts, g4
        self.idle = idle

    def term(self, c: Candidate, fleet: Fleet) -> float:
        h = fleet.holder
        if h is None or c.local_blocks >= h.local_blocks:
            return 0.0
        split = self.future_turns * work_ms(c, c.prefill_work - h.prefill_work)
        lead = h.local_blocks - c.local_blocks
        loaded = min(1.0, max(0, c.g4_blocks) / lead)
        margin = self.margin + self.roomy * roominess(h, self.roomy_prompts)
        if self.idle is not None and c.queue_ms < IDLE_QUEUE_MS:
            margin = min(margin, self.idle)
        return split + (1.0 - loaded) * (margin * h.predicted_ttft_ms + self.margin_ms) \
            + loaded * self.g4 * h.predicted_ttft_ms


def roominess(c: Candidate, prompts: float) -> float:
    """How roomy the candidate's KV cache is for this prompt, 0 to 1: 1 less ``prompts`` prompts of its size
    over the capacity (vLLM's free share and tokens, router/kv_room.py), at least 0; 0 when the capacity is
    unknown. A cache that holds many such prompts keeps a conversation's prefix for its next turns (the
    fleet simulator's 1M-token workers, and GPU servers); one that holds a few evicts it between turns
    whoever is sent there (the capacity-bound run's 6,560-token servers and 2,000-token prompts)."""
    free, tokens = c.kv_free, c.kv_free_tokens
    if free is None or tokens is None or not (free > 0 and tokens > 0):  # NaN included
        return 0.0
    capacity = tokens / free
    return max(0.0, 1.0 - prompts * (c.cached_tokens + c.uncached_tokens) / capacity)


class FootprintScorer(Scorer):
    """Low-overlap placement: when no worker holds a meaningful share, the prompt goes where its blocks
    displace the least reusable cache. This prompt's compute (what evicted blocks cost to recompute) times
    how much more recently used the blocks it would evict here are than on the best worker
    (:func:`kv_pressure`). Bounded by ``weight`` x this prompt's own prefill time, so a queue longer than
    that still outweighs free KV (weight: ``routing.footprint_weight``)."""

    name = "footprint"

    def term(self, c: Candidate, fleet: Fleet) -> float:
        if not fleet.low_overlap:
            return 0.0
        p = kv_pressure(c)
        if p is None or fleet.least_pressure is None:
            if fleet.least_pressure is not None:
                c.score_notes.append("footprint: no usable kv_usage from vLLM's metrics, neutral (0)")
            return 0.0
        return work_ms(c, c.prefill_work) * (p - fleet.least_pressure)


def delay_ms(c: Candidate) -> float:
    """The wait this request adds to the requests it goes before at the candidate's prefill gate (longer
    prompts held there; router/admission.py sends the shortest first): its prefill time each."""
    return c.jumped_requests * max(0.0, c.prefill_ms + c.g4_load_ms)


class DelayScorer(Scorer):
    """What going before held requests costs them (``routing.held_delay_weight``, 1: the fleet's sum of
    TTFTs). The TTFT term sees only this request's queue, and the gate puts a short prompt ahead of the
    longer ones it holds, so a busy worker with a long prompt held looks as fast as an idle one and the held
    prompt waits another prefill. Measured on the 16-worker fleet simulator (docs/BENCHMARKS.md, session
    35): requests held 2.5 s behind a prompt sent, 4 ms after them, to the same worker while others idled."""

    name = "delay"

    def term(self, c: Candidate, fleet: Fleet) -> float:
        return delay_ms(c) - fleet.least_delay


class LoadScorer(Scorer):
    """Requests in flight beyond the least loaded candidate, ``weight`` ms each (``routing.load_weight``;
    0 by default: the TTFT term prices the queue already). For fleets that also want decode-time balance."""

    name = "load"

    def term(self, c: Candidate, fleet: Fleet) -> float:
        return c.load - fleet.least_load
