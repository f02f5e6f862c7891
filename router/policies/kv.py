"""Default policy: smallest predicted TTFT (router.cost), ties to the least loaded, then in turn."""
from __future__ import annotations

from router.cost import Candidate
from router.policies.base import Policy, Rotation, RouteRequest


def kv_order(candidates: list[Candidate], start: int) -> list[Candidate]:
    n = len(candidates)
    keyed = sorted(((round(c.predicted_ttft_ms, 3), c.load, (i - start) % n), i)
                   for i, c in enumerate(candidates))
    return [candidates[i] for _, i in keyed]


class KVPolicy(Policy):
    name = "kv"

    def __init__(self) -> None:
        self._rot = Rotation()

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return kv_order(candidates, self._rot.next(len(candidates)))
