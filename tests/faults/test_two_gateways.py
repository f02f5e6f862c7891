"""Two gateway processes on one real redis-server, one worker's event stream: one writer (the lease
holder), the other follows; the writer is killed mid-run, the follower takes over, the killed one comes
back as a new process (it adopts the handle map from Redis). After each step Redis holds exactly what the
worker holds -- no phantom entries, including BlockRemoved of blocks stored before the new process
started."""
from __future__ import annotations

import asyncio

from indexer.events import EventIngestor, EventSource
from bench.sim import vllm_format as vf
from indexer.index.redis import RedisIndex
from tests.events.test_ingestor import B, M, SEQ, blk, removed, until
from tests.support.procs import free_port


def ingestor(redis_url: str, owner: str) -> EventIngestor:
    return EventIngestor(RedisIndex(redis_url, key_prefix="two"), owner=owner, lease_ttl_s=0.6, retry_s=0.05)


async def held_in_redis(index: RedisIndex) -> set[int]:
    """Block numbers Redis says w1 holds on GPU; every entry of w1 must be one of the test's blocks."""
    held = {i for i, h in enumerate(SEQ) if "w1" in (await index.locate(M, h)).workers}
    n = (await index.stats(M)).get(M, {"workers": {}})["workers"].get("w1", {}).get("GPU", 0)
    assert n == len(held), f"{n} entries for w1, {len(held)} of them known blocks: phantoms"
    return held


async def settled(index, want: set[int]) -> None:
    await until(lambda: _eq(index, want), what=f"Redis holds {sorted(want)}")


async def _eq(index, want):
    return await held_in_redis(index) == want


async def test_one_writer_takeover_and_a_late_process(redis_url):
    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}", topic="kv")
    src = EventSource("w1", M, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", block_size=B)
    a, b = ingestor(redis_url, "gw-a"), ingestor(redis_url, "gw-b")
    c = None
    check = RedisIndex(redis_url, key_prefix="two")
    try:
        await a.start()
        await a.add_source(src)
        await b.start()
        await b.add_source(src)
        assert a.status("w1")["writer"] and not b.status("w1")["writer"]
        await until(lambda: a.status("w1")["connected"] and b.status("w1")["connected"])
        assert await asyncio.to_thread(pub.wait_subscribed)
        await asyncio.sleep(0.2)  # both SUB sockets subscribed
        pub.publish([blk(0, 4)])
        await until(lambda: b.status("w1")["last_seq"] == 0 and a.status("w1")["last_seq"] == 0)
        await settled(check, {0, 1, 2, 3})
        # The writer dies without releasing its lease (tasks gone, no clean-up).
        sa = a._sources.pop("w1")
        for t in sa.tasks:
            t.cancel()
        a._watch.cancel()
        sa.sub.close()
        pub.publish([removed(3), blk(3, 2)])  # only b sees it; b takes over when the lease expires
        await until(lambda: b.status("w1")["writer"] and b.status("w1")["synced"], what="takeover")
        await until(lambda: b.status("w1")["last_seq"] == 1)
        await settled(check, {0, 1, 2, 3, 4})
        # The killed gateway comes back as a new process: it adopts the map b saved and follows.
        c = ingestor(redis_url, "gw-c")
        await c.start()
        await c.add_source(src)
        assert not c.status("w1")["writer"] and c.status("w1")["last_seq"] == 1 and c.status("w1")["handles"] == 5
        await until(lambda: c.status("w1")["connected"])
        await asyncio.sleep(0.2)
        # b leaves cleanly; c takes over and must remove blocks stored before it started.
        await b.stop()
        await until(lambda: c.status("w1")["writer"] and c.status("w1")["synced"], what="c takes over")
        pub.publish([removed(4), removed(2)])
        await until(lambda: c.status("w1")["last_seq"] == 2)
        await settled(check, {0, 1, 3})
        st = c.status("w1")
        assert st["unknown_parent"] == 0 and st["resets"] == 0
        assert sorted(c.held("w1")["GPU"]) == sorted(SEQ[i] for i in (0, 1, 3))
        assert (await check.load_handles(M, "w1"))[1] == 2
    finally:
        for ing in (b, c):
            if ing is not None:
                await ing.stop()
        await a.stop()
        for ing in (a, b, c):
            if ing is not None:
                await ing.index.close()
        await check.close()
        pub.close()
