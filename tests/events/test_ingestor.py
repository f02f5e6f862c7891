"""End to end over real ZMQ sockets: a vLLM-shaped publisher (PUB + replay ROUTER, frames built with
structs shaped exactly like vLLM's) feeds the ingestor, which writes into each index backend."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from indexer.events import EventIngestor, EventSource, resolve_endpoint, state
from indexer.events.state import local_g4_member
from bench.sim import vllm_format as vf
from indexer.hashing import sequence_hashes
from indexer.index import Tier
from tests.support.procs import free_port

B = 16
M = "m"
TOK = list(range(1000, 1000 + 8 * B))
SEQ = sequence_hashes(TOK, B)


async def until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = cond()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def blk(i, n=1, parent=True, **kw):
    """BlockStored for blocks i..i+n-1 of TOK, engine hashes 500+i (uint64 range for some)."""
    eh = [(2**63 + 500 + j) if j % 2 else 500 + j for j in range(i, i + n)]
    par = None if i == 0 or not parent else ((2**63 + 500 + i - 1) if (i - 1) % 2 else 500 + i - 1)
    return vf.stored(eh, TOK[i * B:(i + n) * B], B, par, **kw)


def removed(i):
    return vf.BlockRemoved(block_hashes=[(2**63 + 500 + i) if i % 2 else 500 + i], medium="GPU", group_idx=0)


class Rig:
    def __init__(self, index, replay=True, **kw):
        self.index = index
        port = free_port()
        rport = free_port() if replay else None
        self.pub = vf.EventPublisher(
            f"tcp://*:{port}", f"tcp://*:{rport}" if replay else None, topic="kv@w1@m"
        )
        self.resets: list[str] = []
        self.seen: list[tuple[str, str, int]] = []
        self.ing = EventIngestor(index, on_reset=lambda w, reason: self.resets.append((w, reason)),
                                 observer=lambda w, t, h: self.seen.append((w, t, len(h))), **kw)
        self.src = EventSource("w1", M, f"tcp://*:{port}", f"tcp://*:{rport}" if replay else None,
                               topic="kv@", block_size=B, worker_url="http://127.0.0.1:8000")

    async def __aenter__(self):
        await self.ing.start()
        await self.ing.add_source(self.src)
        await until(lambda: self.ing.status("w1")["connected"], what="SUB connected")
        assert await asyncio.to_thread(self.pub.wait_subscribed), "no subscription reached the publisher"
        return self

    async def __aexit__(self, *exc):
        await self.ing.stop()
        self.pub.close()

    async def gpu_run(self):
        return (await self.index.lookup(M, SEQ)).match("w1").gpu

    async def wait_seq(self, seq):
        await until(lambda: self.ing.status("w1")["last_seq"] == seq, what=f"last_seq == {seq}")


async def subscribe(ing, pub, port: int, rport: int) -> None:
    """Subscribe ``ing`` to worker w1's publisher ``pub`` (after it published: a late subscriber)."""
    await ing.add_source(EventSource("w1", M, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"))
    await until(lambda: ing.status("w1")["connected"], what="connected")
    assert await asyncio.to_thread(pub.wait_subscribed)


def test_resolve_endpoint():
    assert resolve_endpoint("tcp://*:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", "http://vllm-0.svc:8000/v1") == "tcp://vllm-0.svc:5557"
    assert resolve_endpoint("tcp://*:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert resolve_endpoint("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"  # a bare host
    assert resolve_endpoint("tcp://host:1", "http://h:8000") == "tcp://host:1"
    assert resolve_endpoint(None, "http://h:8000") is None
    assert resolve_endpoint("tcp://10.0.0.9:5557", "http://10.1.2.3:8000") == "tcp://10.0.0.9:5557"
    assert resolve_endpoint("ipc:///tmp/kv", "http://h:1") == "ipc:///tmp/kv"
    assert resolve_endpoint("tcp://*:5557", None) == "tcp://*:5557"


async def test_events_reach_the_index(index):
    async with Rig(index) as r:
        r.pub.publish([blk(0, 3)])
        r.pub.publish([blk(3, 2), vf.stored([9], [], 0, medium="CPU")])  # a placeholder for an unknown hash
        await until(lambda: r.gpu_run(), what="blocks indexed")
        await r.wait_seq(1)
        assert await r.gpu_run() == 5
        st = r.ing.status("w1")
        assert st["applied"] == 3 and st["gaps"] == 0 and st["dropped"] == 0 and st["unmapped"] == 1
        assert ("w1", "GPU", 3) in r.seen
        # eviction of block 2 cuts the run
        r.pub.publish([removed(2)])
        await r.wait_seq(2)
        assert await r.gpu_run() == 2
        # G4 (STORAGE) and CPU tiers
        r.pub.publish([blk(0, 4, medium="STORAGE"), blk(0, 1, medium="CPU")])
        await r.wait_seq(3)
        res = await index.lookup(M, SEQ)
        assert res.g4 == 4 and res.match("w1").cpu == 1
        # AllBlocksCleared clears the worker's local tiers, not G4
        r.pub.publish([vf.AllBlocksCleared()])
        await r.wait_seq(4)
        res = await index.lookup(M, SEQ)
        assert "w1" not in res.workers and res.g4 == 4


async def test_duplicate_store_refcount_end_to_end(index):
    async with Rig(index) as r:
        r.pub.publish([blk(0, 2)])
        r.pub.publish([blk(0, 2)])  # the same blocks cached twice
        r.pub.publish([removed(1)])
        await r.wait_seq(2)
        assert await r.gpu_run() == 2
        r.pub.publish([removed(1)])
        await r.wait_seq(3)
        assert await r.gpu_run() == 1


async def test_gap_is_filled_by_replay(index):
    async with Rig(index) as r:
        r.pub.publish([blk(0, 1)])
        await r.wait_seq(0)
        r.pub.publish([blk(1, 2)], send=False)  # lost on the PUB socket, kept in the ring
        r.pub.publish([blk(3, 1)], send=False)
        r.pub.publish([blk(4, 1)])
        await r.wait_seq(3)
        st = r.ing.status("w1")
        assert st["gaps"] == 1 and st["replays"] == 1 and st["resets"] == 0
        assert st["unknown_parent"] == 0
        assert await r.gpu_run() == 5
        assert r.resets == []


async def test_unfillable_gap_clears_and_rebuilds(index):
    async with Rig(index, replay=False) as r:
        r.pub.publish([blk(0, 3)])
        await r.wait_seq(0)
        assert await r.gpu_run() == 3
        r.pub.publish([removed(0)], send=False)  # lost, and no replay endpoint
        r.pub.publish([blk(3, 1)])  # its parent is gone after the reset
        await r.wait_seq(2)
        st = r.ing.status("w1")
        assert st["gaps"] == 1 and st["resets"] == 1 and st["unknown_parent"] == 1
        assert r.resets == [("w1", "unfillable gap")]
        assert "w1" not in (await index.lookup(M, SEQ)).workers
        r.pub.publish([blk(0, 2, parent=False)])  # rebuilt from new events
        await r.wait_seq(3)
        assert await r.gpu_run() == 2


async def test_sequence_reset_clears_the_worker(index):
    async with Rig(index) as r:
        r.pub.publish([blk(0, 4)])
        r.pub.publish([blk(4, 1)])
        await r.wait_seq(1)
        assert await r.gpu_run() == 5
        r.pub.restart()  # vLLM restarted: seq starts at 0 again, its cache is empty
        r.pub.publish([blk(0, 1)])
        await r.wait_seq(0)
        await until(lambda: r.ing.status("w1")["resets"] == 1, what="reset")
        assert r.resets == [("w1", "restart")]
        assert await r.gpu_run() == 1


async def test_malformed_messages_are_dropped_and_counted(index):
    async with Rig(index) as r:
        r.pub.publish([], raw_payload=b"\xc1 garbage")
        r.pub.publish([], raw_payload=vf.msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}, 7], 0]))
        r.pub.send_raw([b"kv@w1@m", b"\x00\x01", b"x"])  # bad seq frame
        r.pub.send_raw([b"kv@w1@m"])  # one frame only
        r.pub.publish([blk(0, 2)])
        await r.wait_seq(2)
        st = r.ing.status("w1")
        assert st["dropped"] == 5 and st["gaps"] == 0
        assert await r.gpu_run() == 2


