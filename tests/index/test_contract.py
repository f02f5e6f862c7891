"""The BlockIndex contract, identical for every backend (see indexer/index/base.py)."""
from __future__ import annotations

import pytest

from indexer.hashing import sequence_hashes
from indexer.index import Tier, WorkerMatch, create_index
from indexer.index.memory import MemoryIndex

M = "model-a"
H = sequence_hashes(list(range(16 * 8)), 16)  # 8 chained hashes, several >= 2**63
GPU, CPU = Tier.GPU, Tier.CPU


def test_hashes_cover_the_unsigned_range():
    assert any(h >= 2**63 for h in H) and any(h < 2**63 for h in H)


async def test_store_is_idempotent_and_lookup_counts_leading_run(index):
    await index.store(M, "w1", GPU, H[:5])
    await index.store(M, "w1", GPU, H[:5])
    res = await index.lookup(M, H)
    assert res.num_blocks == 8
    assert res.match("w1") == WorkerMatch(gpu=5, cpu=0, local=5)
    assert res.g4 == 0
    st = (await index.stats(M))[M]
    assert st["workers"]["w1"] == {"GPU": 5}
    assert st["blocks"] == 5


async def test_remove_is_idempotent_and_breaks_the_run(index):
    await index.store(M, "w1", GPU, H)
    await index.remove(M, "w1", GPU, [H[3]])
    await index.remove(M, "w1", GPU, [H[3], 12345])  # already gone / unknown: ignored
    await index.remove(M, "nobody", GPU, [H[0]])
    assert (await index.lookup(M, H)).match("w1").gpu == 3
    assert (await index.stats(M))[M]["workers"]["w1"] == {"GPU": 7}


async def test_leading_run_is_per_tier_and_local_is_either(index):
    # GPU holds 0..2, CPU holds 2..5: gpu run 3, cpu run 0 (block 0 missing), local run 6.
    await index.store(M, "w1", GPU, H[0:3])
    await index.store(M, "w1", CPU, H[2:6])
    # w2 on CPU only, with a hole at 4
    await index.store(M, "w2", CPU, H[0:4] + H[5:8])
    res = await index.lookup(M, H)
    assert res.match("w1") == WorkerMatch(gpu=3, cpu=0, local=6)
    assert res.match("w2") == WorkerMatch(gpu=0, cpu=4, local=4)


async def test_worker_without_the_first_block_has_no_match(index):
    await index.store(M, "w1", GPU, H[1:])
    res = await index.lookup(M, H)
    assert "w1" not in res.workers and res.match("w1") == WorkerMatch()


async def test_g4_run_is_model_wide(index):
    await index.store_g4(M, H[:6])
    await index.store(M, "w1", GPU, H[:2])
    res = await index.lookup(M, H)
    assert res.g4 == 6
    assert res.match("w1").gpu == 2
    await index.remove_g4(M, [H[2]])
    assert (await index.lookup(M, H)).g4 == 2
    # G4 survives the removal of every worker
    await index.clear_worker(M, "w1")
    assert (await index.lookup(M, H)).g4 == 2


async def test_g4_continues_after_workers_stop(index):
    await index.store(M, "w1", GPU, H[:1])
    await index.store_g4(M, H)
    res = await index.lookup(M, H)
    assert res.g4 == 8 and res.match("w1").gpu == 1


async def test_worker_filter(index):
    for w in ("w1", "w2", "w3"):
        await index.store(M, w, GPU, H[:4])
    res = await index.lookup(M, H, workers=["w2", "w3", "unknown"])
    assert set(res.workers) == {"w2", "w3"}
    await index.store_g4(M, H[:2])
    res = await index.lookup(M, H, workers=[])
    assert res.workers == {} and res.g4 == 2
    res = await index.lookup(M, H, workers=["w1"])
    assert set(res.workers) == {"w1"} and res.g4 == 2


