"""Default policy: smallest predicted TTFT (router.cost), ties to the least loaded, then in turn.

The cost model prices only this request. Two terms make the order account for what the choice costs the
fleet afterwards:

- ``routing.recompute_weight`` (default 1.0): a worker that would recompute prompt tokens another candidate
  already holds pays for that extra prefill work, at its own prefill speed, times the weight. Leaving the prefix holder spends
  that compute a second time and splits the conversation's prefix over two workers, so the next turns miss
  too; a greedy per-request TTFT choice does that whenever the holder has a short transient queue. A holder
  whose queue costs more than recomputing the prefix twice still loses the request.
- ``routing.cache_affinity`` (default 0.1): a worker holding part of the prompt counts its predicted TTFT up
  to that share lower, in proportion to the share it holds, so near ties stay with the cache.
"""
from __future__ import annotations

from router.cost import Candidate
from router.policies.base import Policy, Rotation, RouteRequest


def effective_ttft_ms(c: Candidate, affinity: float, recompute_weight: float = 0.0, least_work: float = 0.0) -> float:
    """``least_work``: the smallest prefill work among the candidates (the best holder's); what this one
    would compute beyond it is recomputation of tokens another worker holds."""
    total = c.cached_tokens + c.uncached_tokens
    share = c.cached_tokens / total if total else 0.0
    redo = max(0.0, c.prefill_work - least_work)
    penalty = recompute_weight * redo / max(1.0, c.prefill_tokens_per_s) * 1000.0
    return c.predicted_ttft_ms * (1.0 - affinity * share) + penalty


def kv_order(candidates: list[Candidate], start: int, affinity: float = 0.0,
             recompute_weight: float = 0.0) -> list[Candidate]:
    """Best first; sets each candidate's ``score_ms`` (the ordering key the admin API shows)."""
    n = len(candidates)
    least = min((c.prefill_work for c in candidates), default=0.0)
    for c in candidates:
        c.score_ms = round(effective_ttft_ms(c, affinity, recompute_weight, least), 3)
    keyed = sorted(((c.score_ms, c.load, (i - start) % n), i) for i, c in enumerate(candidates))
    return [candidates[i] for _, i in keyed]


class KVPolicy(Policy):
    name = "kv"

    def __init__(self, cache_affinity: float = 0.1, recompute_weight: float = 1.0) -> None:
        self._rot = Rotation()
        self.cache_affinity = cache_affinity
        self.recompute_weight = recompute_weight

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return kv_order(candidates, self._rot.next(len(candidates)), self.cache_affinity, self.recompute_weight)
