"""Redis index: the production backend, shared by every gateway process of a fleet.

Key schema (``P`` = key prefix, default ``kvg``; ``M`` = model name; ``{M}`` is a Redis Cluster hash tag,
so every key of a model lives in one slot and one script can touch them all):

==============================  =====  ===========================================================
key                             type   content
==============================  =====  ===========================================================
``P:{M}:b:<8 bytes>``           set    one per block, named by the sequence hash (8 raw bytes, big
                                       endian); members are small ints: ``wid*2 + tier`` (tier 0 GPU,
                                       1 CPU) and ``-1`` for G4. Tiny sets stay intset-encoded.
``P:{M}:r:<member>:<bucket>``   set    reverse index of one (worker, tier) -- or of G4 for member -1 --
                                       sharded into 2048 buckets by ``hash & 2047``; members are
                                       ``hash >> 11`` (53 bits: exact in Lua's doubles, intset-encoded).
``P:{M}:w`` / ``P:{M}:i``       hash   worker name -> id and id -> name (ids are never reused).
``P:{M}:seq``                   str    the next worker id.
``P:{M}:n``                     hash   entry counts per member, and ``blocks`` (distinct block keys).
``P:models``                    set    model names that have entries (outside the hash tag).
==============================  =====  ===========================================================

Why this shape: a (block, worker) entry costs one small int in an intset plus 8 bytes in a reverse
bucket, and the block key itself is paid once per block whatever the number of holders (see
docs/BENCHMARKS.md for the measured bytes per entry). Dropping a worker walks only that worker's 2048
reverse buckets -- no SCAN of the keyspace. Entries carry no unbounded data: names live once in ``w``/``i``.

Why a server-side Lua script and not a pipeline for ``lookup``: a pipeline must ask for every hash of the
prompt (8K SMEMBERS for a 128K-token prompt at block size 16) even when the first block already misses,
and returns all of it to Python. The script walks the hashes in Redis -- SMEMBERS on the first block, then
one SMISMEMBER per block asking only about the members whose run is still alive --, stops as soon as no
worker and not G4 can extend its run, and returns only the per-worker counts: one round trip, an early
exit, work proportional to the runs rather than blocks x workers, and an atomic snapshot. Writes use scripts too: one EVALSHA per event batch whatever its number of blocks, with
the hashes packed into one binary argument (Python's work per block is a numpy byte copy).
Scripts are run with EVALSHA and fall back to EVAL when the server answers NOSCRIPT (after a restart or a
SCRIPT FLUSH). Keys other than the declared one are built inside the scripts; they share the declared
key's hash tag, so this holds on Redis Cluster.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from indexer.index.base import BlockIndex, BlockLocation, LookupResult, Tier, WorkerMatch

G4_MEMBER = -1
BUCKETS = 2048  # fixed: members are hash >> 11, which must fit a double's 53 bits
_TIER_CODE = {Tier.GPU: 0, Tier.CPU: 1}
_CLEAR_CHUNK = 256  # buckets per clear script call: bounds how long one call blocks Redis

_LUA_SPLIT = """
local function split(h8)
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(h8, 1, 8)
  local bucket = (b7 % 8) * 256 + b8
  local hi = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
  return bucket, string.format('%.0f', hi * 32 + math.floor(b7 / 8))
end
local function join(bucket, hi)
  local low5 = hi % 32
  local rest = (hi - low5) / 32
  local b = {}
  for i = 6, 1, -1 do
    local x = rest % 256
    b[i] = x
    rest = (rest - x) / 256
  end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6], low5 * 8 + math.floor(bucket / 256), bucket % 256)
end
"""

# KEYS[1] = counts hash; ARGV = key base "P:{M}:", member, packed hashes
_STORE = _LUA_SPLIT + """
local base, m, packed = ARGV[1], ARGV[2], ARGV[3]
local bpre, rpre = base .. 'b:', base .. 'r:' .. m .. ':'
local added, fresh = 0, 0
for off = 1, #packed, 8 do
  local h8 = string.sub(packed, off, off + 7)
  local key = bpre .. h8
  if redis.call('SADD', key, m) == 1 then
    added = added + 1
    if redis.call('SCARD', key) == 1 then fresh = fresh + 1 end
    local bucket, hi = split(h8)
    redis.call('SADD', rpre .. bucket, hi)
  end