async def test_clear_worker_only_that_worker_and_tier(index):
    await index.store(M, "w1", GPU, H)
    await index.store(M, "w1", CPU, H[:4])
    await index.store(M, "w2", GPU, H)
    assert await index.clear_worker(M, "w1", CPU) == 4
    res = await index.lookup(M, H)
    assert res.match("w1") == WorkerMatch(gpu=8, cpu=0, local=8)
    assert await index.clear_worker(M, "w1") == 8
    res = await index.lookup(M, H)
    assert "w1" not in res.workers
    assert res.match("w2").gpu == 8
    assert await index.clear_worker(M, "w1") == 0
    assert await index.clear_worker(M, "never-seen") == 0
    loc = await index.locate(M, H[0])
    assert loc.workers == {"w2": frozenset({GPU})}


async def test_clear_model_and_models(index):
    await index.store(M, "w1", GPU, H)
    await index.store_g4(M, H[:2])
    await index.store("model-b", "w1", GPU, H[:3])
    assert await index.models() == ["model-a", "model-b"]
    assert await index.clear_model(M) == 10
    assert (await index.lookup(M, H)).workers == {}
    assert (await index.lookup(M, H)).g4 == 0
    assert await index.models() == ["model-b"]
    assert (await index.lookup("model-b", H)).match("w1").gpu == 3
    # a cleared model can be filled again
    await index.store(M, "w1", CPU, H[:1])
    assert (await index.lookup(M, H)).match("w1").cpu == 1


async def test_models_are_namespaces(index):
    await index.store(M, "w1", GPU, H)
    assert (await index.lookup("model-b", H)).workers == {}
    await index.clear_worker("model-b", "w1")
    assert (await index.lookup(M, H)).match("w1").gpu == 8


async def test_locate(index):
    await index.store(M, "w1", GPU, H[:2])
    await index.store(M, "w1", CPU, H[:1])
    await index.store(M, "w2", CPU, H[:1])
    await index.store_g4(M, H[1:2])
    loc = await index.locate(M, H[0])
    assert loc.workers == {"w1": frozenset({GPU, CPU}), "w2": frozenset({CPU})}
    assert loc.g4 is False
    loc = await index.locate(M, H[1])
    assert loc.workers == {"w1": frozenset({GPU})} and loc.g4 is True
    loc = await index.locate(M, 42)
    assert loc.workers == {} and loc.g4 is False


async def test_stats(index):
    await index.store(M, "w1", GPU, H[:4])
    await index.store(M, "w2", GPU, H[:2])
    await index.store(M, "w2", CPU, H[:3])
    await index.store_g4(M, H[:6])
    st = (await index.stats())[M]
    assert st["blocks"] == 6
    assert st["entries_per_tier"] == {"GPU": 6, "CPU": 3}
    assert st["g4_blocks"] == 6
    assert st["workers"] == {"w1": {"GPU": 4}, "w2": {"GPU": 2, "CPU": 3}}
    assert await index.stats("nothing-here") == {}


async def test_empty_lookup(index):
    res = await index.lookup(M, [])
    assert res.num_blocks == 0 and res.workers == {} and res.g4 == 0
    res = await index.lookup("no-model", H)
    assert res.num_blocks == 8 and res.workers == {}


async def test_an_empty_store_or_remove_changes_nothing(index):
    await index.store(M, "w1", GPU, H[:2])
    await index.store(M, "w9", GPU, [])
    await index.store_g4("model-z", [])
    await index.remove(M, "w1", GPU, [])
    assert await index.models() == [M]
    assert (await index.stats())[M]["workers"] == {"w1": {"GPU": 2}}
    if isinstance(index, MemoryIndex):  # no holder bits set aside for a worker that stored nothing
        assert "w9" not in index._models[M].ids and "model-z" not in index._models


