"""The policy seam: order the scored candidates best-first (the proxy retries down the list)."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from router.cost import Candidate


@dataclass
class RouteRequest:
    model: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names


class Policy(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        """Candidates best-first, in a new list. Must not block. The candidates are this request's own
        (made by the cost model for it): a policy may set their ``score_ms``, nothing else."""

    def chosen(self, req: RouteRequest, worker: str) -> None:
        """Told which worker actually served the request (after retries)."""


class Rotation:
    """A counter that breaks exact ties in turn, so identical idle workers share the load."""

    def __init__(self) -> None:
        self.n = 0

    def next(self, size: int) -> int:
        self.n += 1
        return self.n % max(1, size)
