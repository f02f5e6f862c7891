"""EventIngestor: vLLM KV events from every worker into the block index.

Per source, one task receives from the SUB socket into a bounded queue (when the queue is full the task
waits; ZMQ then buffers, and past vLLM's HWM messages are lost, which shows up as a sequence gap) and one
task applies the queue in order. Sources never wait on each other.

Sequence numbers (vllm-interface.md 1.2, 1.7):
- ``seq == last + 1``: apply;
- ``seq > last + 1`` (lost messages): ask the replay endpoint for ``last ..`` and apply the missing
  batches first; if it cannot fill the gap (no endpoint, timeout, ring already past it), reset; if its
  batch ``last`` is not the one applied, the publisher restarted unseen: reset and replay its ring;
- ``seq <= last`` (vLLM restarted: its counter starts at 0 again): reset.
Reset = drop the worker's local-tier index entries and its state, call ``on_reset(worker, reason)``, and
rebuild from the events that follow (after a restart the block size too: a new process may run another).
The reset is the only clear: ``on_reset`` must not clear the index again (a second clear, scheduled
later, would wipe what the apply loop stored after the reset). On the first message of a source with
``seq > 0`` the ingestor replays what the publisher still buffers, best effort (no reset if it cannot).
``resync(worker)`` (a health flap ended) asks for a replay from ``last`` (checked the same way) without
waiting for the next live message.

Index errors (a Redis outage) never reset a source: the state is exact whatever the index does, so the
source is marked *unsynced*, events keep updating the state (writes skipped), and once the index answers
again the worker's entries are rebuilt from the state (clear, then store what the state holds; the G4
writes missed meanwhile are kept in a bounded backlog and replayed).
Malformed messages are counted (``dropped``) and skipped.

G4 (STORAGE) blocks go where their scope says (indexer/events/state.py): shared blocks to the tier the
source's worker mounts -- ``EventSource.g4_member`` None is the model-wide G4 set (``store_g4``), a name is
a pseudo-worker entry of the index (``shared_g4_member``) that every worker mounting that tier is credited
with -- and LOCAL blocks to the worker's own pseudo-worker entry (``local_g4_member``). Resets leave both
alone (files outlive the process); the registry drops a worker's LOCAL entry when it removes the worker.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from indexer.events.state import G4, LOCAL, WorkerState, local_g4_member
from indexer.events.subscriber import ReplayError, Subscriber, resolve_endpoint
from indexer.events.wire import DecodeError, decode_batch, decode_seq
from indexer.index.base import BlockIndex, LeaseLost, Tier

log = logging.getLogger("kvgate.events")
YIELD_EVERY_S = 0.0005

_COUNTERS = ("applied", "blocks_stored", "blocks_removed", "dropped", "gaps", "replays", "resets", "errors",
             "resyncs", "duplicates", "capped", "takeovers", "pushes", "g4_backlog_dropped")
_RESYNC = object()  # queue item: replay from last_seq + 1 now (a flap ended)
_WAKE = object()  # queue item: look at the synced flag now (the index restarted)
_PUSH_CHUNK = 50_000  # hashes per store call when the state is pushed back into the index


class _Restarted(Exception):
    """A replay's copy of the last applied batch differs from it: another process publishes now."""


@dataclass
class EventSource:
    """One vLLM event stream (one worker, one data-parallel rank). ``worker_url`` (optional) fills in a
    wildcard host in the endpoints (``tcp://*:5557``)."""

    worker: str
    model: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int | None = None  # None: learnt from the stream's first BlockStored
    worker_url: str | None = None
    # Where the worker's shared G4 blocks are indexed: None = the model-wide G4 set, else the index
    # entry of the named tier it mounts (state.shared_g4_member).
    g4_member: str | None = None
    # The publishing engine process (the server's process_start_time_seconds), None when unknown: a handle
    # map the index saved for another incarnation is not adopted (its cache is gone).
    incarnation: str | None = None


