"""The global block index: one interface (:class:`BlockIndex`), two backends (memory, Redis)."""
from __future__ import annotations

from typing import Any

from indexer.index.base import BlockIndex, BlockLocation, LookupResult, Tier, WorkerMatch

__all__ = ["BlockIndex", "BlockLocation", "LookupResult", "Tier", "WorkerMatch", "create_index"]


def create_index(index_settings: Any) -> BlockIndex:
    """Build the backend named by ``settings.index`` (``router.config.IndexConfig`` or any object with
    ``backend``, ``redis_url``, ``key_prefix``, ``timeout_s``)."""
    backend = getattr(index_settings, "backend", "memory")
    if backend == "memory":
        from indexer.index.memory import MemoryIndex

        return MemoryIndex()
    if backend == "redis":
        from indexer.index.redis import RedisIndex

        return RedisIndex(
            index_settings.redis_url,
            key_prefix=getattr(index_settings, "key_prefix", "kvg"),
            timeout_s=getattr(index_settings, "timeout_s", 2.0),
            max_connections=getattr(index_settings, "max_connections", 32),
            cluster=getattr(index_settings, "cluster", False),
        )
    raise ValueError(f"unknown index backend {backend!r} (expected 'memory' or 'redis')")