async def test_late_subscriber_replays_from_zero(index):
    """A gateway that joins after vLLM published replays the buffered batches it missed."""
    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    ing = EventIngestor(index)
    try:
        pub.publish([blk(0, 2)])
        pub.publish([blk(2, 1)])
        pub.flush()
        await subscribe(ing, pub, port, rport)
        pub.publish([blk(3, 1)])
        await until(lambda: ing.status("w1")["last_seq"] == 2, what="seq 2")
        assert (await index.lookup(M, SEQ)).match("w1").gpu == 4
        assert ing.status("w1")["replays"] == 1 and ing.status("w1")["resets"] == 0
    finally:
        await ing.stop()
        pub.close()


async def test_a_catch_up_lets_requests_run_while_it_writes_the_index_back(monkeypatch):
    """A late subscriber's catch-up writes the worker's entries back in chunks; the in-memory index stores a
    chunk without suspending, so at 2M handles the loop was held for hundreds of ms with no request served
    (found by a review). Between chunks other tasks run: here one chunk per block, and a ticker task must
    advance between two stores."""
    from indexer.events import ingestor as ing_mod
    from indexer.index.memory import MemoryIndex

    monkeypatch.setattr(ing_mod, "_PUSH_CHUNK", 1)
    monkeypatch.setattr(ing_mod, "YIELD_EVERY_S", 0.0)
    index = MemoryIndex()
    ticks, seen = [0], []
    store = index.store

    async def counted(model, worker, tier, hashes):
        seen.append(ticks[0])
        return await store(model, worker, tier, hashes)

    index.store = counted

    async def ticker():
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    ing = EventIngestor(index)
    tick = asyncio.create_task(ticker())
    try:
        pub.publish([blk(0, 4)])
        pub.publish([blk(4, 2)])
        pub.flush()
        await subscribe(ing, pub, port, rport)
        seen.clear()
        pub.publish([blk(6, 1)])  # seq 2: the catch-up replays 0-1 into the state, then writes it back
        await until(lambda: ing.status("w1")["last_seq"] == 2, what="seq 2")
        assert (await index.lookup(M, SEQ)).match("w1").gpu == 7
        rebuilt = seen[:6]  # the write-back's six one-block stores, before the live batch's
        assert len(rebuilt) == 6 and all(b > a for a, b in zip(rebuilt, rebuilt[1:])), seen
    finally:
        tick.cancel()
        await ing.stop()
        pub.close()