async def test_huge_prompt_many_workers(index):
    hashes = sequence_hashes(list(range(8192 * 16)), 16)
    assert len(hashes) == 8192
    await index.store(M, "full", GPU, hashes)
    await index.store(M, "half", CPU, hashes[:4096])
    for i in range(20):
        await index.store(M, f"short{i}", GPU, hashes[: i + 1])
    await index.store_g4(M, hashes[:7000])
    res = await index.lookup(M, hashes)
    assert res.match("full").gpu == 8192
    assert res.match("half") == WorkerMatch(gpu=0, cpu=4096, local=4096)
    assert res.match("short19").gpu == 20
    assert res.g4 == 7000
    assert await index.clear_worker(M, "full") == 8192
    assert (await index.stats(M))[M]["workers"]["half"] == {"CPU": 4096}


def test_create_index_factory():
    from router.config import IndexConfig

    assert isinstance(create_index(IndexConfig()), MemoryIndex)
    with pytest.raises(ValueError):
        create_index(type("S", (), {"backend": "nope"})())


async def test_create_redis_index_and_prefix_isolation(redis_url):
    from indexer.index.redis import RedisIndex
    from router.config import IndexConfig

    a = create_index(IndexConfig(backend="redis", redis_url=redis_url, key_prefix="a"))
    b = RedisIndex(redis_url, key_prefix="b")
    try:
        assert isinstance(a, RedisIndex)
        await a.store(M, "w1", GPU, H)
        assert (await b.lookup(M, H)).workers == {}
        assert await b.models() == []
        # a second gateway process with the same prefix sees the same index
        a2 = RedisIndex(redis_url, key_prefix="a")
        assert (await a2.lookup(M, H)).match("w1").gpu == 8
        await a2.remove(M, "w1", GPU, H[4:5])
        assert (await a.lookup(M, H)).match("w1").gpu == 4
        await a2.close()
    finally:
        await a.close()
        await b.close()


async def test_redis_survives_script_flush(redis_url):
    """After SCRIPT FLUSH (or a Redis restart) EVALSHA answers NOSCRIPT and the index falls back to EVAL."""
    from indexer.index.redis import RedisIndex

    idx = RedisIndex(redis_url)
    try:
        await idx.store(M, "w1", GPU, H)
        await idx._r.script_flush()
        assert (await idx.lookup(M, H)).match("w1").gpu == 8
    finally:
        await idx.close()