class _Source:
    def __init__(self, src: EventSource, sub: Subscriber, queue_size: int, g4_backlog: int = 10_000) -> None:
        self.src = src
        self.sub = sub
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
        self.state = WorkerState(block_size=src.block_size)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.last_seq: int | None = None
        self.last_payload: bytes | None = None  # the batch applied at last_seq (None: unknown, e.g. adopted)
        # False while the index may disagree with the state (an index error): writes are skipped and the
        # state is pushed back once the index answers.
        self.synced = True
        self.retry_at = 0.0
        self.g4_backlog: deque = deque(maxlen=g4_backlog)  # G4 writes missed while unsynced, in order
        self.g4_overflow = False  # the backlog dropped writes since it was last replayed (warned once)
        # Sequence numbers applied ahead of the live stream by a resync replay: their live copies are
        # duplicates, not a restart.
        self.ahead: tuple[int, int] | None = None
        # The ``ahead`` window comes from a handle map another gateway saved (adopted): the first live
        # message inside it is checked against the publisher before it is taken for a duplicate.
        self.ahead_adopted = False
        self.writer = False  # holds the worker's lease: the only gateway that writes its entries
        # Replaying what the publisher buffers on a first message: the state only, the worker's local-tier
        # entries written once at its end (:meth:`EventIngestor._catch_up`).
        self.catching_up = False
        self.lease_at = 0.0  # when to renew it
        self.closed = False
        self.tasks: list[asyncio.Task] = []


async def _cancel_until_done(tasks: list[asyncio.Task], tries: int = 100) -> None:
    """Cancel until the tasks are done (at most ``tries`` x 0.1 s). One cancel is not always enough: a
    client library that swallows a CancelledError (seen with redis-py mid-command), or Python 3.11's
    ``wait_for`` returning its inner result when the cancel lands as it completes, leaves a loop running,
    and ``stop()`` waiting on it for ever (a test hung for 300 s on that)."""
    for _ in range(tries):
        pending = [t for t in tasks if not t.done()]
        if not pending:
            return
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.1)