async def test_a_late_subscribers_replay_with_a_hole_applies_the_newest_unbroken_run(index):
    """vLLM's replay socket drops what passes its send HWM while the reader lags, so a long replay can have
    holes. A first replay then applies what follows the last hole (exact as far as it goes), not nothing:
    the worker's blocks stored after it are known at once."""
    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    ing = EventIngestor(index)
    try:
        pub.publish([blk(0, 2)], send=False)
        pub.publish([removed(1)], send=False)  # lost from the ring below
        pub.publish([blk(0, 3)], send=False)  # self-describing: block 0 has no parent
        pub.lose(1)
        await subscribe(ing, pub, port, rport)
        live = pub.publish([blk(3, 1)])  # its parent is known only from the replay
        await until(lambda: ing.status("w1")["last_seq"] == live, what="the live batch")
        assert (await index.lookup(M, SEQ)).match("w1").gpu == 4
        assert ing.status("w1")["replays"] == 1
    finally:
        await ing.stop()
        pub.close()


async def test_a_late_subscriber_never_routes_on_blocks_a_later_clear_in_its_replay_undoes(index):
    """A gateway started after a prefix-cache reset replays the publisher's ring (vLLM keeps 10,000
    batches): the blocks stored before the reset's ``AllBlocksCleared`` never show in the index, not even
    while the replay is being applied (requests are planned between its batches). Seen on real vLLM: a
    gateway started after a reset priced 27 blocks held that vLLM delivered none of."""
    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}")
    ing = EventIngestor(index)
    seen, done = 0, False

    async def watch():
        nonlocal seen
        while not done:
            seen = max(seen, (await index.lookup(M, SEQ)).match("w1").gpu)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        pub.publish([blk(0, 8)], send=False)  # the history before the reset: 8 blocks, then churn
        for _ in range(450):  # 902 batches: under the replay ROUTER's send HWM (1,000, as vLLM's)
            pub.publish([removed(7)], send=False)
            pub.publish([blk(7, 1)], send=False)
        pub.publish([vf.AllBlocksCleared()], send=False)
        pub.flush()
        await subscribe(ing, pub, port, rport)
        live = pub.publish([blk(0, 1)])
        await until(lambda: ing.status("w1")["last_seq"] == live, what="the live batch")
        assert (await index.lookup(M, SEQ)).match("w1").gpu == 1
        assert ing.status("w1")["replays"] == 1 and seen <= 1, seen
    finally:
        done = True
        await watcher
        await ing.stop()
        pub.close()


async def test_workers_do_not_block_each_other(index):
    """A worker whose replay endpoint never answers stalls only its own queue."""
    import zmq

    silent = zmq.Context()
    silent.setsockopt(zmq.LINGER, 0)
    mute = silent.socket(zmq.ROUTER)  # accepts replay requests and never answers
    mport = free_port()
    mute.bind(f"tcp://127.0.0.1:{mport}")
    p1, p2 = free_port(), free_port()
    pub1 = vf.EventPublisher(f"tcp://*:{p1}")
    pub2 = vf.EventPublisher(f"tcp://*:{p2}")
    ing = EventIngestor(index, replay_timeout_s=3.0)
    try:
        await ing.add_source(EventSource("stuck", M, f"tcp://127.0.0.1:{p1}", f"tcp://127.0.0.1:{mport}"))
        await ing.add_source(EventSource("w2", M, f"tcp://127.0.0.1:{p2}"))
        await until(lambda: ing.status("stuck")["connected"] and ing.status("w2")["connected"])
        assert await asyncio.to_thread(pub1.wait_subscribed) and await asyncio.to_thread(pub2.wait_subscribed)
        pub1.publish([blk(0, 1)], send=False)
        pub1.publish([blk(0, 1)])  # seq 1 first: replay of 0 hangs for 3 s
        await asyncio.sleep(0.3)
        pub2.publish([blk(0, 3)])
        await until(lambda: ing.status("w2")["last_seq"] == 0, what="w2 applied")
        assert ing.status("stuck")["last_seq"] is None  # still waiting on its replay
        res = await index.lookup(M, SEQ)
        assert res.match("w2").gpu == 3
        await until(lambda: ing.status("stuck")["last_seq"] == 1, what="stuck recovers after the timeout")
        assert (await index.lookup(M, SEQ)).match("stuck").gpu == 1
    finally:
        await ing.stop()
        pub1.close()
        pub2.close()
        mute.close(0)
        silent.term()


