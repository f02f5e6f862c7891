"""Default policy: smallest predicted TTFT (router.cost), ties to the least loaded, then in turn.

A worker holding part of the prompt gets a small relative edge (``routing.cache_affinity``, 0.1: its
predicted TTFT counts up to 10% less, in proportion to the share of the prompt it holds). The cost model
prices only this request; keeping a conversation where its prefix lives also keeps the next turns' hits
and avoids a second copy of the prefix elsewhere, so a near tie goes to the cache holder. A clearly
faster idle worker still wins."""
from __future__ import annotations

from router.cost import Candidate
from router.policies.base import Policy, Rotation, RouteRequest


def effective_ttft_ms(c: Candidate, affinity: float) -> float:
    total = c.cached_tokens + c.uncached_tokens
    share = c.cached_tokens / total if total else 0.0
    return c.predicted_ttft_ms * (1.0 - affinity * share)


def kv_order(candidates: list[Candidate], start: int, affinity: float = 0.0) -> list[Candidate]:
    n = len(candidates)
    keyed = sorted(((round(effective_ttft_ms(c, affinity), 3), c.load, (i - start) % n), i)
                   for i, c in enumerate(candidates))
    return [candidates[i] for _, i in keyed]


class KVPolicy(Policy):
    name = "kv"

    def __init__(self, cache_affinity: float = 0.1) -> None:
        self._rot = Rotation()
        self.cache_affinity = cache_affinity

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return kv_order(candidates, self._rot.next(len(candidates)), self.cache_affinity)
