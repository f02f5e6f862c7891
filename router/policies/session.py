"""Session affinity: requests carrying the session header stick to the worker that served the session
first; without the header, or when that worker is gone, the kv policy decides (and the session moves)."""
from __future__ import annotations

from collections import OrderedDict

from router.cost import Candidate
from router.policies.base import Policy, RouteRequest
from router.policies.kv import KVPolicy


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, header: str = "x-session-id", max_sessions: int = 100_000,
                 cache_affinity: float = 0.1, recompute_weight: float = 1.0) -> None:
        self.header = header.lower()
        self.max_sessions = max_sessions
        self._fallback = KVPolicy(cache_affinity, recompute_weight)
        self._sticky: OrderedDict[str, str] = OrderedDict()

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        ordered = self._fallback.order(req, candidates)
        sid = req.headers.get(self.header)
        if not sid:
            return ordered
        worker = self._sticky.get(sid)
        if worker is not None:
            self._sticky.move_to_end(sid)
            for i, c in enumerate(ordered):
                if c.worker == worker:
                    return [c] + ordered[:i] + ordered[i + 1:]
        return ordered

    def chosen(self, req: RouteRequest, worker: str) -> None:
        sid = req.headers.get(self.header)
        if not sid:
            return
        self._sticky[sid] = worker
        self._sticky.move_to_end(sid)
        while len(self._sticky) > self.max_sessions:
            self._sticky.popitem(last=False)