async def test_remove_source_clears(index):
    async with Rig(index) as r:
        r.pub.publish([blk(0, 2)])
        await r.wait_seq(0)
        await r.ing.remove_source("w1")
        assert "w1" not in (await index.lookup(M, SEQ)).workers
        with pytest.raises(KeyError):
            r.ing.status("w1")
        assert r.ing.statuses() == {}


async def test_index_failure_keeps_the_state_and_pushes_it_back(index):
    """Mock: an index whose writes fail for a while (the fault suite stops a real Redis; here one call
    must fail on demand). No reset: the state stays exact and is pushed back once writes succeed."""

    class Flaky:
        def __init__(self, inner):
            self.inner, self.fail = inner, True

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def store(self, *a):
            if self.fail:
                raise ConnectionError("boom")
            return await self.inner.store(*a)

        async def clear_worker(self, *a, **kw):
            if self.fail:
                raise ConnectionError("boom")
            return await self.inner.clear_worker(*a, **kw)

    flaky = Flaky(index)
    async with Rig(flaky, retry_s=0.05) as r:
        r.pub.publish([blk(0, 3)])
        await r.wait_seq(0)
        r.pub.publish([blk(3, 2), removed(4)])  # applied to the state while the index is down
        await r.wait_seq(1)
        st = r.ing.status("w1")
        assert not st["synced"] and st["resets"] == 0 and st["unknown_parent"] == 0
        flaky.fail = False
        await until(lambda: r.ing.status("w1")["synced"], what="state pushed back")
        assert await r.gpu_run() == 4
        assert sorted(r.ing.held("w1")["GPU"]) == sorted(SEQ[:4])
        assert r.resets == []


async def test_a_full_g4_backlog_counts_and_says_what_it_drops(index, caplog):
    """Mock: an index whose G4 writes fail for a while. The backlog of G4 writes kept meanwhile is bounded;
    past it the oldest write is dropped, and the index's G4 set no longer matches the files: that used to
    happen silently (no counter, no log). Now its blocks are counted and one warning says so."""

    class Flaky:
        def __init__(self, inner):
            self.inner, self.fail = inner, True

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def store_g4(self, *a):
            if self.fail:
                raise ConnectionError("boom")
            return await self.inner.store_g4(*a)

        async def clear_worker(self, *a, **kw):
            if self.fail:
                raise ConnectionError("boom")
            return await self.inner.clear_worker(*a, **kw)

    flaky = Flaky(index)
    caplog.set_level("WARNING", logger="kvgate.events")
    async with Rig(flaky, retry_s=0.05, g4_backlog=2) as r:
        for i in range(5):
            r.pub.publish([blk(i, 1, medium="STORAGE")])
        await r.wait_seq(4)
        st = r.ing.status("w1")
        assert not st["synced"] and st["g4_backlog_dropped"] == 3  # one block each, the three oldest
        full = [rec for rec in caplog.records if "G4 backlog full" in rec.getMessage()]
        assert len(full) == 1  # once per outage, not per dropped write
        flaky.fail = False
        await until(lambda: r.ing.status("w1")["synced"], what="state pushed back")
        assert (await index.lookup(M, SEQ[3:5])).g4 == 2  # the writes kept are replayed
        assert (await index.lookup(M, SEQ)).g4 == 0  # the dropped ones are missing, as counted


async def test_a_local_g4_block_past_the_storage_bound_leaves_no_phantom(index, monkeypatch):
    """A worker's own disk tier (vLLM's SimpleCPUOffload with disk: STORAGE, LOCAL) stores more blocks than
    the source keeps handles for. The oldest handle was forgotten silently, so its BlockRemoved later named
    nothing and its G4 entry stayed for good; its entry now goes when its handle does."""
    monkeypatch.setattr(state, "STORAGE_HANDLES", 2)
    local = local_g4_member("w1")

    def on_disk(ev):
        return msgspec.structs.replace(ev, medium="STORAGE", locality="LOCAL")

    async def run(blocks):
        return (await index.lookup(M, blocks)).match(local).gpu

    async with Rig(index) as r:
        for i in range(3):
            r.pub.publish([on_disk(blk(i, 1))])
        await r.wait_seq(2)
        assert (await run(SEQ[:1]), await run(SEQ[1:3])) == (0, 2)  # block 0's handle was evicted
        rm = [msgspec.structs.replace(removed(i), medium="STORAGE", locality="LOCAL") for i in (0, 1)]
        r.pub.publish(rm)
        await r.wait_seq(3)
        assert (await run(SEQ[:1]), await run(SEQ[1:2]), await run(SEQ[2:3])) == (0, 0, 1)
        st = r.ing.status("w1")
        assert st["storage_evicted"] == 1 and st["errors"] == 0


