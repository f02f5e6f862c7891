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


async def test_a_stale_writer_is_fenced_off_after_redis_lost_its_data(redis_url):
    """A fencing token was a count alone: after Redis came back empty (no persistence, a failover that lost
    the key) it started again at 1, equal to the stale holder's token, and that holder's writes passed the
    fence. The token names its holder now."""
    a, b = RedisIndex(redis_url, key_prefix="fl"), RedisIndex(redis_url, key_prefix="fl")
    try:
        assert await a.acquire_lease(M, "w1", "gw-a", ttl_s=30)
        await a.store(M, "w1", Tier.GPU, H[:2])
        await a._r.flushall()  # the test's redis-server keeps nothing on disk: a restart without persistence
        assert await b.acquire_lease(M, "w1", "gw-b", ttl_s=30)
        await b.store(M, "w1", Tier.GPU, H)
        with pytest.raises(LeaseLost):
            await a.store(M, "w1", Tier.GPU, H[:1])
        with pytest.raises(LeaseLost):
            await a.clear_worker(M, "w1")
        assert (await b.lookup(M, H)).match("w1").gpu == 4
    finally:
        await a.close()
        await b.close()


async def test_a_gateway_without_the_lease_cannot_clear_the_holders_entries(redis_url):
    """Every gateway's registry clears a worker it sees restart; the lease holder's ingestor also resets and
    rebuilds on its own. Unfenced, a non-holder's clear could land after that rebuild and wipe it (the
    holder's state then counted blocks the index no longer had). Without a lease a clear goes through only
    while nobody holds one."""
    a, b = RedisIndex(redis_url, key_prefix="nf"), RedisIndex(redis_url, key_prefix="nf")
    try:
        assert await a.acquire_lease(M, "w1", "gw-a", ttl_s=30)
        await a.store(M, "w1", Tier.GPU, H)
        with pytest.raises(LeaseLost):
            await b.clear_worker(M, "w1")
        assert (await a.lookup(M, H)).match("w1").gpu == 4
        await a.store(M, "w1", Tier.GPU, H[:1])  # b's refusal did not fence a
        await a.release_lease(M, "w1", "gw-a")
        assert await b.clear_worker(M, "w1") == 4  # nobody holds it: the clear goes through
        assert (await a.lookup(M, H)).match("w1").gpu == 0
    finally:
        await a.close()
        await b.close()


async def test_releasing_a_lapsed_lease_leaves_the_owner_that_took_it_over(redis_url):
    """A gateway releasing a lease read its holder, then deleted the key: when its lease lapsed and another
    gateway took it between the two, that gateway's lease went (a third could take the worker, the sweep saw
    it idle). The race is forced: right after the release's first call to Redis, a's lease lapses and b
    takes it."""
    a, b, c = (RedisIndex(redis_url, key_prefix="rl") for _ in range(3))
    try:
        assert await a.acquire_lease(M, "w1", "gw-a", ttl_s=30)
        key = a.base(M) + "lease:w1"
        run = a._r.execute_command
        raced = []

        async def call_then_b_takes_over(*args, **kw):
            out = await run(*args, **kw)
            if not raced:
                raced.append(1)
                await b._r.delete(key)  # a's lease lapses ...
                assert await b.acquire_lease(M, "w1", "gw-b", ttl_s=30)  # ... and b takes it
            return out

        a._r.execute_command = call_then_b_takes_over
        await a.release_lease(M, "w1", "gw-a")
        assert raced
        assert await b._r.get(key) == b"gw-b"
        assert not await c.acquire_lease(M, "w1", "gw-c", ttl_s=30)
    finally:
        for idx in (a, b, c):
            await idx.close()


@pytest.mark.parametrize("same_gateway", [False, True])
async def test_a_sweep_racing_a_new_writer_leaves_what_the_writer_pushed(redis_url, same_gateway):
    """The sweep checks that nobody holds an idle worker's lease, then drops its entries, map and recorded
    engine process. A gateway that takes the lease and pushes its map (with the process) between the two
    keeps them: the drop is fenced like the entries' (before, the map went whenever no entry was stored
    yet, and the recorded process always: a third gateway then adopted that map for any process). The race
    is forced: the writer acts right after the sweep's lease check. When the writer is the sweeping
    gateway itself (its ingestor took the lease meanwhile), the refused sweep leaves its lease alone: it
    goes on writing."""
    w = RedisIndex(redis_url, key_prefix=f"sw{int(same_gateway)}")
    s = w if same_gateway else RedisIndex(redis_url, key_prefix="sw0")
    try:
        assert await w.acquire_lease(M, "w1", "gw-old", ttl_s=0.1)
        await asyncio.sleep(0.25)  # the old writer's lease lapsed: w1 is idle
        check = s._r.exists
        raced = []

        async def exists_then_writer_acts(*keys):
            n = await check(*keys)
            if not raced:
                raced.append(1)
                assert await w.acquire_lease(M, "w1", "gw-new", ttl_s=30)
                await w.save_handles(M, "w1", {(0, 1): (H[0], 1, 0)}, [], seq=7, replace=True,
                                     incarnation="300.5")
            return n

        s._r.exists = exists_then_writer_acts
        assert await s.sweep(M, idle_s=0.1) == []
        assert raced
        assert await s.load_handles(M, "w1") == ({(0, 1): (H[0], 1, 0)}, 7)
        assert await s.incarnation(M, "w1") == "300.5"
        await w.save_handles(M, "w1", {(0, 2): (H[1], 1, 0)}, [], seq=8)  # still the writer
    finally:
        await w.close()
        if s is not w:
            await s.close()


