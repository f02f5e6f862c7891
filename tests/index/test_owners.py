"""The response-owner store (indexer/index/owners.py) on both backends: the in-memory one and a real
redis-server, where two clients stand for two gateway replicas."""
from __future__ import annotations

import asyncio

import pytest

from indexer.index.owners import MemoryOwners, RedisOwners, create_owners
from router.config import IndexConfig


@pytest.fixture(params=["memory", "redis"])
async def make(request, redis_server):
    made = []

    async def factory(ttl_s: float = 60.0, max_entries: int = 100, delta_max_bytes: int = 1 << 30):
        if request.param == "memory":
            store = MemoryOwners(ttl_s, max_entries, delta_max_bytes)
        else:
            store = RedisOwners(redis_server, "t16", ttl_s=ttl_s, max_entries=max_entries,
                                delta_max_bytes=delta_max_bytes)
            if not made:
                await store._r.flushall()
        made.append(store)
        return store

    factory.backend = request.param
    yield factory
    for s in made:
        await s.close()


async def test_put_get_delete(make):
    store = await make()
    rec = {"worker": "w1", "model": "m", "parent": None, "delta": [{"role": "user", "content": "hé"}]}
    await store.put("resp_1", rec)
    assert await store.get("resp_1") == rec
    assert await store.get("resp_unknown") is None
    await store.put("resp_1", {**rec, "delta": None})  # the final record replaces the first
    assert (await store.get("resp_1"))["delta"] is None
    await store.delete("resp_1")
    assert await store.get("resp_1") is None


async def test_bound_drops_the_oldest(make):
    store = await make(max_entries=3)
    for i in range(5):
        await store.put(f"r{i}", {"worker": f"w{i}"})
    assert [await store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]


async def test_records_expire(make):
    store = await make(ttl_s=1.0)
    await store.put("short", {"worker": "w"})
    assert await store.get("short") is not None
    await asyncio.sleep(1.6 if make.backend == "memory" else 2.2)  # Redis expires keys at 1 s resolution
    assert await store.get("short") is None


async def test_chain_walks_parents_newest_first(make):
    store = await make()
    await store.put("r1", {"worker": "w", "parent": None, "delta": [1]})
    for i in range(2, 6):
        await store.put(f"r{i}", {"worker": "w", "parent": f"r{i - 1}", "delta": [i]})
    assert [r["delta"] for r in await store.chain("r5", 100)] == [[5], [4], [3], [2], [1]]
    assert [r["delta"] for r in await store.chain("r5", 2)] == [[5], [4]]  # bounded
    await store.delete("r2")
    assert [r["delta"] for r in await store.chain("r4", 100)] == [[4], [3]]  # stops where a record is gone
    assert await store.chain("nope", 10) == []


async def test_turns_past_the_byte_bound_leave_their_owner_in_place(make):
    """The deltas together stay within ``delta_max_bytes``: past it the least recently used records lose
    their delta and keep their worker (a follow-up still reaches it, routed on load). A walk renews what
    it visits; a delete or a replacement gives its bytes back."""
    turn = ["x" * 96]  # 102 bytes of JSON
    store = await make(delta_max_bytes=350)
    for i in range(3):
        await store.put(f"r{i}", {"worker": f"w{i}", "parent": None, "delta": turn})
    assert [(await store.get(f"r{i}"))["delta"] for i in range(3)] == [turn] * 3  # 306 bytes
    await store.chain("r0", 10)  # r0 used again: r1 is now the least recently used
    await store.put("r3", {"worker": "w3", "parent": None, "delta": turn})  # 408 > 350
    recs = [await store.get(f"r{i}") for i in range(4)]
    assert [r["worker"] for r in recs] == ["w0", "w1", "w2", "w3"]  # every owner kept
    assert [r["delta"] is None for r in recs] == [False, True, False, False]
    await store.delete("r0")
    await store.put("r3", {"worker": "w3", "parent": None, "delta": None})  # 102 bytes in use now
    await store.put("r4", {"worker": "w4", "parent": None, "delta": turn})
    await store.put("r5", {"worker": "w5", "parent": None, "delta": turn})
    assert [(await store.get(f"r{i}"))["delta"] is None for i in (2, 4, 5)] == [False, False, False]


async def test_redis_replicas_share_owners(redis_server):
    a = create_owners(IndexConfig(backend="redis", redis_url=redis_server, key_prefix="t16b"), 60, 10)
    b = create_owners(IndexConfig(backend="redis", redis_url=redis_server, key_prefix="t16b"), 60, 10)
    try:
        await a.put("resp_x", {"worker": "vllm-1", "model": "m", "parent": None, "delta": None})
        assert await b.get("resp_x") == {"worker": "vllm-1", "model": "m", "parent": None, "delta": None}
    finally:
        await a.close()
        await b.close()