async def test_resync_after_a_flap_replays_what_was_missed(index):
    async with Rig(index) as r:
        r.pub.publish([blk(0, 2)])
        await r.wait_seq(0)
        r.pub.publish([blk(2, 2)], send=False)  # published while the worker was unreachable
        assert r.ing.resync("w1")
        await r.wait_seq(1)
        assert await r.gpu_run() == 4
        r.pub.publish([blk(4, 1)])
        await r.wait_seq(2)
        st = r.ing.status("w1")
        assert st["resyncs"] == 1 and st["replays"] == 1 and st["resets"] == 0 and st["gaps"] == 0
        assert await r.gpu_run() == 5


async def test_a_resync_after_an_unseen_restart_is_not_spliced_onto_the_old_state(index):
    """The worker restarted while it was unreachable and nothing saw it (no process start on /metrics, e.g.
    ``--api-server-count > 1``); its new process has published past our last sequence meanwhile. The resync's
    replay from ``last_seq + 1`` then returned the *new* process's batches, applied on top of the old
    process's state: the old blocks (gone with the old process) stayed indexed for good, as no later
    sequence number goes backwards. The replay now includes the last applied batch, which a restarted
    publisher does not have: a restart, so the old state is dropped and the new one replayed from 0."""
    async with Rig(index) as r:
        r.pub.publish([blk(0, 2)])
        r.pub.publish([blk(2, 2)])
        await r.wait_seq(1)
        assert await r.gpu_run() == 4
        r.pub.restart()  # unseen: its first batches were published while the worker was unreachable
        for _ in range(3):
            r.pub.publish([blk(0, 1, parent=False)], send=False)  # seq 0..2: only block 0 cached
        r.pub.flush()  # in the ring before the resync asks for it (the publisher's thread takes them in turn)
        assert r.ing.resync("w1")
        await until(lambda: r.ing.status("w1")["resyncs"] == 1, what="resync")
        await r.wait_seq(2)
        r.pub.publish([blk(1, 1)])  # live again, in order (applied once the replay is in the index)
        await r.wait_seq(3)
        assert await r.gpu_run() == 2  # spliced: 4
        assert r.resets == [("w1", "restart")] and r.ing.status("w1")["resets"] == 1


@pytest.mark.parametrize("published", [0, 2])
async def test_a_resync_after_an_unseen_restart_behind_the_last_seq_resets(index, published):
    """As above, but the new process has published less than the old one had (``published`` batches, none
    at all or seq 0..1 < ``last_seq`` 3): its ring answers nothing from ``last_seq`` on. That was read as
    "nothing published meanwhile", and the old process's blocks stayed indexed until the next live batch.
    A publisher rings every batch it sends, so the one that sent ``last_seq`` always answers with it: an
    empty answer is a restart."""
    async with Rig(index) as r:
        for i in range(4):
            r.pub.publish([blk(i, 1)])
        await r.wait_seq(3)
        assert await r.gpu_run() == 4
        r.pub.restart()
        for _ in range(published):
            r.pub.publish([blk(0, 1, parent=False)], send=False)
        r.pub.flush()
        assert r.ing.resync("w1")
        await until(lambda: r.ing.status("w1")["resyncs"] == 1, what="resync")
        await until(lambda: r.resets == [("w1", "restart")], what="restart reset")  # was: none
        want = 1 if published else 0  # the new process's ring is replayed after the reset

        async def run_is_new():
            return await r.gpu_run() == want
        await until(run_is_new, what=f"a GPU run of {want}")
        assert r.ing.status("w1")["resets"] == 1


async def test_a_gap_after_an_unseen_restart_is_not_spliced_onto_the_old_state(index):
    """The same through a gap: the subscriber missed a restarted publisher's first batches (its socket
    reconnected late) and its next live batch is past ``last_seq + 1``. Filling the gap from the new
    process's ring spliced its batches onto the old state."""
    async with Rig(index) as r:
        r.pub.publish([blk(0, 2)])
        r.pub.publish([blk(2, 2)])
        await r.wait_seq(1)
        r.pub.restart()
        for _ in range(3):
            r.pub.publish([blk(0, 1, parent=False)], send=False)  # seq 0..2, missed
        r.pub.publish([blk(1, 1)])  # seq 3: a gap after 1
        await r.wait_seq(3)
        assert await r.gpu_run() == 2
        assert r.resets == [("w1", "restart")]