async def test_a_map_adopted_while_a_writer_replaces_it_is_never_torn(redis_url):
    """A gateway subscribing to a worker reads the handle map in HSCAN chunks while the worker's writer keeps
    replacing it (a new writer pushing its state) and updating it (event batches). Every snapshot read must
    be one the writer wrote, with its own sequence: a torn one started a gateway's state empty for good
    (tests/faults: two gateways, one restarted mid-run)."""
    w, r = RedisIndex(redis_url, key_prefix="t"), RedisIndex(redis_url, key_prefix="t")
    try:
        assert await w.acquire_lease(M, "w1", "gw-w", ttl_s=30)

        def version(seq: int) -> dict:  # a map whose every entry names the sequence it was written at
            return {(0, k): (seq, 1, 0) for k in range(25_000)}

        await w.save_handles(M, "w1", version(1), [], seq=1, replace=True)
        stop = asyncio.Event()

        async def write() -> None:
            seq = 1
            while not stop.is_set():
                seq += 1
                if seq % 2:
                    await w.save_handles(M, "w1", version(seq), [], seq=seq, replace=True)
                else:  # a batch: one entry moves on, the rest stay at the previous sequence
                    await w.save_handles(M, "w1", {(0, 0): (seq, 1, 0)}, [], seq=seq)
                await asyncio.sleep(0)

        writer = asyncio.create_task(write())
        try:
            for _ in range(5):
                hm, seq = await r.load_handles(M, "w1", tries=2)
                rest = {v[0] for k, v in hm.items() if k != (0, 0)}
                assert len(hm) == 25_000 and len(rest) == 1, "a torn map"
                base = rest.pop()
                assert hm[(0, 0)][0] in (base, seq) and seq in (base, base + 1), (base, hm[(0, 0)], seq)
        finally:
            stop.set()
            await writer
    finally:
        await w.close()
        await r.close()


async def test_replacing_a_large_handle_map_never_holds_redis_for_long(redis_url):
    """``save_handles(replace=True)`` (a writer pushing its state back) ran as one Lua script over the whole
    map, about 3.5 s at 2M handles, and Redis served no other client meanwhile (every gateway's lookups
    and lease renewals of the fleet waited). The map is now written in bounded chunks beside the old one and
    swapped in by one short fenced script. Counted in handles per script call (the work one call does),
    not in Redis's time: the host is shared."""
    from indexer.index.redis import _HANDLE_CHUNK, _HREC

    w = RedisIndex(redis_url, key_prefix="t")
    n = 300_000
    try:
        assert await w.acquire_lease(M, "w1", "gw-w", ttl_s=30)
        await w.save_handles(M, "w1", {(0, k): (k, 1, 0) for k in range(n)}, [], seq=1, replace=True)
        script, per_call = w._save_h, []

        async def counted(keys, args):
            per_call.append(len(args[5]) // _HREC.itemsize)  # the handles this call writes
            return await script(keys, args)

        w._save_h = counted
        await w.save_handles(M, "w1", {(1, k): (k, 0, 1) for k in range(n)}, [], seq=2, replace=True,
                             incarnation="9.5")
        w._save_h = script
        assert sum(per_call) == n and max(per_call) <= _HANDLE_CHUNK, per_call[:3]
        hm, seq = await w.load_handles(M, "w1")
        assert seq == 2 and len(hm) == n and hm[(1, 7)] == (7, 0, 1) and (0, 7) not in hm
        assert await w.incarnation(M, "w1") == "9.5"
        assert not [k async for k in w._r.scan_iter(match="t:*tmp*")]  # no temporary map left behind
        # a writer fenced off meanwhile swaps nothing in, and leaves nothing behind
        other = RedisIndex(redis_url, key_prefix="t")
        try:
            await w._r.delete("t:{m}:lease:w1")
            assert await other.acquire_lease(M, "w1", "gw-o", ttl_s=30)
        finally:
            await other.close()
        with pytest.raises(LeaseLost):
            await w.save_handles(M, "w1", {(2, k): (k, 1, 0) for k in range(n)}, [], seq=3, replace=True)
        assert (await w.load_handles(M, "w1"))[1] == 2
        assert not [k async for k in w._r.scan_iter(match="t:*tmp*")]
    finally:
        await w.close()
