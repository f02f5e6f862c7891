"""Default policy: the smallest sum of scorer terms (router/policies/scorers.py), ties to the least loaded,
then in turn.

The cost model (router.cost) prices only this request's TTFT. The other terms price what the choice costs
the fleet afterwards:

- ``recompute`` (``routing.recompute_weight``, 1.0): prefill work beyond the best holder's, compute spent a
  second time on tokens another worker holds. A greedy per-request TTFT choice leaves the prefix holder
  whenever it has a short transient queue and splits the conversation's prefix over two workers.
- ``affinity`` (``routing.cache_affinity``, 0.1): a worker holding part of the prompt counts its predicted
  TTFT up to that share lower, so near ties stay with the cache.
- ``continuity`` (``routing.future_turns`` 3, ``stay_margin`` 0.3, ``stay_margin_ms``): leaving the
  conversation's holder also costs the turns still to come and a margin (hysteresis), a larger one when the
  holder's cache is roomy for the prompt (``stay_margin_roomy``, ``roomy_prompts``), at most
  ``stay_margin_idle`` towards a worker with nothing queued; a lead the candidate would load from G4 pays
  ``stay_margin_g4`` instead.
- ``footprint`` (``routing.footprint_weight``, 0: off, it did not pay on the simulator): a prompt no worker
  holds a meaningful share of (``routing.overlap_share``) goes where it evicts the least recently used
  cache (the most free KV).
- ``delay`` (``routing.held_delay_weight``, 1.0): the wait this request adds to the longer prompts held at
  the candidate's prefill gate, which it goes before (its prefill time each): the fleet's TTFT, not only
  this request's.
- ``load`` (``routing.load_weight``, 0): ms per request in flight beyond the least loaded.
With footprint, load and delay at 0 the order is the one of the recompute and affinity terms alone.
"""
from __future__ import annotations

from router.config import RoutingConfig
from router.cost import Candidate
from router.policies.base import Policy, Rotation, RouteRequest
from router.policies.scorers import (AffinityScorer, ContinuityScorer, DelayScorer, Fleet, FootprintScorer,
                                     LoadScorer, RecomputeScorer, Scorer, TTFTScorer)


def scorers_of(cfg: RoutingConfig) -> list[Scorer]:
    return [TTFTScorer(), AffinityScorer(cfg.cache_affinity), RecomputeScorer(cfg.recompute_weight),
            ContinuityScorer(cfg.future_turns, cfg.stay_margin, cfg.stay_margin_ms, cfg.stay_margin_roomy,
                             cfg.roomy_prompts, cfg.stay_margin_g4, cfg.stay_margin_idle),
            FootprintScorer(cfg.footprint_weight), LoadScorer(cfg.load_weight), DelayScorer(cfg.held_delay_weight)]


def kv_order(candidates: list[Candidate], start: int, scorers: list[Scorer],
             overlap_share: float = 0.1) -> list[Candidate]:
    """Best first; sets each candidate's ``terms_ms`` and their sum ``score_ms`` (explain shows both)."""
    n = len(candidates)
    fleet = Fleet.of(candidates, overlap_share)
    for c in candidates:
        c.score_notes = []
        terms = {}
        total = 0.0
        for s in scorers:
            if s.weight:
                v = s.ms(c, fleet)
                total += v
                terms[s.name] = v  # rounded for display (Candidate.to_dict)
            else:  # off: its term is 0 (explain still lists it)
                terms[s.name] = 0.0
        c.terms_ms = terms
        c.score_ms = round(total, 3)
    keyed = sorted(((c.score_ms, c.load, (i - start) % n), i) for i, c in enumerate(candidates))
    return [candidates[i] for _, i in keyed]


class KVPolicy(Policy):
    name = "kv"

    def __init__(self, cfg: RoutingConfig | None = None) -> None:
        self._rot = Rotation()
        self.cfg = cfg or RoutingConfig()
        self.scorers = scorers_of(self.cfg)

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return kv_order(candidates, self._rot.next(len(candidates)), self.scorers, self.cfg.overlap_share)
