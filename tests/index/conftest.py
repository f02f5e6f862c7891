"""The index contract runs against every backend: the in-memory one, a real redis-server, and a real
3-primary Redis Cluster (tests/support/redis_cluster.py)."""
from __future__ import annotations

import pytest

from indexer.index.memory import MemoryIndex


@pytest.fixture(params=["memory", "redis", "cluster"])
async def index(request, redis_server):
    if request.param == "memory":
        idx = MemoryIndex()
    elif request.param == "redis":
        from indexer.index.redis import RedisIndex

        idx = RedisIndex(redis_server, key_prefix="t")
        await idx._r.flushall()
    else:
        from redis.asyncio.cluster import RedisCluster

        from indexer.index.redis import RedisIndex

        idx = RedisIndex(request.getfixturevalue("redis_cluster").url, key_prefix="t", cluster=True)
        await idx._r.flushall(target_nodes=RedisCluster.PRIMARIES)
    yield idx
    await idx.close()
