"""Routing policies behind one interface (:class:`router.policies.base.Policy`)."""
from __future__ import annotations

from router.config import RoutingConfig
from router.policies.base import Policy, RouteRequest
from router.policies.kv import KVPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.session import SessionPolicy

POLICIES = ("kv", "round_robin", "least_loaded", "session")


def create_policy(cfg: RoutingConfig, name: str | None = None) -> Policy:
    name = name or cfg.policy
    if name == "kv":
        return KVPolicy(cfg)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "session":
        return SessionPolicy(cfg.session_header, cfg.sessions_kept, cfg)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = ["POLICIES", "Policy", "RouteRequest", "create_policy"]

