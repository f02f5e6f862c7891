"""The request path's lookup guard (router/index_guard.py) against a real redis-server: a paused Redis
(CLIENT PAUSE) is a slow one, a closed port a dead one."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from indexer.hashing import sequence_hashes
from indexer.index.base import Tier
from indexer.index.redis import RedisIndex
from router.index_guard import Breaker, IndexUnavailable, LookupGuard
from tests.support.procs import free_port

H = sequence_hashes(list(range(64)), 16)


async def test_deadline_then_breaker_then_recovery(redis_url):
    idx = RedisIndex(redis_url, key_prefix="g")
    await idx.store("m", "w", Tier.GPU, H)
    reasons = []
    guard = LookupGuard(idx, timeout_s=0.05, breaker_failures=2, breaker_open_s=0.5, on_degraded=reasons.append)
    assert (await guard.lookup("m", H)).match("w").gpu == 4
    admin = aioredis.from_url(redis_url)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        for _ in range(2):
            with pytest.raises(IndexUnavailable) as e:
                await guard.lookup("m", H)
            assert e.value.reason == "timeout"
        assert guard.open
        with pytest.raises(IndexUnavailable) as e:  # fails at once, no Redis call
            await guard.lookup("m", H)
        assert e.value.reason == "breaker_open"
        assert reasons == ["timeout", "timeout", "breaker_open"] and guard.degraded == 3
        await admin.execute_command("CLIENT", "UNPAUSE")
        await asyncio.sleep(0.6)  # the breaker lets one lookup through again
        assert (await guard.lookup("m", H)).match("w").gpu == 4
        assert not guard.open
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        await idx.close()


async def test_one_stall_is_one_failure(redis_url):
    """Lookups in flight together that time out together (one Redis stall, or the gateway's loop busy past
    the deadline) count once towards the breaker: the next request is routed with the cache again. Counted
    one by one, these five opened a two-failure breaker and failed the next lookup at once."""
    idx = RedisIndex(redis_url, key_prefix="g")
    await idx.store("m", "w", Tier.GPU, H)
    guard = LookupGuard(idx, timeout_s=0.05, breaker_failures=2, breaker_open_s=5)
    admin = aioredis.from_url(redis_url)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        res = await asyncio.gather(*(guard.lookup("m", H) for _ in range(5)), return_exceptions=True)
        assert [getattr(r, "reason", r) for r in res] == ["timeout"] * 5
        await admin.execute_command("CLIENT", "UNPAUSE")
        assert not guard.open
        assert (await guard.lookup("m", H)).match("w").gpu == 4
        # two stalls one after the other still open it
        await admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        for _ in range(2):
            with pytest.raises(IndexUnavailable):
                await guard.lookup("m", H)
        assert guard.open
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        await idx.close()


def test_breaker_counts_episodes_and_makes_one_trial():
    now = [0.0]
    b = Breaker(2, open_s=1.0, clock=lambda: now[0])
    early, late = b.allow(), b.allow()
    now[0] = 0.1
    b.failure(early)
    b.failure(late)  # in flight when the first counted: the same episode
    assert b.count == 1 and b.state == "closed"
    b.failure(b.allow())  # sent after it: a second episode
    assert b.state == "open" and b.allow() is None
    now[0] = 1.2
    trial = b.allow()
    assert trial is not None and b.allow() is None  # one trial at a time; the rest fail at once
    b.abandon(trial)  # its request went away: another may try
    trial = b.allow()
    b.failure(trial)  # a failed trial reopens it for another open_s
    assert b.state == "open"
    now[0] = 2.3
    b.allow()
    b.success()
    assert b.state == "closed" and b.count == 0


async def test_dead_redis_degrades_with_a_reason():
    idx = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    guard = LookupGuard(idx, timeout_s=0.05, breaker_failures=1, breaker_open_s=5)
    with pytest.raises(IndexUnavailable) as e:
        await guard.lookup("m", H)
    assert e.value.reason in ("error", "timeout")
    with pytest.raises(IndexUnavailable) as e:
        await guard.lookup("m", H)
    assert e.value.reason == "breaker_open"
    await idx.close()


async def test_the_pool_is_bounded(redis_url):
    admin = aioredis.from_url(redis_url)
    before = (await admin.info("clients"))["connected_clients"]
    idx = RedisIndex(redis_url, key_prefix="g", max_connections=2)
    res = await asyncio.gather(*(idx.lookup("m", H) for _ in range(50)))  # 50 callers share 2 connections
    assert len(res) == 50
    assert (await admin.info("clients"))["connected_clients"] - before <= 2
    await idx.close()
    await admin.aclose()


async def test_an_in_memory_lookup_does_not_queue_behind_the_event_loop():
    # the gateway's event loop also applies event batches and relays other requests' streams: a lookup the
    # index answers at once must not wait for all of that to run first (it did with asyncio.wait_for, one
    # task per lookup: 20-30 ms of wall time per request on the fleet simulation)
    from indexer.index.memory import MemoryIndex

    idx = MemoryIndex()
    await idx.store("m", "w", Tier.GPU, H)
    guard = LookupGuard(idx, timeout_s=1.0)
    await guard.lookup("m", H)
    ran = []
    asyncio.get_running_loop().call_soon(ran.append, "other work")
    assert (await guard.lookup("m", H)).match("w").gpu == 4
    assert ran == []
