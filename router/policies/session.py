"""Session affinity: requests carrying the session header stick to the worker that served the session
first; without the header, or when that worker is gone, the kv policy decides (and the session moves)."""
from __future__ import annotations

from cachetools import LRUCache

from router.config import RoutingConfig
from router.cost import Candidate
from router.policies.base import Policy, RouteRequest
from router.policies.kv import KVPolicy


class SessionPolicy(Policy):
    name = "session"

    def __init__(self, header: str = "x-session-id", max_sessions: int = 100_000,
                 cfg: RoutingConfig | None = None) -> None:
        self.header = header.lower()
        self.max_sessions = max_sessions
        self._fallback = KVPolicy(cfg)
        self._sticky: LRUCache[str, str] = LRUCache(maxsize=max_sessions)  # session id -> worker

    def order(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        ordered = self._fallback.order(req, candidates)
        sid = req.headers.get(self.header)
        if not sid:
            return ordered
        worker = self._sticky.get(sid)  # a hit refreshes the session's place in the LRU order
        if worker is not None:
            for i, c in enumerate(ordered):
                if c.worker == worker:
                    return [c] + ordered[:i] + ordered[i + 1:]
        return ordered

    def chosen(self, req: RouteRequest, worker: str) -> None:
        sid = req.headers.get(self.header)
        if not sid:
            return
        self._sticky[sid] = worker
