"""Redis index: the production backend, shared by every gateway process of a fleet.

Key schema (``P`` = key prefix, default ``kvg``; ``M`` = model name; ``{M}`` is a Redis Cluster hash tag,
so every key of a model lives in one slot and one script can touch them all):

==============================  =====  ===========================================================
key                             type   content
==============================  =====  ===========================================================
``P:{M}:blocks``                hash   field = a block's sequence hash as 8 raw bytes (big endian);
                                       value = its holders, ``",m1,m2,"`` with ``m = wid*2 + tier``
                                       (tier 0 GPU, 1 CPU) and ``m = -1`` for G4.
``P:{M}:r:<m>:<bucket>``        set    reverse index of member ``m`` (one worker's tier, or G4),
                                       sharded into 2048 buckets by ``hash & 2047``; set members are
                                       ``hash >> 11`` (53 bits: exact in Lua's doubles; intset-encoded
                                       up to 512 per bucket, i.e. ~1M blocks per worker tier).
``P:{M}:w`` / ``P:{M}:i``       hash   worker name -> id and id -> name (ids are never reused).
``P:{M}:seq``                   str    the next worker id.
``P:{M}:n``                     hash   entry count per member ``m``.
``P:models``                    set    model names that have entries (outside the hash tag).
``P:{M}:h:<worker>``            hash   the worker's handle map ((group, engine hash) -> kvgate hash and
                                       its GPU / CPU counts).
``P:{M}:hseq`` / ``P:{M}:hver`` hash   worker -> last applied event sequence / handle-map version
                                       (bumped by every map write: a chunked reader detects a change).
``P:{M}:inc``                   hash   worker -> the engine process its entries describe (its
                                       ``process_start_time_seconds``; set by ``save_handles``).
``P:{M}:htmp:<id>``             hash   a handle map being written in chunks (a large replace), swapped
                                       in whole by ``save_handles``; expires if its writer died.
==============================  =====  ===========================================================

Why this shape: a block costs one hash field (no per-key overhead), each holder a few bytes in that
field's value plus 8 bytes in an intset bucket -- about 80-100 bytes for the first (block, worker) entry and
13-26 for each further holder (measured: docs/BENCHMARKS.md). Entries carry no unbounded data: names live
once in ``w``/``i``. Dropping a worker walks only its own 2048 reverse buckets -- no SCAN of the keyspace.

Why a server-side Lua script and not a pipeline for ``lookup``: a pipeline must ask for every hash of the
prompt (8K fields for a 128K-token prompt at block size 16) even when the first block already misses, and
ships all of it back to Python. The script reads block 0's holders, then fetches the following fields
with HMGET in growing chunks (16, 64, 256, 1024) and checks only the members whose run is still alive;
it stops as soon as no worker and not G4 can extend its run, and returns only the per-worker counts. One
round trip, an early exit, work proportional to the runs (not blocks x workers), an atomic snapshot.
Writes are scripts too: one EVALSHA per event batch whatever its number of blocks, the hashes packed into
one binary argument (Python's work per block is a numpy byte copy), one HMGET + one HSET per 1000 blocks.
The scripts are package resources (``indexer/index/lua/*.lua``, loaded by ``indexer/index/scripts.py``)
registered with redis-py's ``register_script``: EVALSHA, and on NOSCRIPT (after a restart or a SCRIPT
FLUSH) they are loaded and run again. Keys other than the declared ones are built inside the scripts from
the same hash-tagged base, so they live in the declared keys' slot on Redis Cluster.
"""
from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from indexer.index.base import (
    BlockIndex, BlockLocation, Handle, HandleKey, LeaseLost, LookupResult, Tier, WorkerMatch,
)
from indexer.index.scripts import source

G4_MEMBER = -1
BUCKETS = 2048  # fixed: members are hash >> 11, which must fit a double's 53 bits
_TIER_CODE = {Tier.GPU: 0, Tier.CPU: 1}
_CLEAR_CHUNK = 128  # buckets per clear script call: bounds how long one call blocks Redis
# handles per script call of a replaced map (~20 ms of Redis each); a larger map is written beside the old
# one in chunks and swapped in (save_handles)
_HANDLE_CHUNK = 10_000
_FILL_TTL_MS = 120_000  # a temporary map left by a writer that died mid-replace expires

_LOST = "!lost"  # the fencing token of an index that lost a lease: matches nothing, every write is refused
_HKEY = np.dtype([("g", ">u4"), ("e", ">u8")])  # a handle map field: (group, engine hash)
_HVAL = np.dtype([("r", ">u8"), ("gpu", ">u4"), ("cpu", ">u4")])  # its value: (kvgate hash, counts)
_HREC = np.dtype([("k", _HKEY), ("v", _HVAL)])