async def test_redis_timeout_is_an_error_not_a_hang():
    """A Redis that never answers: the configured timeout turns into an exception."""
    import socket

    from redis.exceptions import RedisError

    from indexer.index.redis import RedisIndex

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    idx = RedisIndex(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    try:
        with pytest.raises(RedisError):
            await idx.lookup(M, H)
    finally:
        await idx.close()
        srv.close()


async def test_extreme_hash_values_round_trip_through_clear(index):
    """The Redis scripts split hashes into bucket + 53-bit member in Lua doubles: edges must survive."""
    edge = [0, 1, 2**11 - 1, 2**11, 2**53 - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
    await index.store(M, "w1", GPU, edge)
    await index.store(M, "w2", GPU, edge[:3])
    await index.store_g4(M, edge)
    for h in edge:
        assert (await index.locate(M, h)).workers["w1"] == frozenset({GPU})
    assert (await index.lookup(M, edge)).match("w1").gpu == len(edge)
    assert await index.clear_worker(M, "w1") == len(edge)
    for h in edge:
        assert "w1" not in (await index.locate(M, h)).workers
    assert (await index.lookup(M, edge)).match("w2").gpu == 3
    assert (await index.lookup(M, edge)).g4 == len(edge)
    st = (await index.stats(M))[M]
    assert st["workers"] == {"w2": {"GPU": 3}} and st["blocks"] == len(edge)


# -- handle maps, leases, sweep: what lets any gateway apply any BlockRemoved, with one writer per worker --

async def test_handle_map_round_trip_and_clear(index):
    ups = {(0, 2**64 - 1): (H[0], 1, 0), (0, 7): (H[1], 2, 1), (3, 9): (H[2], 0, 1)}
    await index.save_handles(M, "w1", ups, [], seq=5)
    assert await index.load_handles(M, "w1") == (ups, 5)
    await index.save_handles(M, "w1", {(0, 7): (H[1], 1, 1)}, [(3, 9), (0, 12345)], seq=6)
    assert await index.load_handles(M, "w1") == ({(0, 2**64 - 1): (H[0], 1, 0), (0, 7): (H[1], 1, 1)}, 6)
    assert await index.load_handles(M, "w2") == ({}, None)
    await index.store(M, "w1", GPU, H[:2])
    await index.clear_worker(M, "w1", GPU)  # one tier: the map stays
    assert (await index.load_handles(M, "w1"))[1] == 6
    await index.clear_worker(M, "w1")
    assert await index.load_handles(M, "w1") == ({}, None)


async def test_a_replaced_handle_map_holds_only_the_new_entries(index):
    await index.save_handles(M, "w1", {(0, 1): (H[0], 1, 0), (0, 2): (H[1], 1, 0)}, [], seq=5)
    await index.save_handles(M, "w1", {(0, 3): (H[2], 0, 1)}, [], seq=9, replace=True)
    assert await index.load_handles(M, "w1") == ({(0, 3): (H[2], 0, 1)}, 9)


async def test_a_large_replaced_handle_map_holds_only_the_new_entries(index):
    """The same for maps past one Redis write (written in chunks and swapped in: redis.py save_handles),
    on every backend; with the lease held (the writer's fencing token) and without."""
    old = {(0, k): (k, 1, 0) for k in range(25_000)}
    new = {(1, k): (k + 1, 0, 1) for k in range(25_001)}
    await index.save_handles(M, "w1", old, [], seq=5)
    await index.save_handles(M, "w1", new, [(0, 3)], seq=9, replace=True, incarnation="7.5")
    assert await index.load_handles(M, "w1") == (new, 9) and await index.incarnation(M, "w1") == "7.5"
    assert await index.acquire_lease(M, "w1", "gw-a", ttl_s=30)
    await index.save_handles(M, "w1", old, [], seq=None, replace=True)
    assert await index.load_handles(M, "w1") == (old, None) and await index.incarnation(M, "w1") == "7.5"


async def test_an_update_without_a_sequence_keeps_the_last_one_and_a_replace_drops_it(index):
    """Both backends alike: an update that knows no sequence leaves the stored one; a replace without one
    leaves none (the old sequence no longer describes the map: a gateway adopting it replays from scratch)."""
    await index.save_handles(M, "w1", {(0, 1): (H[0], 1, 0)}, [], seq=5)
    await index.save_handles(M, "w1", {(0, 2): (H[1], 1, 0)}, [], seq=None)
    assert await index.load_handles(M, "w1") == ({(0, 1): (H[0], 1, 0), (0, 2): (H[1], 1, 0)}, 5)
    await index.save_handles(M, "w1", {(0, 3): (H[2], 0, 1)}, [], seq=None, replace=True)
    assert await index.load_handles(M, "w1") == ({(0, 3): (H[2], 0, 1)}, None)


async def test_the_incarnation_is_recorded_with_the_map_per_worker_and_sweep_forgets_it(index):
    """What a gateway subscribing to a worker compares: the engine process its map was written for. Only a
    save records it (the writer's), in the same step as the map; a save without one keeps it."""
    import asyncio

    assert await index.incarnation(M, "w1") is None
    await index.save_handles(M, "w1", {(0, 1): (H[0], 1, 0)}, [], seq=3, replace=True, incarnation="100.5")
    await index.save_handles(M, "w1", {(0, 2): (H[1], 1, 0)}, [], seq=4)
    assert await index.incarnation(M, "w1") == "100.5"
    await index.save_handles(M, "w1", {}, [], seq=0, replace=True, incarnation="200.25")  # restarted
    assert await index.incarnation(M, "w1") == "200.25" and await index.load_handles(M, "w1") == ({}, 0)
    assert await index.incarnation(M, "w2") is None and await index.incarnation("other-model", "w1") is None
    await index.acquire_lease(M, "w1", "gw-a", ttl_s=0.1)
    await asyncio.sleep(0.3)
    assert "w1" in await index.sweep(M, idle_s=0.1)
    assert await index.incarnation(M, "w1") is None


async def test_lease_is_exclusive_renewable_and_released(index):
    assert await index.acquire_lease(M, "w1", "gw-a", ttl_s=30)
    assert await index.acquire_lease(M, "w1", "gw-a", ttl_s=30)  # renewal
    assert not await index.acquire_lease(M, "w1", "gw-b", ttl_s=30)
    assert await index.acquire_lease(M, "w2", "gw-b", ttl_s=30)  # per worker
    await index.release_lease(M, "w1", "gw-b")  # not the holder: no effect
    assert not await index.acquire_lease(M, "w1", "gw-b", ttl_s=30)
    await index.release_lease(M, "w1", "gw-a")
    assert await index.acquire_lease(M, "w1", "gw-b", ttl_s=30)


async def test_lease_expires(index):
    import asyncio

    assert await index.acquire_lease(M, "w1", "gw-a", ttl_s=0.1)
    await asyncio.sleep(0.25)
    assert await index.acquire_lease(M, "w1", "gw-b", ttl_s=30)
    await index.release_lease(M, "w1", "gw-a")  # the lapsed owner's release leaves the new holder's lease
    assert not await index.acquire_lease(M, "w1", "gw-c", ttl_s=30)


async def test_sweep_drops_workers_nobody_writes_for(index):
    import asyncio

    await index.acquire_lease(M, "gone", "gw-a", ttl_s=0.1)
    await index.store(M, "gone", GPU, H[:3])
    await index.save_handles(M, "gone", {(0, 1): (H[0], 1, 0)}, [], seq=1)
    await index.acquire_lease(M, "live", "gw-a", ttl_s=30)
    await index.store(M, "live", GPU, H[:2])
    assert await index.sweep(M, idle_s=0.1) == []  # "gone" still leased
    await asyncio.sleep(0.3)
    assert await index.sweep(M, idle_s=0.1) == ["gone"]
    res = await index.lookup(M, H)
    assert "gone" not in res.workers and res.match("live").gpu == 2
    assert await index.load_handles(M, "gone") == ({}, None)


async def test_workers_that_come_and_go_leave_the_others_entries_exact(index):
    """Pods come back under new names: hundreds of workers store, lose or are cleared, one after another,
    beside two that stay; every lookup still names exactly who holds what, on which tier. In memory a
    worker's slot is reused once it holds nothing, so its entries' holder bits stay as wide as the fleet."""
    await index.store(M, "stay-gpu", GPU, H[:6])
    await index.store(M, "stay-cpu", CPU, H[:3])
    for i in range(300):
        await index.store(M, f"pod-{i}", GPU if i % 2 else CPU, H[: 1 + i % 8])
        if i % 3:
            await index.clear_worker(M, f"pod-{i}")
        else:
            await index.remove(M, f"pod-{i}", GPU if i % 2 else CPU, H)
        if i % 50 == 49:
            res = await index.lookup(M, H)
            assert set(res.workers) == {"stay-gpu", "stay-cpu"}, res.workers
    await index.store(M, "new", GPU, H[:2])
    res = await index.lookup(M, H)
    assert res.match("stay-gpu") == WorkerMatch(gpu=6, cpu=0, local=6)
    assert res.match("stay-cpu") == WorkerMatch(gpu=0, cpu=3, local=3)
    assert res.match("new") == WorkerMatch(gpu=2, cpu=0, local=2)
    loc = await index.locate(M, H[1])
    assert loc.workers == {"stay-gpu": frozenset({GPU}), "stay-cpu": frozenset({CPU}), "new": frozenset({GPU})}
    if isinstance(index, MemoryIndex):
        assert max(index._models[M].ids.values()) <= 3  # slots reused: 3 workers hold something
