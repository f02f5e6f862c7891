"""Redis-only behaviour: two gateway processes (two RedisIndex clients) on one real redis-server."""
from __future__ import annotations

import asyncio

import pytest

from indexer.hashing import sequence_hashes
from indexer.index.base import LeaseLost, Tier
from indexer.index.redis import RedisIndex

M = "m"
H = sequence_hashes(list(range(16 * 4)), 16)


async def test_a_stale_writer_is_fenced_off(redis_url):
    a, b = RedisIndex(redis_url, key_prefix="f"), RedisIndex(redis_url, key_prefix="f")
    try:
        assert await a.acquire_lease(M, "w1", "gw-a", ttl_s=0.1)
        await a.store(M, "w1", Tier.GPU, H[:2])
        await asyncio.sleep(0.25)  # a stalls past its lease; b takes over
        assert await b.acquire_lease(M, "w1", "gw-b", ttl_s=30)
        await b.store(M, "w1", Tier.GPU, H)
        with pytest.raises(LeaseLost):  # a's late writes change nothing
            await a.remove(M, "w1", Tier.GPU, H)
        with pytest.raises(LeaseLost):
            await a.clear_worker(M, "w1")
        with pytest.raises(LeaseLost):
            await a.save_handles(M, "w1", {(0, 1): (H[0], 1, 0)}, [], seq=3)
        assert (await b.lookup(M, H)).match("w1").gpu == 4
        assert not await a.acquire_lease(M, "w1", "gw-a", ttl_s=30)
    finally:
        await a.close()
        await b.close()