async def test_restart_with_lost_first_batches_replays_them(index):
    async with Rig(index) as r:
        for i in range(4):
            r.pub.publish([blk(i, 1)])
        await r.wait_seq(3)
        r.pub.restart()
        r.pub.publish([blk(0, 2, parent=False)], send=False)  # the restarted vLLM's seq 0 is lost
        r.pub.publish([blk(2, 1)])  # seq 1 < last_seq 3: restart detected, 0 replayed
        await r.wait_seq(1)
        st = r.ing.status("w1")
        assert st["resets"] == 1 and st["replays"] == 1 and st["unknown_parent"] == 0
        assert await r.gpu_run() == 3


async def test_a_restart_with_another_block_size_is_learnt_from_the_new_process(index):
    """The source was subscribed with the old process's block size; a restart seen in the stream (its
    sequence from 0 again, vLLM without a process start on /metrics) brings another: its blocks, and their
    children, are indexed at the new size, not dropped as size mismatches."""
    async with Rig(index) as r:
        r.pub.publish([blk(0, 2)])
        r.pub.publish([blk(2, 1)])
        await r.wait_seq(1)
        r.pub.restart()
        b2 = 2 * B
        r.pub.publish([vf.stored([900, 901], TOK[:2 * b2], b2, None)])  # seq 0 < 1: a restart
        r.pub.publish([vf.stored([902], TOK[2 * b2:3 * b2], b2, 901)])
        await until(lambda: r.ing.status("w1")["resets"] == 1, what="the restart")
        await until(lambda: r.ing.status("w1")["queued"] == 0 and r.ing.status("w1")["applied"] >= 4,
                    what="both batches applied")
        st = r.ing.status("w1")
        assert st["size_mismatch"] == 0 and st["unknown_parent"] == 0
        assert (await index.lookup(M, sequence_hashes(TOK, b2))).match("w1").gpu == 3
        assert (await index.lookup(M, SEQ)).match("w1").gpu == 0

async def test_stop_closes_every_source_when_the_index_is_gone(index):
    """Mock: an index whose lease release fails (Redis already stopped when the gateway stops; the fault
    suite kills a real one, here it must fail on demand). stop() still closes every source: before, the
    first failure ended it, and the other sources' tasks were left pending on a loop that was closed."""

    class Gone:
        def __init__(self, inner):
            self.inner = inner

        async def release_lease(self, *a, **kw):
            raise ConnectionError("index unreachable")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    ports = [free_port(), free_port()]
    pubs = [vf.EventPublisher(f"tcp://*:{p}") for p in ports]
    ing = EventIngestor(Gone(index))
    try:
        for i, p in enumerate(ports):
            await ing.add_source(EventSource(f"w{i}", M, f"tcp://127.0.0.1:{p}"))
        tasks = [t for s in ing._sources.values() for t in s.tasks]
        assert len(tasks) == 4
        await ing.stop()
        assert ing.statuses() == {} and all(t.done() for t in tasks)
    finally:
        for pub in pubs:
            pub.close()


async def test_stop_returns_when_the_index_client_swallows_a_cancel(index):
    """Mock: an index whose call swallows the CancelledError (what redis-py did mid-command, and what
    Python 3.11's wait_for does when the cancel lands as the inner call completes). stop() used to cancel
    the index-watch task once and wait for it for ever: the suite hung 300 s in stop() twice."""
    entered = asyncio.Event()

    class Swallows:
        def __init__(self, inner):
            self.inner = inner

        async def models(self):
            entered.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return []
            return []

        def __getattr__(self, name):
            return getattr(self.inner, name)

    ing = EventIngestor(Swallows(index), sweep_interval_s=0.0, retry_s=0.05)
    await ing.start()
    await asyncio.wait_for(entered.wait(), 10)
    await asyncio.wait_for(ing.stop(), 20)  # a hang detector, not a timing bound
    assert ing._watch is None


