"""Redis restarted under the event stream (real redis-server, killed with SIGKILL, with and without
persistence): no source resets, the exact per-worker state is pushed back, and the index then holds
exactly what the worker holds -- also for a worker that had nothing to write during the outage."""
from __future__ import annotations

import pytest

from indexer.index.redis import RedisIndex
from tests.events.test_ingestor import SEQ, Rig, blk, removed, until
from tests.support.redis_proc import RedisProc


@pytest.mark.parametrize("persistence", [False, True])
@pytest.mark.parametrize("writes_during_outage", [False, True])
async def test_redis_restart_pushes_the_exact_state_back(persistence, writes_during_outage):
    redis = RedisProc(persistence=persistence).start()
    index = RedisIndex(redis.url, timeout_s=0.3)
    try:
        async with Rig(index, retry_s=0.1) as r:
            r.pub.publish([blk(0, 4)])
            await r.wait_seq(0)
            assert await r.gpu_run() == 4
            pushes = r.ing.status("w1")["pushes"]
            redis.kill()
            if writes_during_outage:
                r.pub.publish([removed(3), blk(3, 1), blk(4, 2)])  # applied to the state only
                await until(lambda: not r.ing.status("w1")["synced"], what="unsynced")
                await r.wait_seq(1)
            redis.start()
            await until(lambda: r.ing.status("w1")["synced"] and r.ing.status("w1")["pushes"] > pushes,
                        what="state pushed back")
            want = 6 if writes_during_outage else 4
            await until(r.gpu_run, what="entries back")
            assert await r.gpu_run() == want
            st = r.ing.status("w1")
            assert st["resets"] == 0 and st["unknown_parent"] == 0
            assert sorted(r.ing.held("w1")["GPU"]) == sorted(SEQ[:want])
            # No orphans: Redis holds exactly what the state holds.
            stats = (await index.stats("m"))["m"]
            assert stats["workers"]["w1"]["GPU"] == want and stats["blocks"] == want
            r.pub.publish([blk(want, 1)])  # and the stream goes on
            await r.wait_seq(2 if writes_during_outage else 1)
            assert await r.gpu_run() == want + 1
    finally:
        await index.close()
        redis.close()