end
if added > 0 then
  redis.call('HINCRBY', KEYS[1], m, added)
  if fresh > 0 then redis.call('HINCRBY', KEYS[1], 'blocks', fresh) end
end
return added
"""

_REMOVE = _LUA_SPLIT + """
local base, m, packed = ARGV[1], ARGV[2], ARGV[3]
local bpre, rpre = base .. 'b:', base .. 'r:' .. m .. ':'
local removed, gone = 0, 0
for off = 1, #packed, 8 do
  local h8 = string.sub(packed, off, off + 7)
  local key = bpre .. h8
  if redis.call('SREM', key, m) == 1 then
    removed = removed + 1
    if redis.call('EXISTS', key) == 0 then gone = gone + 1 end
    local bucket, hi = split(h8)
    redis.call('SREM', rpre .. bucket, hi)
  end
end
if removed > 0 then
  redis.call('HINCRBY', KEYS[1], m, -removed)
  if gone > 0 then redis.call('HINCRBY', KEYS[1], 'blocks', -gone) end
end
return removed
"""

# ARGV = key base, member, first bucket, end bucket (exclusive)
_CLEAR = _LUA_SPLIT + """
local base, m = ARGV[1], ARGV[2]
local bpre, rpre = base .. 'b:', base .. 'r:' .. m .. ':'
local removed, gone = 0, 0
for bucket = tonumber(ARGV[3]), tonumber(ARGV[4]) - 1 do
  local rkey = rpre .. bucket
  local his = redis.call('SMEMBERS', rkey)
  for _, s in ipairs(his) do
    local key = bpre .. join(bucket, tonumber(s))
    if redis.call('SREM', key, m) == 1 then
      removed = removed + 1
      if redis.call('EXISTS', key) == 0 then gone = gone + 1 end
    end
  end
  if #his > 0 then redis.call('DEL', rkey) end
end
if removed > 0 then
  redis.call('HINCRBY', KEYS[1], m, -removed)
  if gone > 0 then redis.call('HINCRBY', KEYS[1], 'blocks', -gone) end
end
return removed
"""

# KEYS[1] = id->name hash, KEYS[2] = name->id hash; ARGV = key base, packed hashes, [allowed names...]
# Returns {g4_run, name, gpu, cpu, local, name, ...} for workers whose local run is > 0.
_LOOKUP = """
local bpre, packed = ARGV[1] .. 'b:', ARGV[2]
local allowed = nil
if #ARGV > 2 then
  allowed = {}
  for i = 3, #ARGV do
    local id = redis.call('HGET', KEYS[2], ARGV[i])
    if id then allowed[tonumber(id)] = true end
  end