async def test_gateways_subscribing_after_a_restart_adopt_nothing_until_the_writer_replaced_the_map(index):
    """A worker restarted while no gateway watched; two gateways subscribe to the new process (a whole
    deployment restarted over a Redis that kept its data). Neither may adopt the old process's map and
    sequence: the new process counts from 0 again, so an adopted sequence 40 makes its first batches read
    as applied and the state misses them. Before the fix the first gateway recorded the new process at
    subscription, so the second one, a moment later and before anyone replaced the map, adopted it. A third
    owner holds the lease here so that no writer replaces the map meanwhile (the race, held open); once a
    subscribed gateway writes, it records the new process with the map it pushes, and a later gateway
    adopts that."""
    await index.save_handles(M, "w1", {(0, 999): (SEQ[6], 1, 0)}, [], seq=40, replace=True, incarnation="old")
    await index.store(M, "w1", Tier.GPU, SEQ[6:8])
    assert await index.acquire_lease(M, "w1", "gw-x", ttl_s=60)
    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}", topic="kv@w1@m")
    ings = [EventIngestor(index, lease_ttl_s=0.6) for _ in range(3)]

    def source():
        return EventSource("w1", M, f"tcp://*:{port}", f"tcp://*:{rport}", topic="kv@", block_size=B,
                           worker_url="http://127.0.0.1:8000", incarnation="new")

    try:
        for ing in ings[:2]:
            await ing.add_source(source())
            await until(lambda: ing.status("w1")["connected"], what="SUB connected")
            assert ing.status("w1")["resets"] == 1 and not ing.status("w1")["writer"]
        await asyncio.to_thread(pub.wait_subscribed)
        await asyncio.sleep(0.3)  # both subscriptions reach the publisher
        pub.publish([blk(0, 2)])  # the new process's first batch, seq 0
        for ing in ings[:2]:
            await until(lambda: len(ing.held("w1")["GPU"]) == 2, what="the new process's blocks in the state")
        await ings[1].stop()  # one contender for the lease (the ingestors share one index client here)
        await index.release_lease(M, "w1", "gw-x")

        async def recorded():
            return await index.incarnation(M, "w1") == "new"

        await until(recorded, what="the writer recorded the new process with its map")
        assert ings[0].status("w1")["writer"]
        await ings[2].add_source(source())
        assert ings[2].status("w1")["resets"] == 0 and len(ings[2].held("w1")["GPU"]) == 2
        assert (await index.stats(M))[M]["workers"] == {"w1": {"GPU": 2}}  # the old process's are gone
    finally:
        for ing in ings:
            await ing.stop()
        pub.close()


async def test_a_gateway_that_cannot_tell_the_process_adopts_nothing_recorded_for_one(index):
    """The first scrape failed, or the worker is down (the registry then subscribes without a process
    start): a map recorded for a process cannot be checked against this one, so it is not adopted. Once the
    registry reads the start, the writer pushes its state again with it recorded, so later gateways adopt."""
    await index.save_handles(M, "w1", {(0, 999): (SEQ[6], 1, 0)}, [], seq=40, replace=True, incarnation="old")
    await index.store(M, "w1", Tier.GPU, SEQ[6:8])
    async with Rig(index) as r:  # its source knows no process start
        assert r.ing.status("w1")["resets"] == 1
        r.pub.publish([blk(0, 2)])  # seq 0 of the process behind it: applied, not read as seq <= 40
        await r.wait_seq(0)
        assert (await index.stats(M))[M]["workers"] == {"w1": {"GPU": 2}}
        await r.ing.record_incarnation("w1", "new")

        async def recorded():
            return await index.incarnation(M, "w1") == "new"

        await until(recorded, what="the writer pushed its state with the process start")
        assert (await index.load_handles(M, "w1"))[1] == 0 and (await index.stats(M))[M]["blocks"] == 2


async def test_a_long_sweep_does_not_hold_up_the_lease_renewals():
    """Lease renewal and the sweep of idle workers ran one after the other: a sweep clearing idle workers
    with a million entries each (seconds in Redis) outlasted the renewal margin, this gateway's live leases
    lapsed and another gateway took them over. The sweep runs in its own task. (The slow sweep is a stand-in
    on the memory index: the timing is the point, and a million-entry Redis sweep is too long for a test.)"""
    from indexer.index.memory import MemoryIndex

    class SlowSweep(MemoryIndex):
        async def models(self):
            return [M]

        async def sweep(self, model, idle_s):
            await asyncio.sleep(1.0)
            return []

    idx = SlowSweep()
    a = EventIngestor(idx, owner="A", retry_s=0.05, lease_ttl_s=0.6, sweep_interval_s=0.1)
    try:
        await a.add_source(EventSource("w", M, f"tcp://127.0.0.1:{free_port()}", None, block_size=B))
        assert a.status("w")["writer"]
        await asyncio.sleep(0.8)  # the first sweep runs from ~0.1 s to ~1.1 s
        assert not await idx.acquire_lease(M, "w", "B", 0.6)  # A renewed meanwhile: B does not get it
    finally:
        await a.stop()


def _handles(n):
    """The handle map a writer saves for blocks 0..n-1 of TOK on the GPU (engine hashes as :func:`blk`)."""
    return {(0, (2**63 + 500 + j) if j % 2 else 500 + j): (SEQ[j], 1, 0) for j in range(n)}


async def test_an_engine_that_restarted_unseen_is_not_read_as_duplicates_of_the_adopted_map(index):
    """A map saved up to seq 40 by a gateway that is gone, for an engine that exports no process start
    (vLLM with ``--api-server-count > 1``), which restarted while no gateway watched. Its new process counts
    from 0: every live batch up to 40 used to be dropped as already applied, and the index kept the old
    process's blocks while missing the new one's. The publisher's replay ring says it has not reached 40."""
    await index.save_handles(M, "w1", _handles(2), [], seq=40, replace=True)
    await index.store(M, "w1", Tier.GPU, SEQ[:2])
    async with Rig(index) as r:
        assert len(r.ing.held("w1")["GPU"]) == 2  # adopted
        r.pub.publish([blk(0, 3)])  # seq 0 of the new process, whose cache holds three blocks
        r.pub.publish([removed(0)])
        await r.wait_seq(1)
        st = r.ing.status("w1")
        assert st["duplicates"] == 0 and st["resets"] == 1
        assert len(r.ing.held("w1")["GPU"]) == 2  # blocks 1 and 2 of the new process: nothing of the old
        assert (await index.stats(M))[M]["workers"] == {"w1": {"GPU": 2}}