class EventIngestor:
    def __init__(
        self,
        index: BlockIndex,
        *,
        queue_size: int = 10_000,
        on_reset: Callable[[str], object] | None = None,
        observer: Callable[[str, str, list[int]], object] | None = None,
        replay_timeout_s: float = 5.0,
        retry_s: float = 1.0,
        owner: str | None = None,
        lease_ttl_s: float = 10.0,
        max_handles: int = 2_000_000,
        sweep_idle_s: float = 600.0,
        sweep_interval_s: float = 60.0,
        g4_backlog: int = 10_000,
        heartbeat_s: float | None = 5.0,
    ) -> None:
        self.index = index
        self.queue_size = queue_size
        self.on_reset = on_reset
        self.observer = observer
        self.replay_timeout_s = replay_timeout_s
        self.retry_s = retry_s  # how often an unsynced source tries to push its state back
        self.owner = owner or uuid.uuid4().hex  # this gateway process, as lease holder
        self.lease_ttl_s = lease_ttl_s
        self.max_handles = max_handles  # per source: past it the state is suspect (lost removals): reset
        self.sweep_idle_s = sweep_idle_s
        self.sweep_interval_s = sweep_interval_s
        self.g4_backlog = g4_backlog  # per source: G4 writes kept while the index is out
        self.heartbeat_s = heartbeat_s  # ZMTP heartbeats of the SUB sockets (indexer/events/subscriber.py)
        self._last_sweep = time.monotonic()
        self._sweeping: asyncio.Task | None = None
        self._stopping = False
        self._ctx: zmq.asyncio.Context | None = None
        self._sources: dict[str, _Source] = {}
        self._last_yield = 0.0
        self._epoch: str | None = None
        self._watch: asyncio.Task | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            # Every socket of this context (SUB, DEALER, the SUB's monitor PAIR) lingers 0: terminating the
            # context never waits, also when a context is collected without stop() (a loop that died).
            self._ctx.setsockopt(zmq.LINGER, 0)
        if self._watch is None:
            self._stopping = False
            self._watch = asyncio.create_task(self._watch_index(), name="kv-events-index-epoch")

    async def stop(self) -> None:
        if self._watch is not None:
            self._stopping = True  # the watch loop ends at its next turn even if a cancel is swallowed
            await _cancel_until_done([self._watch] + ([self._sweeping] if self._sweeping else []))
            self._watch = self._sweeping = None
        for worker in list(self._sources):
            try:
                await self.remove_source(worker, clear=False)
            except Exception as e:  # the index is unreachable: the lease expires; the other sources close
                log.warning("%s: releasing its lease at stop: %s", worker, e)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def add_source(self, src: EventSource) -> None:
        """Subscribe to a source (replacing a previous one of the same worker, without clearing it)."""
        await self.start()
        if src.worker in self._sources:
            await self.remove_source(src.worker, clear=False)
        endpoint = resolve_endpoint(src.endpoint, src.worker_url)
        replay = resolve_endpoint(src.replay_endpoint, src.worker_url) if src.replay_endpoint else None
        sub = Subscriber(self._ctx, endpoint, src.topic, replay, timeout_s=self.replay_timeout_s,
                         heartbeat_s=self.heartbeat_s)
        s = _Source(src, sub, self.queue_size, self.g4_backlog)
        self._sources[src.worker] = s
        await self._adopt(s)
        await self._take_lease(s)
        s.tasks = [
            asyncio.create_task(self._receive(s), name=f"kv-events-recv-{src.worker}"),
            asyncio.create_task(self._apply_loop(s), name=f"kv-events-apply-{src.worker}"),
        ]

    async def remove_source(self, worker: str, clear: bool = True) -> None:
        s = self._sources.pop(worker, None)
        if s is None:
            return
        s.closed = True
        await _cancel_until_done(s.tasks)
        s.sub.close()
        if s.writer:  # a follower never touches the index: the writer (another gateway) still serves it
            try:
                if clear:
                    await self.index.clear_worker(s.src.model, worker)
            finally:
                await self.index.release_lease(s.src.model, worker, self.owner)

    def sources(self) -> list[EventSource]:
        return [s.src for s in self._sources.values()]

    def resync(self, worker: str) -> bool:
        """Ask for a replay from ``last_seq + 1`` (the worker was unreachable for a while but did not
        restart: what it published meanwhile may be lost). Runs in the source's apply order."""
        s = self._sources.get(worker)
        if s is None:
            return False
        try:
            s.queue.put_nowait(_RESYNC)
        except asyncio.QueueFull:  # messages are flowing: a lost one shows up as a gap anyway
            return False
        return True

    def held(self, worker: str) -> dict[str, list[int]]:
        """What the state says the worker holds, per tier (GPU, CPU): the index should hold exactly this."""
        s = self._sources[worker]
        return {t.value: s.state.held(t) for t in (Tier.GPU, Tier.CPU)}

    # -- status -----------------------------------------------------------------------------------------
    async def record_incarnation(self, worker: str, incarnation: str) -> None:
        """The registry learnt the worker's engine process after subscribing (the first scrape came later, or
        a process came up behind a subscription kept while the worker was down, whose entries were dropped
        then). The writer pushes its state again with it (a rebuild: the process is only ever recorded
        with the map it describes), so a gateway starting later adopts them; a follower only remembers it
        (for the push it makes if it takes over)."""
        s = self._sources.get(worker)
        if s is None or s.src.incarnation == incarnation:
            return
        s.src.incarnation = incarnation
        if s.writer:
            self._unsync(s)

    def status(self, worker: str) -> dict:
        s = self._sources.get(worker)
        if s is None:
            raise KeyError(worker)
        st = s.state.counters
        return {
            "model": s.src.model,
            "endpoint": s.sub.endpoint,
            "connected": s.sub.connected,
            "last_seq": s.last_seq,
            "synced": s.synced,
            "writer": s.writer,
            **s.counters,
            "unknown_parent": st["unknown_parent"],
            "size_mismatch": st["size_mismatch"],
            "unmapped": st["unmapped"],
            "skipped": st["skipped"],
            "bad_locality": st["bad_locality"],
            "storage_evicted": st["storage_evicted"],
            "handles": len(s.state),
            "queued": s.queue.qsize(),
        }

    def statuses(self) -> dict[str, dict]:
        return {w: self.status(w) for w in self._sources}

    # -- tasks ------------------------------------------------------------------------------------------
    async def _watch_index(self) -> None:
        """Every ``retry_s``: a new index epoch (Redis restarted, maybe empty) marks every writer unsynced,
        so each pushes its exact state back -- also the sources that had nothing to write meanwhile. An
        unreachable index changes nothing here (failed writes unsync their own source); renews leases and
        sweeps idle workers too."""
        while not self._stopping:
            try:
                epoch = await asyncio.wait_for(self.index.epoch(), 5.0)
            except asyncio.CancelledError:
                raise
            except Exception:
                epoch = None
            if epoch is not None:
                if self._epoch is not None and epoch != self._epoch:
                    log.info("the index restarted: pushing every worker's state back")
                    for s in self._sources.values():
                        if s.writer:
                            self._unsync(s)
                self._epoch = epoch
            now = time.monotonic()
            for s in list(self._sources.values()):
                if now >= s.lease_at:
                    await self._take_lease(s)
            if now - self._last_sweep >= self.sweep_interval_s and (
                    self._sweeping is None or self._sweeping.done()):
                # its own task: a sweep of idle workers with a million entries each took longer than
                # the leases' renewal margin, and this gateway's live leases lapsed behind it
                self._last_sweep = now
                self._sweeping = asyncio.create_task(self._sweep(), name="kv-events-sweep")
            await asyncio.sleep(self.retry_s)

    def _unsync(self, s: _Source) -> None:
        s.synced = False
        s.retry_at = 0.0
        try:
            s.queue.put_nowait(_WAKE)
        except asyncio.QueueFull:
            pass  # messages are flowing: the apply loop sees the flag anyway

    async def _take_lease(self, s: _Source) -> None:
        """Take or renew the worker's lease. A new writer resynchronizes: its state (adopted from the index
        at subscription, then kept by every event since) is pushed back -- clear and rebuild."""
        s.lease_at = time.monotonic() + self.lease_ttl_s / 3
        try:
            ok = await asyncio.wait_for(
                self.index.acquire_lease(s.src.model, s.src.worker, self.owner, self.lease_ttl_s),
                self.lease_ttl_s / 3)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("%s: lease: %s", s.src.worker, e)
            return  # the index is out: the epoch watch and the writes handle it
        if ok and not s.writer:
            s.writer = True
            s.counters["takeovers"] += 1
            log.info("%s: this gateway writes its entries now", s.src.worker)
            self._unsync(s)
        elif not ok and s.writer:
            s.writer = False
            log.info("%s: another gateway writes its entries now", s.src.worker)

    async def _adopt(self, s: _Source) -> None:
        """Start from the handle map and sequence the worker's writer saved in the index, so this process
        can apply a BlockRemoved for a block stored before it started. Not when the map was saved for
        another engine process, or for one this gateway cannot tell apart from another (its own start of
        the worker unknown: the first scrape failed, or the worker is down): the worker may have restarted
        while no gateway watched (the new process's sequence starts at 0 again and would read as already
        applied), so its entries are stale. This source then starts empty, like a new one, and as the
        writer it pushes that state back (clearing them) with the new process recorded beside it; until
        then every gateway subscribing reads the old process there. A map recorded without a process
        (vLLM with ``--api-server-count > 1`` exports none) is adopted."""
        timeout = max(self.replay_timeout_s, 1.0)
        try:
            prev = await asyncio.wait_for(self.index.incarnation(s.src.model, s.src.worker), timeout)
            if prev is not None and prev != s.src.incarnation:
                s.counters["resets"] += 1
                log.info("%s: its entries were written for process start %s, this gateway sees %s: not "
                         "adopting them", s.src.worker, prev, s.src.incarnation or "none yet")
                return
            handles, seq = await asyncio.wait_for(self.index.load_handles(s.src.model, s.src.worker), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("%s: loading its handle map: %s", s.src.worker, e)
            return
        if seq is None and not handles:
            return
        s.state.adopt(handles)
        s.last_seq = seq
        if seq is not None:
            s.ahead = (0, seq)  # live messages the writer had already applied are not a restart
            s.ahead_adopted = True
        log.info("%s: adopted %d handles up to seq %s", s.src.worker, len(handles), seq)

    async def _sweep(self) -> None:
        """Drop the entries of workers no gateway has held a lease for in ``sweep_idle_s``."""
        try:
            for model in await self.index.models():
                gone = await self.index.sweep(model, self.sweep_idle_s)
                if gone:
                    log.info("swept the entries of %s (%s): no gateway writes for them", ", ".join(gone), model)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("sweep: %s", e)

    async def _receive(self, s: _Source) -> None:
        while not s.closed:
            try:
                frames = await s.sub.recv()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:  # the socket was closed under us
                log.warning("events from %s: %s", s.src.worker, e)
                return
            await s.queue.put(frames)

    async def _apply_loop(self, s: _Source) -> None:
        while not s.closed:
            if s.synced:
                item = await s.queue.get()
            else:
                try:
                    item = await asyncio.wait_for(s.queue.get(), self.retry_s)
                except TimeoutError:
                    item = None
            try:
                if not s.synced:
                    await self._push_state(s)
                if item is _RESYNC:
                    await self._resync(s)
                elif item is not None and item is not _WAKE:
                    await self.handle_message(s, item)
                await self._yield()
            except asyncio.CancelledError:
                raise
            except Exception:  # an event bug, never an index error (those are caught in _write)
                s.counters["errors"] += 1
                log.exception("applying events from %s failed", s.src.worker)

    async def handle_message(self, s: _Source, frames: list[bytes]) -> None:
        """One live message: sequence checks, replay or reset, then the batch."""
        if len(frames) == 3:
            seq_frame, payload = frames[1], frames[2]
        elif len(frames) == 2:
            seq_frame, payload = frames
        else:
            s.counters["dropped"] += 1
            return
        try:
            seq = decode_seq(seq_frame)
        except DecodeError:
            s.counters["dropped"] += 1
            return
        if s.ahead_adopted and s.ahead is not None and s.ahead[0] <= seq <= s.ahead[1]:
            s.ahead_adopted = False  # the adopted window's first live batch: is the publisher past it?
            if not await self._publisher_reached(s, s.ahead[1]):
                log.info("%s: its publisher is at seq %d, below the adopted map's %d (restarted unseen)",
                         s.src.worker, seq, s.ahead[1])
                s.ahead = None  # and the restart is handled below: seq <= last_seq
        if s.ahead is not None:
            lo, hi = s.ahead
            if lo <= seq <= hi:  # already applied (a resync replay, the writer)
                s.counters["duplicates"] += 1
                return
            if seq > hi:
                s.ahead = None
        if s.last_seq is None:
            if seq > 0 and s.sub.replay_endpoint:
                await self._catch_up(s, seq)
        elif seq <= s.last_seq:
            log.info("%s: sequence went from %d to %d (restart)", s.src.worker, s.last_seq, seq)
            await self._restart(s, seq)
        elif seq > s.last_seq + 1:
            s.counters["gaps"] += 1
            try:
                if not await self._fill(s, s.last_seq + 1, seq):
                    await self._reset(s, "unfillable gap")
            except _Restarted:
                log.info("%s: a gap, and the publisher's batch %d is not the one applied (restart)",
                         s.src.worker, s.last_seq)
                await self._restart(s, seq)
        await self._apply_payload(s, seq, payload)

    async def _publisher_reached(self, s: _Source, seq: int) -> bool:
        """Whether the publisher has published ``seq`` (its replay ring holds it or a later batch). After
        adopting a map saved up to ``seq``, a live message at or below it is either one the writer applied
        already (it was published between this subscription and the adoption) or the first batches of an
        engine that restarted while no gateway watched and counts from 0 again (a process start that vLLM
        does not export, ``--api-server-count > 1``, cannot tell). Without an answer: the former."""
        got = await self._replay(s, seq)
        return got is None or any(q >= seq for q, _ in got)

    async def _replay(self, s: _Source, start: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from ``start``; None without a replay endpoint or an answer."""
        if not s.sub.replay_endpoint:
            return None
        try:
            return await s.sub.replay(start)
        except ReplayError as e:
            log.warning("%s: %s", s.src.worker, e)
            return None

    async def _restart(self, s: _Source, upto: int | None) -> None:
        """The publisher restarted: reset, then replay what the new process buffers before ``upto`` (None:
        all of it), as its first batches were missed."""
        await self._reset(s, "restart")
        # The new process may run another block size (a rolling restart with another --block-size): learnt
        # from its own events, else all of them are size mismatches until the registry re-subscribes, and
        # their children unknown parents after.
        s.state.block_size = None
        if (upto is None or upto > 0) and s.sub.replay_endpoint:
            await self._catch_up(s, upto)

    async def _catch_up(self, s: _Source, upto: int) -> None:
        """A source's first message (or a restarted publisher's) with ``seq > 0``: replay what the publisher
        still buffers into the state, then write the worker's local-tier entries from it once. Why: applied
        to the index batch by batch, yielding to requests between batches, a replay of a full ring (vLLM
        keeps 10,000 batches) left the index mid-history for seconds, and requests were routed on blocks
        that a later ``AllBlocksCleared`` (a prefix-cache reset) or ``BlockRemoved`` in the same replay
        undoes (real vLLM, a gateway started after a reset: 27 blocks priced held, 0 delivered). G4 writes
        go as they come (files outlive a clear)."""
        s.catching_up = True
        try:
            await self._fill(s, 0, upto, first=True)
        finally:
            s.catching_up = False
        if s.writer and s.synced:
            await self._index_call(s, self._rebuild(s))

    async def _rebuild(self, s: _Source) -> None:
        """The worker's local-tier entries and handle map, rewritten from the state (exact). Tier by tier;
        the handle map is replaced in one write, never dropped first: a gateway subscribing meanwhile adopts
        either the old map or this one, not a torn one."""
        model, worker = s.src.model, s.src.worker
        for tier in (Tier.GPU, Tier.CPU):
            await self.index.clear_worker(model, worker, tier)
            held = s.state.held(tier)
            for i in range(0, len(held), _PUSH_CHUNK):
                await self.index.store(model, worker, tier, held[i:i + _PUSH_CHUNK])
                await self._yield()  # an in-memory index stores a chunk without suspending
        await self.index.save_handles(model, worker, s.state.export(), [], s.last_seq, replace=True,
                                      incarnation=s.src.incarnation)

    async def _fill(self, s: _Source, start: int, upto: int | None, first: bool = False) -> bool:
        """Replay ``start .. upto-1`` (``upto`` None: all the publisher buffers); True when all of it
        was applied. Raises :class:`_Restarted` when the publisher's copy of the last applied batch differs
        from it: the replay is asked from that batch on, as a process restarted unseen (its first batches
        missed) that has published past ``last_seq`` answers with batches of its own, which would be applied
        on top of the old process's state (a ring already past that batch cannot tell: as before). An empty
        answer to that check is a restart too: a publisher rings every batch it sends, so the one that sent
        ``last_seq`` answers with it or a later one; only a new process behind it has nothing from there."""
        check = not first and s.last_payload is not None and start == s.last_seq + 1
        got = await self._replay(s, start - 1 if check else start)
        if got is None:
            return False
        if check and (not got or got[0][0] == start - 1 and got[0][1] != s.last_payload):
            raise _Restarted
        batches = [(q, p) for q, p in got if start <= q and (upto is None or q < upto)]
        if upto is None and not batches:
            return True  # nothing was published meanwhile
        seqs = [q for q, _ in batches]
        end = upto if upto is not None else (seqs[-1] + 1 if seqs else start)
        if first and seqs:
            # Best effort: the newest unbroken run. vLLM's replay socket drops what passes its send HWM
            # (1,000 messages) while the reader lags, and a ring of 10,000 batches has holes then; the run
            # after the last hole is still exact (a block whose parent is before it is counted, not indexed).
            i = len(seqs) - 1
            while i > 0 and seqs[i - 1] == seqs[i] - 1:
                i -= 1
            batches, seqs = batches[i:], seqs[i:]
        if not batches or seqs != list(range(seqs[0], end)):
            return False
        if seqs[0] != start and not first:
            return False
        s.counters["replays"] += 1
        for q, p in batches:
            await self._apply_payload(s, q, p)
            await self._yield()
        return seqs[0] == start

    async def _yield(self) -> None:
        """Let requests run between event batches: an in-memory index applies a batch without suspending,
        so a burst (a replay, a queue backlog) would otherwise hold the loop until all of it is applied."""
        now = time.perf_counter()
        if now - self._last_yield > YIELD_EVERY_S:
            await asyncio.sleep(0)
            self._last_yield = time.perf_counter()

    async def _resync(self, s: _Source) -> None:
        """Catch up after a flap: replay what came after ``last_seq``; reset if it cannot be filled."""
        if s.last_seq is None or not s.sub.replay_endpoint:
            return
        s.counters["resyncs"] += 1
        before = s.last_seq
        try:
            filled = await self._fill(s, before + 1, None)
        except _Restarted:
            log.info("%s: the publisher's batch %d is not the one applied (restart)", s.src.worker, before)
            await self._restart(s, None)
            if s.last_seq is not None:  # their live copies (queued meanwhile) are not another restart
                s.ahead = (0, s.last_seq)
            return
        if filled:
            if s.last_seq > before:
                s.ahead = (before + 1, s.last_seq)
        else:
            s.counters["gaps"] += 1
            await self._reset(s, "unfillable gap")

    async def _reset(self, s: _Source, reason: str) -> None:
        s.counters["resets"] += 1
        s.state.reset()
        s.last_seq = s.last_payload = None
        s.ahead, s.ahead_adopted = None, False
        if s.writer:
            await self._index_call(s, self.index.clear_worker(s.src.model, s.src.worker))
        log.info("%s: cleared (%s)", s.src.worker, reason)
        if self.on_reset is not None:
            r = self.on_reset(s.src.worker, reason)
            if inspect.isawaitable(r):
                await r

    async def _index_call(self, s: _Source, coro) -> bool:
        """Run one index write; on an error mark the source unsynced (never reset it)."""
        if not s.synced or not s.writer:
            coro.close()
            return False
        try:
            await coro
            return True
        except asyncio.CancelledError:
            raise
        except LeaseLost:
            s.writer = False
            log.info("%s: fenced off, another gateway writes its entries now", s.src.worker)
            return False
        except Exception as e:
            s.counters["errors"] += 1
            s.synced = False
            s.retry_at = time.monotonic() + self.retry_s
            log.warning("%s: index write failed (%s: %s); keeping the state, will push it back",
                        s.src.worker, type(e).__name__, e)
            return False

    async def _push_state(self, s: _Source) -> None:
        """Index back: rebuild the worker's entries from the state (exact) and replay the G4 backlog."""
        if not s.writer:  # a follower keeps its state and leaves the index to the writer
            s.synced = True
            s.g4_backlog.clear()
            s.g4_overflow = False
            return
        now = time.monotonic()
        if now < s.retry_at:
            return
        s.retry_at = now + self.retry_s
        model, worker = s.src.model, s.src.worker
        try:
            await self._rebuild(s)
            while s.g4_backlog:
                await self._g4_call(model, *s.g4_backlog[0])
                s.g4_backlog.popleft()
            s.g4_overflow = False
        except asyncio.CancelledError:
            raise
        except LeaseLost:
            s.writer, s.synced = False, True
            return
        except Exception as e:
            log.debug("%s: index still failing: %s", worker, e)
            return
        s.synced = True
        s.counters["pushes"] += 1
        log.info("%s: state pushed to the index (%d handles)", worker, len(s.state))

    async def _apply_payload(self, s: _Source, seq: int, payload: bytes) -> None:
        # last_seq moves once the batch is in the state (the index follows, or is rebuilt from the state)
        try:
            try:
                batch = decode_batch(payload)
            except DecodeError:
                s.counters["dropped"] += 1
                return
            malformed_before = s.state.counters["malformed"]
            ops = s.state.apply(batch.events)
            s.counters["dropped"] += batch.malformed + s.state.counters["malformed"] - malformed_before
            s.counters["applied"] += len(batch.events)
            await self._write(s, ops.items)
            ups, dels = s.state.take_changes()
            if s.writer and s.synced and not s.catching_up and (ups or dels or ops.items):
                await self._index_call(s, self.index.save_handles(s.src.model, s.src.worker, ups, dels, seq))
        finally:
            s.last_seq, s.last_payload = seq, payload
        if len(s.state) > self.max_handles:  # more than a worker can hold: removals were lost
            s.counters["capped"] += 1
            await self._reset(s, f"over {self.max_handles} handles")

    async def _write(self, s: _Source, items) -> None:
        model, worker = s.src.model, s.src.worker
        for op, tier, hashes in items:
            if op in ("g4", "g4_remove"):
                if op == "g4":
                    self._observe(worker, G4, hashes)
                if not s.writer:
                    continue
                member = local_g4_member(worker) if tier == LOCAL else s.src.g4_member
                if not s.synced or not await self._index_call(s, self._g4_call(model, op, member, hashes)):
                    self._keep_g4(s, (op, member, hashes))
                continue
            if op == "store":
                s.counters["blocks_stored"] += len(hashes)
                self._observe(worker, tier.value, hashes)
            elif op == "remove":
                s.counters["blocks_removed"] += len(hashes)
            if not s.synced or not s.writer or s.catching_up:
                continue  # the state has it; pushed back with everything else when the index returns
            if op == "store":
                await self._index_call(s, self.index.store(model, worker, tier, hashes))
            elif op == "remove":
                await self._index_call(s, self.index.remove(model, worker, tier, hashes))
            elif op == "clear":
                await self._index_call(s, self.index.clear_worker(model, worker))

    @staticmethod
    def _keep_g4(s: _Source, write: tuple) -> None:
        """Keep a G4 write the index missed, to replay it with the push. A full backlog drops its oldest
        write: counted (blocks), and said once per outage, as the index's G4 entries then differ from the
        files until a rebuild."""
        if len(s.g4_backlog) == s.g4_backlog.maxlen:
            s.counters["g4_backlog_dropped"] += len(s.g4_backlog[0][2]) if s.g4_backlog else len(write[2])
            if not s.g4_overflow:
                s.g4_overflow = True
                log.warning("%s: G4 backlog full (%d writes kept while the index is out): dropping the "
                            "oldest; the index's G4 entries will differ from the files until a rebuild "
                            "(POST /admin/g4/%s/rebuild)",
                            s.src.worker, s.g4_backlog.maxlen, s.src.model)
        s.g4_backlog.append(write)

    def _g4_call(self, model: str, op: str, member: str | None, hashes: list[int]):
        """The index write of a G4 op: the model-wide set (member None) or a G4 pseudo-worker entry."""
        if member is None:
            return (self.index.store_g4 if op == "g4" else self.index.remove_g4)(model, hashes)
        return (self.index.store if op == "g4" else self.index.remove)(model, member, Tier.GPU, hashes)

    def _observe(self, worker: str, tier: str, hashes: list[int]) -> None:
        if self.observer is not None:
            try:
                self.observer(worker, tier, hashes)
            except Exception:
                log.exception("event observer failed")

    async def feed(self, worker: str, frames: list[bytes]) -> None:
        """Apply one message (``[topic, seq, payload]``) of a source directly, bypassing its socket and
        queue (benchmarks, tests); not to be mixed with a live source's own receiving."""
        await self.handle_message(self._sources[worker], frames)
