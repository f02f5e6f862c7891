"""A failover on a real Redis Cluster (its own 3 primaries + 3 replicas): the primary that holds a model's
slot is killed; its replica takes over, the index answers again with what was replicated, writes go on,
and the epoch changes (so every writer pushes its exact state back, covering writes the failover lost)."""
from __future__ import annotations

import asyncio
import time

import pytest

from indexer.hashing import sequence_hashes
from indexer.index.base import Tier
from indexer.index.redis import RedisIndex
from tests.support.redis_cluster import RedisCluster

H = sequence_hashes(list(range(16 * 8)), 16)


@pytest.mark.timeout(120)
async def test_primary_killed_replica_takes_over():
    cluster = RedisCluster().start()
    idx = RedisIndex(cluster.url, key_prefix="fo", cluster=True, timeout_s=1.0)
    try:
        await idx.store("m", "w1", Tier.GPU, H[:6])
        before = await idx.epoch()
        node = idx._r.get_node_from_key(idx.blocks_key("m"))
        # Replicated before the crash: WAIT answers how many replicas acknowledged; on a loaded host one
        # WAIT of 800 ms could return 0, and the kill then lost the write (a CI failure, not the index's).
        deadline = time.monotonic() + 30
        while await idx._r.execute_command("WAIT", 1, 1000, target_nodes=node) < 1:
            assert time.monotonic() < deadline, "the replica never acknowledged the write"
        cluster.kill(node.port)
        deadline = time.monotonic() + 60
        while True:
            try:
                res = await idx.lookup("m", H)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert res.match("w1").gpu == 6
        await idx.store("m", "w1", Tier.GPU, H[6:])
        assert (await idx.lookup("m", H)).match("w1").gpu == 8
        assert await idx.epoch() != before
    finally:
        await idx.close()
        cluster.close()