async def test_live_batches_the_adopted_map_already_holds_are_duplicates(index):
    """The other side of the check above: batches the writer had applied before this gateway adopted its
    map, received live because they were published between the subscription and the adoption, are not
    applied twice (a block stored twice would outlive its one removal)."""
    async with Rig(index) as r:
        for i in range(4):  # seq 0-3: the writer applied them; this gateway never sees them live
            r.pub.publish([blk(i)], send=False)
        await r.ing.remove_source("w1", clear=False)
        # the writer's map holds seq 4 too: published live between this subscription and the adoption
        # (the publisher rings a batch before it sends it, so the ring has it when it arrives)
        await index.save_handles(M, "w1", _handles(5), [], seq=4, replace=True)
        await index.store(M, "w1", Tier.GPU, SEQ[:5])
        await r.ing.add_source(r.src)
        await until(lambda: r.ing.status("w1")["connected"], what="SUB connected")
        await asyncio.sleep(0.3)  # the new subscription reaches the publisher
        r.pub.publish([blk(4)])  # seq 4: live, already in the map
        r.pub.publish([blk(5)])  # seq 5: new
        r.pub.publish([removed(4)])  # seq 6
        await r.wait_seq(6)
        st = r.ing.status("w1")
        assert st["duplicates"] == 1 and st["resets"] == 0
        assert len(r.ing.held("w1")["GPU"]) == 5  # 0-3 and 5: block 4 went with its one removal (counted once)


class _FreezingProxy:
    """A TCP relay in front of a publisher: ``freeze()`` stops relaying on the connections open now, in both
    directions, and never closes them (a host gone without a FIN or RST: its kernel answers nothing); later
    connections relay normally (the host is back, the old connection is dead on its side)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.conns: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.frozen: set[int] = set()
        self.tasks: set[asyncio.Task] = set()
        self.server = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    def freeze(self) -> None:
        self.frozen |= {id(w) for pair in self.conns for w in pair}

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.conns.append((cw, uw))
        for src, dst in ((cr, uw), (ur, cw)):
            t = asyncio.create_task(self._pipe(src, dst))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            data = await src.read(65536)
            if not data:
                return
            if id(dst) in self.frozen:
                await asyncio.Event().wait()  # relay nothing more, keep the socket open
            dst.write(data)
            await dst.drain()

    async def close(self) -> None:
        self.server.close()
        for t in list(self.tasks):
            t.cancel()
        for pair in self.conns:
            for w in pair:
                w.transport.abort()


async def test_a_publisher_gone_silent_is_noticed_and_its_stream_comes_back():
    """The publisher's host vanished without a FIN or RST, then came back on the same address (a partition
    that outlived the publisher's TCP retries, a host power-cycled, vLLM started again without the gateway
    seeing a new process start). A SUB socket sends nothing after its subscription, so it never learns
    that its connection is dead: it waited for ever, the worker's index frozen while the worker served
    again (a gap shows only when a message arrives). With ZMTP heartbeats on the SUB socket the silence
    times the connection out, the SUB reconnects, and the next batch arrives (its gap is filled by a
    replay)."""
    from indexer.index.memory import MemoryIndex

    idx = MemoryIndex()
    port, rport = free_port(), free_port()
    pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}", topic="kv@w1@m")
    proxy = _FreezingProxy(port)
    await proxy.start()
    ing = EventIngestor(idx, heartbeat_s=0.2)
    try:
        await ing.add_source(EventSource("w1", M, f"tcp://127.0.0.1:{proxy.port}", f"tcp://127.0.0.1:{rport}",
                                         topic="kv@", block_size=B))
        assert await asyncio.to_thread(pub.wait_subscribed)
        pub.publish([blk(0, 1)])
        await until(lambda: ing.status("w1")["last_seq"] == 0, what="seq 0")
        proxy.freeze()
        deadline = time.monotonic() + 10.0
        i = 1
        while ing.status("w1")["last_seq"] == 0 and time.monotonic() < deadline:
            pub.publish([blk(i, 1)] if i < 8 else [blk(7, 1)])  # the worker works on
            i += 1
            await asyncio.sleep(0.1)
        st = ing.status("w1")
        assert st["last_seq"] is not None and st["last_seq"] > 0, "still waiting on a dead connection"
        await until(lambda: ing.status("w1")["last_seq"] == i - 1, what="caught up")
        assert (await idx.lookup(M, SEQ)).match("w1").gpu == 8 and ing.status("w1")["resets"] == 0
    finally:
        await ing.stop()
        await proxy.close()
        pub.close()
