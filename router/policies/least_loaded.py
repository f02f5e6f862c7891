"""Least loaded: fewest requests in flight/queued (gateway and vLLM counts), then fewest pending tokens."""
from __future__ import annotations

from router.cost import Candidate
from router.policies.base import Policy, Rotation, RouteRequest


class LeastLoadedPolicy(Policy):
    name = "least_loaded"

    def __init__(self) -> None:
        self._rot = Rotation()

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        n = len(candidates)
        start = self._rot.next(n)
        keyed = sorted(((c.load, c.pending_tokens, (i - start) % n), i) for i, c in enumerate(candidates))
        return [candidates[i] for _, i in keyed]