end
-- block 0: who holds it (SMEMBERS); runs[wid] = {gpu, cpu, local, gpu alive, cpu alive}
local wids, runs = {}, {}
local g4, g4_alive = 0, false
for _, s in ipairs(redis.call('SMEMBERS', bpre .. string.sub(packed, 1, 8))) do
  local m = tonumber(s)
  if m < 0 then
    g4, g4_alive = 1, true
  else
    local wid = math.floor(m / 2)
    if allowed == nil or allowed[wid] then
      local r = runs[wid]
      if r == nil then
        r = {0, 0, 1, false, false}
        runs[wid] = r
        wids[#wids + 1] = wid
      end
      if m % 2 == 0 then r[1], r[4] = 1, true else r[2], r[5] = 1, true end
    end
  end
end
-- later blocks: SMISMEMBER for the members still alive only; stop when nothing can grow
local alive, args, stale = wids, nil, true
local off = 9
while off <= #packed and (#alive > 0 or g4_alive) do
  if stale then
    args = {}
    for _, wid in ipairs(alive) do
      args[#args + 1] = wid * 2
      args[#args + 1] = wid * 2 + 1
    end
    if g4_alive then args[#args + 1] = -1 end
    stale = false
  end
  local res = redis.call('SMISMEMBER', bpre .. string.sub(packed, off, off + 7), unpack(args))
  local nxt = {}
  for j, wid in ipairs(alive) do
    local g, c = res[2 * j - 1] == 1, res[2 * j] == 1
    if g or c then
      local r = runs[wid]
      r[3] = r[3] + 1
      if r[4] then if g then r[1] = r[1] + 1 else r[4] = false end end
      if r[5] then if c then r[2] = r[2] + 1 else r[5] = false end end
      nxt[#nxt + 1] = wid
    end
  end
  if #nxt ~= #alive then stale = true end
  alive = nxt
  if g4_alive then
    if res[#res] == 1 then g4 = g4 + 1 else g4_alive = false; stale = true end
  end
  off = off + 8
end
local out = {g4}
for _, wid in ipairs(wids) do
  local r = runs[wid]
  local name = redis.call('HGET', KEYS[1], tostring(wid))
  if name then
    out[#out + 1] = name
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
  end
end
return out
"""

# KEYS[1] = name->id, KEYS[2] = id->name, KEYS[3] = id counter; ARGV[1] = name
_WORKER_ID = """
local id = redis.call('HGET', KEYS[1], ARGV[1])
if id then return tonumber(id) end
id = redis.call('INCR', KEYS[3]) - 1
redis.call('HSET', KEYS[1], ARGV[1], id)
redis.call('HSET', KEYS[2], id, ARGV[1])
return id
"""


class _Script:
    """EVALSHA, falling back to EVAL (which also caches the script) when the server answers NOSCRIPT."""

    def __init__(self, source: str) -> None:
        import hashlib

        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, client: aioredis.Redis, keys: Sequence, args: Sequence):
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Sequence hashes as one string of 8-byte big-endian values (the scripts' input)."""
    if isinstance(hashes, np.ndarray):
        return hashes.astype(">u8", copy=False).tobytes()
    return np.array(hashes, dtype=">u8").tobytes()


class RedisIndex(BlockIndex):
    name = "redis"

    def __init__(self, url: str, key_prefix: str = "kvg", timeout_s: float = 2.0) -> None:
        self.url = url
        self.prefix = key_prefix
        self.timeout_s = timeout_s
        self._r = aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False
        )
        self._ids: dict[tuple[str, str], int] = {}
        self._known_models: set[str] = set()
        self._store = _Script(_STORE)
        self._remove = _Script(_REMOVE)
        self._clear = _Script(_CLEAR)
        self._lookup = _Script(_LOOKUP)
        self._wid = _Script(_WORKER_ID)

    # -- keys -------------------------------------------------------------------------------------------
    def base(self, model: str) -> str:
        """Common prefix of a model's keys, with the model as the Redis Cluster hash tag."""
        return f"{self.prefix}:{{{model}}}:"

    def block_key(self, model: str, block_hash: int) -> bytes:
        return self.base(model).encode() + b"b:" + int(block_hash).to_bytes(8, "big")

    @property
    def models_key(self) -> str:
        return f"{self.prefix}:models"

    async def _worker_id(self, model: str, worker: str) -> int:
        wid = self._ids.get((model, worker))
        if wid is None:
            b = self.base(model)
            wid = int(await self._wid(self._r, [b + "w", b + "i", b + "seq"], [worker]))
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
    async def _write(self, script: _Script, model: str, member: int, hashes: Sequence[int]) -> int:
        if len(hashes) == 0:
            return 0
        b = self.base(model)
        return int(await script(self._r, [b + "n"], [b, member, pack_hashes(hashes)]))

    async def store(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:
            return
        wid = await self._worker_id(model, worker)
        await self._write(self._store, model, wid * 2 + _TIER_CODE[Tier(tier)], hashes)

    async def remove(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:
            return
        wid = await self._known_worker_id(model, worker)
        if wid is not None:
            await self._write(self._remove, model, wid * 2 + _TIER_CODE[Tier(tier)], hashes)

    async def store_g4(self, model: str, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:
            return
        if model not in self._known_models:
            await self._r.sadd(self.models_key, model)
            self._known_models.add(model)
        await self._write(self._store, model, G4_MEMBER, hashes)

    async def remove_g4(self, model: str, hashes: Sequence[int]) -> None:
        await self._write(self._remove, model, G4_MEMBER, hashes)

    async def _clear_member(self, model: str, member: int) -> int:
        b = self.base(model)
        removed = 0
        for start in range(0, BUCKETS, _CLEAR_CHUNK):
            removed += int(await self._clear(self._r, [b + "n"], [b, member, start, start + _CLEAR_CHUNK]))
        return removed

    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None) -> int:
        wid = await self._known_worker_id(model, worker)
        if wid is None:
            return 0
        tiers = (Tier(tier),) if tier is not None else (Tier.GPU, Tier.CPU)
        removed = 0
        for t in tiers:
            removed += await self._clear_member(model, wid * 2 + _TIER_CODE[t])
        return removed

    async def clear_model(self, model: str) -> int:
        b = self.base(model)
        ids = await self._r.hkeys(b + "i")
        removed = await self._clear_member(model, G4_MEMBER)
        for raw in ids:
            wid = int(raw)
            for code in _TIER_CODE.values():
                removed += await self._clear_member(model, wid * 2 + code)
        # Worker ids stay (other gateways may hold them in their caches); counts and the registry go.
        await self._r.delete(b + "n")
        await self._r.srem(self.models_key, model)
        self._known_models.discard(model)
        return removed

    # -- reads ------------------------------------------------------------------------------------------
    async def lookup(
        self, model: str, hashes: Sequence[int], workers: Collection[str] | None = None
    ) -> LookupResult:
        n = len(hashes)
        if n == 0 or (workers is not None and len(workers) == 0):
            return LookupResult(num_blocks=n)
        b = self.base(model)
        args: list = [b, pack_hashes(hashes)]
        if workers is not None:
            args.extend(workers)
        out = await self._lookup(self._r, [b + "i", b + "w"], args)
        found = {}
        for j in range(1, len(out), 4):
            name = out[j].decode()
            found[name] = WorkerMatch(gpu=int(out[j + 1]), cpu=int(out[j + 2]), local=int(out[j + 3]))
        return LookupResult(num_blocks=n, workers=found, g4=int(out[0]))

    async def locate(self, model: str, block_hash: int) -> BlockLocation:
        b = self.base(model)
        async with self._r.pipeline(transaction=False) as p:
            p.smembers(self.block_key(model, block_hash))
            p.hgetall(b + "i")
            members, names = await p.execute()
        by_id = {int(k): v.decode() for k, v in names.items()}
        workers: dict[str, set[Tier]] = {}
        g4 = False
        for raw in members:
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
                counts, ids = await p.execute()
            by_id = {int(k): v.decode() for k, v in ids.items()}
            per_tier = {t.value: 0 for t in _TIER_CODE}
            per_worker: dict[str, dict[str, int]] = {}
            g4 = blocks = 0
            for k, v in counts.items():
                key, val = k.decode(), int(v)
                if key == "blocks":
                    blocks = val
                    continue
                m = int(key)
                if m == G4_MEMBER:
                    g4 = val
                elif val > 0:
                    tier = Tier.GPU if m % 2 == 0 else Tier.CPU
                    per_tier[tier.value] += val
                    per_worker.setdefault(by_id.get(m // 2, f"#{m // 2}"), {})[tier.value] = val
            if blocks == 0 and not per_worker and g4 == 0:
                continue
            out[name] = {"blocks": blocks, "entries_per_tier": per_tier, "g4_blocks": g4, "workers": per_worker}
        if out:
            info = await self._r.info("memory")
            out_mem = int(info.get("used_memory", 0))
            for v in out.values():
                v["redis_used_memory"] = out_mem
        return out

    async def models(self) -> list[str]:
        return sorted(m.decode() for m in await self._r.smembers(self.models_key))

    async def ping(self) -> float:
        """Round-trip time of a bare PING, in seconds (the benchmark's baseline)."""
        import time

        t = time.perf_counter()
        await self._r.ping()
        return time.perf_counter() - t

    async def close(self) -> None:
        await self._r.aclose()