def pack_hashes(hashes: Sequence[int], unique: bool = False) -> bytes:
    """Sequence hashes as one string of 8-byte big-endian values (the scripts' input)."""
    if isinstance(hashes, np.ndarray):
        if unique:
            hashes = np.unique(hashes)
        return hashes.astype(">u8", copy=False).tobytes()
    if unique:
        hashes = list(dict.fromkeys(hashes))
    return np.array(hashes, dtype=">u8").tobytes()


class RedisIndex(BlockIndex):
    name = "redis"

    def __init__(self, url: str, key_prefix: str = "kvg", timeout_s: float = 2.0,
                 max_connections: int = 32, cluster: bool = False) -> None:
        self.url = url
        self.prefix = key_prefix
        self.timeout_s = timeout_s
        self.cluster = cluster
        if cluster:  # every key of a model is in one slot ({M}); the client follows MOVED and failovers
            self._r = RedisCluster.from_url(
                url, max_connections=max_connections, socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s, decode_responses=False)
        else:
            # Bounded: past max_connections a caller waits (up to timeout_s) for a free connection. One
            # retry on a connection error: after a Redis restart every pooled connection is stale.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s, decode_responses=False,
                retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
            self._r = aioredis.Redis.from_pool(pool)  # closes the pool with the client
        self._ids: dict[tuple[str, str], int] = {}
        self._run_id: str | None = None
        self._fences: dict[tuple[str, str], str] = {}  # (model, worker) -> our fencing token (lease held)
        self._known_models: set[str] = set()
        # redis-py's Script: EVALSHA, and on NOSCRIPT (a restarted server, SCRIPT FLUSH) load and retry.
        reg = self._r.register_script
        self._store, self._remove, self._clear = reg(source("store")), reg(source("remove")), reg(source("clear"))
        self._lookup, self._wid = reg(source("lookup")), reg(source("worker_id"))
        self._save_h, self._lease = reg(source("save_handles")), reg(source("lease"))
        self._load_h, self._release = reg(source("load_handles")), reg(source("release"))

    # -- keys -------------------------------------------------------------------------------------------
    def base(self, model: str) -> str:
        """Common prefix of a model's keys, with the model as the Redis Cluster hash tag."""
        return f"{self.prefix}:{{{model}}}:"

    def blocks_key(self, model: str) -> str:
        """The model's block hash: field = 8-byte sequence hash, value = ``,member,member,``."""
        return self.base(model) + "blocks"

    @property
    def models_key(self) -> str:
        return f"{self.prefix}:models"

    async def _worker_id(self, model: str, worker: str) -> int:
        wid = self._ids.get((model, worker))
        if wid is None:
            b = self.base(model)
            wid = int(await self._wid([b + "w", b + "i", b + "seq"], [worker]))
            self._ids[(model, worker)] = wid
        if model not in self._known_models:
            await self._r.sadd(self.models_key, model)
            self._known_models.add(model)
        return wid

    async def _known_worker_id(self, model: str, worker: str) -> int | None:
        wid = self._ids.get((model, worker))
        if wid is None:
            raw = await self._r.hget(self.base(model) + "w", worker)
            if raw is None:
                return None
            wid = self._ids[(model, worker)] = int(raw)
        return wid

    # -- writes -----------------------------------------------------------------------------------------
    class _StaleId(Exception):
        """A cached worker id no longer names the worker in Redis (it restarted): ids are looked up again."""

    def _forget_ids(self) -> None:
        self._ids.clear()
        self._known_models.clear()

    async def _write(self, script: AsyncScript, model: str, member: int, hashes: Sequence[int],
                     worker: str = "") -> int:
        if len(hashes) == 0:
            return 0
        b = self.base(model)
        packed = pack_hashes(hashes, unique=True)  # the write scripts expect each field once
        token = self._fences.get((model, worker), "") if worker else ""
        return self._checked(int(await script([b + "n", b + "blocks"], [b, member, packed, worker, token])),
                             model, worker)

    def _checked(self, n: int, model: str, worker: str, token: str | None = None) -> int:
        if n == -1:
            self._forget_ids()
            raise self._StaleId(worker)
        if n == -2:
            if token != "!free":  # the sweep holds no lease: a refusal says nothing of this index's own
                self._fences[(model, worker)] = _LOST  # fenced until this index takes the lease again
            raise LeaseLost(f"{worker}: another gateway holds its lease")
        return n

    async def _member_write(self, script: AsyncScript, model: str, worker: str, tier: Tier, hashes,
                            create: bool) -> None:
        for attempt in (0, 1):
            wid = await (self._worker_id(model, worker) if create else self._known_worker_id(model, worker))
            if wid is None:
                return
            try:
                await self._write(script, model, wid * 2 + _TIER_CODE[Tier(tier)], hashes, worker)
                return
            except self._StaleId:
                if attempt:
                    raise

    async def store(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:
            return
        await self._member_write(self._store, model, worker, tier, hashes, create=True)

    async def remove(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:
            return
        await self._member_write(self._remove, model, worker, tier, hashes, create=False)

    async def store_g4(self, model: str, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:
            return
        if model not in self._known_models:
            await self._r.sadd(self.models_key, model)
            self._known_models.add(model)
        await self._write(self._store, model, G4_MEMBER, hashes)

    async def remove_g4(self, model: str, hashes: Sequence[int]) -> None:
        await self._write(self._remove, model, G4_MEMBER, hashes)

    async def _clear_member(self, model: str, member: int, worker: str, token: str) -> int:
        b = self.base(model)
        removed = 0
        for start in range(0, BUCKETS, _CLEAR_CHUNK):
            n = int(await self._clear([b + "n", b + "blocks"],
                                      [b, member, start, start + _CLEAR_CHUNK, worker, token]))
            removed += self._checked(n, model, worker, token)
        return removed

    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None, *,
                           _token: str | None = None) -> int:
        tiers = (Tier(tier),) if tier is not None else (Tier.GPU, Tier.CPU)
        # A gateway that holds no lease on the worker clears only while nobody does ('!free'): the holder's
        # ingestor clears and rebuilds on its own. Unfenced, another gateway's registry noticing the same
        # restart cleared after the holder's rebuild: the holder's state counted blocks the index had lost.
        token = _token if _token is not None else self._fences.get((model, worker)) or "!free"
        removed = 0
        for attempt in (0, 1):
            wid = await self._known_worker_id(model, worker)
            if wid is None:
                break
            try:
                for t in tiers:
                    removed += await self._clear_member(model, wid * 2 + _TIER_CODE[t], worker, token)
                break
            except self._StaleId:
                if attempt:
                    raise
        if tier is None:
            await self._drop_handles(model, worker, token, forget=_token == "!free")
        return removed

    # -- handle maps, leases, sweep ---------------------------------------------------------------------
    def _hkeys(self, model: str, worker: str) -> tuple[str, str, str, str, str]:
        """The worker's handle map, the per-worker last sequence, map version, incarnation and last lease
        renewal (the sweep's)."""
        b = self.base(model)
        return b + "h:" + worker, b + "hseq", b + "hver", b + "inc", b + "seen"

    async def save_handles(self, model: str, worker: str, upserts: dict[HandleKey, Handle],
                           deletes, seq: int | None, *, replace: bool = False,
                           incarnation: str | None = None) -> None:
        """One script, except a ``replace`` of more than ``_HANDLE_CHUNK`` handles: one script over the whole
        map held Redis for every other client (3.5 s at 2M handles), so that map is written in chunks into a
        temporary key beside the old one, then one short fenced script swaps it in with its sequence and
        incarnation and bumps the version: readers see the old map or the new one, never a part."""
        dels = np.array([k for k in deletes if k not in upserts], dtype=_HKEY).tobytes() if deletes else b""
        ups = b""
        if upserts:
            rec = np.empty(len(upserts), dtype=_HREC)
            rec["k"] = list(upserts)
            rec["v"] = list(upserts.values())
            ups = rec.tobytes()
        token = self._fences.get((model, worker), "")
        keys = list(self._hkeys(model, worker))
        args = [self.base(model), worker, token, "" if seq is None else seq, dels, ups,
                "replace" if replace else "", incarnation or ""]
        if not (replace and len(upserts) > _HANDLE_CHUNK):
            self._checked(int(await self._save_h(keys, args)), model, worker)
            return
        tmp = f"{self.base(model)}htmp:{uuid.uuid4().hex}"  # the model's hash tag: the map's Cluster slot
        step = _HANDLE_CHUNK * _HREC.itemsize
        try:
            for off in range(0, len(ups), step):
                n = await self._save_h([tmp, *keys[1:]], [self.base(model), worker, token, "", b"",
                                                         ups[off:off + step], "fill", _FILL_TTL_MS])
                self._checked(int(n), model, worker)
            args[5] = b""
            n = int(await self._save_h([*keys, tmp], args))
            if n == -3:
                raise RuntimeError(f"the new handle map of {worker} expired before it was swapped in")
            self._checked(n, model, worker)
        finally:
            try:
                await self._r.unlink(tmp)  # left after a failure (swapped in: gone already)
            except Exception:  # noqa: BLE001 - its TTL removes it
                pass

    async def load_handles(self, model: str, worker: str,
                           tries: int = 3) -> tuple[dict[HandleKey, Handle], int | None]:
        """One consistent snapshot of the map and its sequence. The map is scanned in chunks (HSCAN: no long
        block of Redis) between two reads of its version; when a writer changed it meanwhile (``tries``
        times), one script reads it whole instead. A torn read would start a gateway's state from a map
        that matches no sequence: later events then miss their parents and the state stays empty."""
        hkey, seqkey, verkey, *_ = self._hkeys(model, worker)
        for _ in range(tries):
            v0 = await self._r.hget(verkey, worker)
            out: dict[HandleKey, Handle] = {}
            cursor = 0
            while True:
                cursor, chunk = await self._r.hscan(hkey, cursor, count=10_000)
                out.update(self._decode_handles(chunk))
                if cursor == 0:
                    break
            raw = await self._r.hget(seqkey, worker)
            if await self._r.hget(verkey, worker) == v0:
                return out, (int(raw) if raw is not None else None)
        flat, raw = await self._load_h([hkey, seqkey], [worker])
        return self._decode_handles(dict(zip(flat[::2], flat[1::2]))), (int(raw) if raw is not None else None)

    @staticmethod
    def _decode_handles(chunk: dict[bytes, bytes]) -> dict[HandleKey, Handle]:
        if not chunk:
            return {}
        ks = np.frombuffer(b"".join(chunk.keys()), dtype=_HKEY)
        vs = np.frombuffer(b"".join(chunk.values()), dtype=_HVAL)
        return dict(zip(map(tuple, ks.tolist()), map(tuple, vs.tolist())))

    async def _drop_handles(self, model: str, worker: str, token: str = "", forget: bool = False) -> None:
        """The map and its sequence, in one step, fenced by ``token`` ('!free': only while nobody holds the
        lease, else LeaseLost: a writer that took it since keeps what it pushed). ``forget`` (the sweep's:
        the worker is gone): its recorded incarnation and lease renewal too."""
        mode = "forget" if forget else "drop"
        self._checked(int(await self._save_h(list(self._hkeys(model, worker)),
                                             [self.base(model), worker, token, "", b"", b"", mode, ""])),
                      model, worker, token)

    async def incarnation(self, model: str, worker: str) -> str | None:
        inc = await self._r.hget(self.base(model) + "inc", worker)
        return inc.decode() if isinstance(inc, bytes) else inc

    async def acquire_lease(self, model: str, worker: str, owner: str, ttl_s: float) -> bool:
        b = self.base(model)
        token = await self._lease([b + "lease:" + worker, b + "fence:" + worker, b + "seen"],
                                  [owner, max(1, int(ttl_s * 1000)), worker])
        if token is None:
            if (model, worker) in self._fences:
                self._fences[(model, worker)] = _LOST
            return False
        self._fences[(model, worker)] = token.decode() if isinstance(token, bytes) else str(token)
        return True

    async def release_lease(self, model: str, worker: str, owner: str) -> None:
        await self._release([self.base(model) + "lease:" + worker], [owner])  # compare and delete, atomic
        self._fences.pop((model, worker), None)

    async def sweep(self, model: str, idle_s: float) -> list[str]:
        b = self.base(model)
        seen = await self._r.hgetall(b + "seen")
        now_s, now_us = await self._r.time()
        now_ms = now_s * 1000 + now_us // 1000
        gone = []
        for raw, at in seen.items():
            name = raw.decode()
            if now_ms - int(at) < idle_s * 1000 or await self._r.exists(b + "lease:" + name):
                continue
            try:
                await self.clear_worker(model, name, _token="!free")
            except LeaseLost:  # a writer took it meanwhile
                continue
            gone.append(name)
        return gone

    async def clear_model(self, model: str) -> int:
        b = self.base(model)
        counts = await self._r.hgetall(b + "n")
        removed = sum(int(v) for v in counts.values())
        # UNLINK frees the big hash in a background thread; the reverse buckets go 2048 at a time.
        await self._r.unlink(b + "blocks", b + "n")
        for raw in counts:
            rpre = f"{b}r:{raw.decode()}:"
            await self._r.unlink(*(rpre + str(k) for k in range(BUCKETS)))
        names = [n.decode() for n in await self._r.hkeys(b + "w")]
        if names:
            await self._r.unlink(*(b + "h:" + n for n in names))
            async with self._r.pipeline(transaction=False) as p:  # one round trip for every worker's bump
                for n in names:  # a reader scanning a map now sees it changed
                    p.hincrby(b + "hver", n, 1)
                await p.execute()
        await self._r.unlink(b + "hseq")
        # Worker ids stay (other gateways may hold them in their caches); the registry entry goes.
        await self._r.srem(self.models_key, model)
        self._known_models.discard(model)
        return removed

    # -- reads ------------------------------------------------------------------------------------------
    async def lookup(
        self, model: str, hashes: Sequence[int], workers: Collection[str] | None = None
    ) -> LookupResult:
        n = len(hashes)
        if n == 0:
            return LookupResult(num_blocks=n)
        b = self.base(model)
        args: list = [pack_hashes(hashes), "0" if workers is None else "1"]
        if workers is not None:
            args.extend(workers)
        out = await self._lookup([b + "i", b + "w", b + "blocks"], args)
        found = {}
        for j in range(1, len(out), 4):
            name = out[j].decode()
            found[name] = WorkerMatch(gpu=int(out[j + 1]), cpu=int(out[j + 2]), local=int(out[j + 3]))
        return LookupResult(num_blocks=n, workers=found, g4=int(out[0]))

    async def locate(self, model: str, block_hash: int) -> BlockLocation:
        b = self.base(model)
        async with self._r.pipeline(transaction=False) as p:
            p.hget(b + "blocks", int(block_hash).to_bytes(8, "big"))
            p.hgetall(b + "i")
            value, names = await p.execute()
        by_id = {int(k): v.decode() for k, v in names.items()}
        workers: dict[str, set[Tier]] = {}
        g4 = False
        for raw in (value or b"").split(b","):
            if not raw:
                continue
            m = int(raw)
            if m == G4_MEMBER:
                g4 = True
                continue
            name = by_id.get(m // 2)
            if name is not None:
                workers.setdefault(name, set()).add(Tier.GPU if m % 2 == 0 else Tier.CPU)
        return BlockLocation(workers={w: frozenset(t) for w, t in workers.items()}, g4=g4)

    async def stats(self, model: str | None = None) -> dict:
        names = [model] if model is not None else await self.models()
        out = {}
        for name in names:
            b = self.base(name)
            async with self._r.pipeline(transaction=False) as p:
                p.hgetall(b + "n")
                p.hgetall(b + "i")
                p.hlen(b + "blocks")
                counts, ids, blocks = await p.execute()
            by_id = {int(k): v.decode() for k, v in ids.items()}
            per_tier = {t.value: 0 for t in _TIER_CODE}
            per_worker: dict[str, dict[str, int]] = {}
            g4 = 0
            for k, v in counts.items():
                m, val = int(k), int(v)
                if m == G4_MEMBER:
                    g4 = val
                elif val > 0:
                    tier = Tier.GPU if m % 2 == 0 else Tier.CPU
                    per_tier[tier.value] += val
                    per_worker.setdefault(by_id.get(m // 2, f"#{m // 2}"), {})[tier.value] = val
            if blocks == 0 and not per_worker and g4 == 0:
                continue
            out[name] = {
                "blocks": blocks, "entries_per_tier": per_tier, "g4_blocks": g4, "workers": per_worker,
            }
        if out:
            info = await self._r.info("memory")
            out_mem = int(info.get("used_memory", 0))
            for v in out.values():
                v["redis_used_memory"] = out_mem
        return out

    async def models(self) -> list[str]:
        return sorted(m.decode() for m in await self._r.smembers(self.models_key))

    async def epoch(self) -> str | None:
        """The server's ``run_id`` (new at every start): entries may be gone, whatever the persistence, and
        cached worker ids may name other workers now (they are dropped)."""
        if self.cluster:  # a failover or a restarted primary changes the set
            infos = await self._r.info("server", target_nodes=RedisCluster.PRIMARIES)
            run_id = ",".join(sorted(str(i.get("run_id")) for i in infos.values()))
        else:
            run_id = str((await self._r.info("server")).get("run_id"))
        if run_id != self._run_id:
            if self._run_id is not None:
                self._forget_ids()
            self._run_id = run_id
        return run_id

    async def ping(self) -> float:
        """Round-trip time of a bare PING, in seconds (the benchmark's baseline)."""
        import time

        t = time.perf_counter()
        await self._r.ping()
        return time.perf_counter() - t

    async def close(self) -> None:
        await self._r.aclose()
