"""Round robin over healthy candidates (the baseline that ignores the cache)."""
from __future__ import annotations

from router.cost import Candidate
from router.policies.base import Policy, Rotation, RouteRequest


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._rot = Rotation()

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda c: c.worker)
        i = self._rot.next(len(ordered))
        return ordered[i:] + ordered[:i]
