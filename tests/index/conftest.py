"""The index contract runs against every backend: the in-memory one and a real redis-server."""
from __future__ import annotations

import pytest

from indexer.index.memory import MemoryIndex


@pytest.fixture(params=["memory", "redis"])
async def index(request, redis_server):
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        from indexer.index.redis import RedisIndex

        idx = RedisIndex(redis_server, key_prefix="t")
        await idx._r.flushall()
    yield idx
    await idx.close()
