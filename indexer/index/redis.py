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
Scripts run with EVALSHA and fall back to EVAL when the server answers NOSCRIPT (after a restart or a
SCRIPT FLUSH). Keys other than the declared ones are built inside the scripts from the same hash-tagged
base, so they live in the declared keys' slot on Redis Cluster.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.asyncio.retry import Retry

from indexer.index.base import (
    BlockIndex, BlockLocation, Handle, HandleKey, LeaseLost, LookupResult, Tier, WorkerMatch,
)

G4_MEMBER = -1
BUCKETS = 2048  # fixed: members are hash >> 11, which must fit a double's 53 bits
_TIER_CODE = {Tier.GPU: 0, Tier.CPU: 1}
_CLEAR_CHUNK = 128  # buckets per clear script call: bounds how long one call blocks Redis

_LUA_LOCALS = """
local call, find, sub, byte, char = redis.call, string.find, string.sub, string.byte, string.char
local format, floor, gmatch, min = string.format, math.floor, string.gmatch, math.min
local ipairs, unpack, tonumber, tostring = ipairs, unpack, tonumber, tostring
"""

# Globals are slow in Redis's sandbox (each access goes through a protected table): scripts use locals.
_LUA_SPLIT = _LUA_LOCALS + """
local function split(h8)
  local b1, b2, b3, b4, b5, b6, b7, b8 = byte(h8, 1, 8)
  local bucket = (b7 % 8) * 256 + b8
  local hi = ((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6
  return bucket, format('%.0f', hi * 32 + floor(b7 / 8))
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
  return char(b[1], b[2], b[3], b[4], b[5], b[6], low5 * 8 + floor(bucket / 256), bucket % 256)
end
"""

_LUA_OWNER = """
-- the caller's cached worker id must still name this worker (Redis may have restarted, ids reassigned): -1;
-- its fencing token, when it holds the worker's lease, must still be current: -2. Token '!free': only
-- while nobody holds the lease (the sweep).
local function fence_ok(base, name, token)
  if token == '' then return true end
  if token == '!free' then return call('EXISTS', base .. 'lease:' .. name) == 0 end
  return call('GET', base .. 'fence:' .. name) == token
end
local function owner_check(base, m, name, token)
  if name == '' then return 0 end
  if call('HGET', base .. 'i', tostring(floor(tonumber(m) / 2))) ~= name then return -1 end
  if not fence_ok(base, name, token) then return -2 end
  return 0
end
"""

# Writes. KEYS[1] = counts hash, KEYS[2] = blocks hash; ARGV = key base "P:{M}:", member, packed hashes
# (unique), worker name ("" for G4), fencing token ("" without a lease). Fields are read with one HMGET and
# written with one HSET/HDEL per chunk of 1000 blocks. Returns -1 (nothing written) when the member's id no
# longer names the worker, -2 when the token is stale.
_STORE = _LUA_SPLIT + _LUA_OWNER + """
local base, m, packed = ARGV[1], ARGV[2], ARGV[3]
local bad = owner_check(base, m, ARGV[4], ARGV[5])
if bad < 0 then return bad end
local rpre, tok = base .. 'r:' .. m .. ':', ',' .. m .. ','
local added = 0
for start = 1, #packed, 8000 do
  local fields = {}
  for off = start, min(#packed, start + 7999), 8 do fields[#fields + 1] = sub(packed, off, off + 7) end
  local vals = call('HMGET', KEYS[2], unpack(fields))
  local sets = {}
  for i, f in ipairs(fields) do
    local v = vals[i]
    local nv = nil
    if not v then nv = tok elseif not find(v, tok, 1, true) then nv = v .. m .. ',' end
    if nv then
      sets[#sets + 1] = f
      sets[#sets + 1] = nv
      local bucket, hi = split(f)
      call('SADD', rpre .. bucket, hi)
    end
  end
  if #sets > 0 then
    call('HSET', KEYS[2], unpack(sets))
    added = added + #sets / 2
  end
end
if added > 0 then call('HINCRBY', KEYS[1], m, added) end
return added
"""

_LUA_DROP = """
-- drop member token tok from the given fields; returns the number of fields that held it
local function drop(blocks, fields, vals, tok)
  local sets, dels = {}, {}
  for i, f in ipairs(fields) do
    local v = vals[i]
    if v then
      local s, e = find(v, tok, 1, true)
      if s then
        local nv = sub(v, 1, s) .. sub(v, e + 1)
        if nv == ',' then
          dels[#dels + 1] = f
        else
          sets[#sets + 1] = f
          sets[#sets + 1] = nv
        end
      end
    end
  end
  if #sets > 0 then call('HSET', blocks, unpack(sets)) end
  if #dels > 0 then call('HDEL', blocks, unpack(dels)) end
  return #sets / 2 + #dels
end
"""

_REMOVE = _LUA_SPLIT + _LUA_DROP + _LUA_OWNER + """
local base, m, packed = ARGV[1], ARGV[2], ARGV[3]
local bad = owner_check(base, m, ARGV[4], ARGV[5])
if bad < 0 then return bad end
local rpre, tok = base .. 'r:' .. m .. ':', ',' .. m .. ','
local removed = 0
for start = 1, #packed, 8000 do
  local fields = {}
  for off = start, min(#packed, start + 7999), 8 do fields[#fields + 1] = sub(packed, off, off + 7) end
  local vals = call('HMGET', KEYS[2], unpack(fields))
  for i, f in ipairs(fields) do
    local v = vals[i]
    if v and find(v, tok, 1, true) then
      local bucket, hi = split(f)
      call('SREM', rpre .. bucket, hi)
    end
  end
  removed = removed + drop(KEYS[2], fields, vals, tok)
end
if removed > 0 then call('HINCRBY', KEYS[1], m, -removed) end
return removed
"""

# ARGV = key base, member, first bucket, end bucket (exclusive), worker name ("" for G4), fencing token
_CLEAR = _LUA_SPLIT + _LUA_DROP + _LUA_OWNER + """
local base, m = ARGV[1], ARGV[2]
local bad = owner_check(base, m, ARGV[5], ARGV[6])
if bad < 0 then return bad end
local rpre, tok = base .. 'r:' .. m .. ':', ',' .. m .. ','
local removed = 0
for bucket = tonumber(ARGV[3]), tonumber(ARGV[4]) - 1 do
  local rkey = rpre .. bucket
  local his = call('SMEMBERS', rkey)
  for start = 1, #his, 1000 do
    local fields = {}
    for i = start, min(#his, start + 999) do fields[#fields + 1] = join(bucket, tonumber(his[i])) end
    removed = removed + drop(KEYS[2], fields, call('HMGET', KEYS[2], unpack(fields)), tok)
  end
  if #his > 0 then call('DEL', rkey) end
end
if removed > 0 then call('HINCRBY', KEYS[1], m, -removed) end
return removed
"""

# KEYS[1] = id->name hash, KEYS[2] = name->id hash, KEYS[3] = blocks hash; ARGV = packed hashes,
# "1" when only the names that follow are allowed (else "0"), [allowed names...].
# Returns {g4_run, name, gpu, cpu, local, name, ...} for workers that hold block 0.
_LOOKUP = _LUA_LOCALS + """
local packed = ARGV[1]
local allowed = nil
if ARGV[2] == '1' then
  allowed = {}
  for i = 3, #ARGV do
    local id = call('HGET', KEYS[2], ARGV[i])
    if id then allowed[tonumber(id)] = true end
  end
end
local n = #packed / 8
local v0 = call('HGET', KEYS[3], sub(packed, 1, 8))
if not v0 then return {0} end
-- block 0: who holds it; runs[wid] = {gpu, cpu, local, gpu alive, cpu alive, gpu token, cpu token}
local wids, runs = {}, {}
local g4, g4_alive = 0, false
for s in gmatch(v0, '-?%d+') do
  local m = tonumber(s)
  if m < 0 then
    g4, g4_alive = 1, true
  else
    local wid = floor(m / 2)
    if allowed == nil or allowed[wid] then
      local r = runs[wid]
      if r == nil then
        r = {0, 0, 1, false, false, ',' .. (wid * 2) .. ',', ',' .. (wid * 2 + 1) .. ','}
        runs[wid] = r
        wids[#wids + 1] = wid
      end
      if m % 2 == 0 then r[1], r[4] = 1, true else r[2], r[5] = 1, true end
    end
  end
end
-- later blocks, fetched in growing chunks (early exit stays cheap); only live runs are checked
local alive, na = {}, #wids
for i, wid in ipairs(wids) do alive[i] = runs[wid] end
local pos, chunk = 2, 16
while pos <= n and (na > 0 or g4_alive) do
  local last = min(n, pos + chunk - 1)
  local fields = {}
  for i = pos, last do fields[i - pos + 1] = sub(packed, i * 8 - 7, i * 8) end
  local vals = call('HMGET', KEYS[3], unpack(fields))
  for j = 1, #fields do
    local v = vals[j]
    if not v then
      na, g4_alive = 0, false
      break
    end
    local died = false
    for k = 1, na do
      local r = alive[k]
      local g = find(v, r[6], 1, true)
      local c = (r[5] or not g) and find(v, r[7], 1, true)
      if g or c then
        r[3] = r[3] + 1
        if r[4] then if g then r[1] = r[1] + 1 else r[4] = false end end
        if r[5] then if c then r[2] = r[2] + 1 else r[5] = false end end
      else
        r[8] = true
        died = true
      end
    end
    if died then
      local keep = {}
      for k = 1, na do if not alive[k][8] then keep[#keep + 1] = alive[k] end end
      alive, na = keep, #keep
    end
    if g4_alive then
      if find(v, ',-1,', 1, true) then g4 = g4 + 1 else g4_alive = false end
    end
    if na == 0 and not g4_alive then break end
  end
  pos = last + 1
  chunk = min(chunk * 4, 1024)
end
local out = {g4}
for _, wid in ipairs(wids) do
  local r = runs[wid]
  local name = call('HGET', KEYS[1], tostring(wid))
  if name then
    out[#out + 1] = name
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
  end
end
return out
"""

# KEYS[1] = the worker's handle map, KEYS[2] = last sequence per worker; ARGV = key base, name, token,
# seq ("" = none), deletes (12-byte keys), upserts (12-byte key + 16-byte value each). -2 when fenced.
_SAVE_HANDLES = _LUA_LOCALS + _LUA_OWNER + """
local base, name, token, seq, dels, ups = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if not fence_ok(base, name, token) then return -2 end
for start = 1, #dels, 12000 do
  local f = {}
  for off = start, min(#dels, start + 11999), 12 do f[#f + 1] = sub(dels, off, off + 11) end
  call('HDEL', KEYS[1], unpack(f))
end
for start = 1, #ups, 28000 do
  local f = {}
  for off = start, min(#ups, start + 27999), 28 do
    f[#f + 1] = sub(ups, off, off + 11)
    f[#f + 1] = sub(ups, off + 12, off + 27)
  end
  call('HSET', KEYS[1], unpack(f))
end
if seq ~= '' then call('HSET', KEYS[2], name, seq) end
return 0
"""

# KEYS[1] = lease, KEYS[2] = fencing counter, KEYS[3] = last renewal per worker (ms); ARGV = owner, ttl ms,
# name. Returns the owner's fencing token, or nil while another owner holds the lease.
_LEASE = _LUA_LOCALS + """
local cur = call('GET', KEYS[1])
local t = call('TIME')
local now = t[1] * 1000 + floor(t[2] / 1000)
if cur == ARGV[1] then
  call('PEXPIRE', KEYS[1], ARGV[2])
  call('HSET', KEYS[3], ARGV[3], now)
  return call('GET', KEYS[2])
end
if cur then return false end
call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local token = call('INCR', KEYS[2])
call('HSET', KEYS[3], ARGV[3], now)
return tostring(token)
"""

# KEYS[1] = name->id, KEYS[2] = id->name, KEYS[3] = id counter; ARGV[1] = name
_WORKER_ID = _LUA_LOCALS + """
local id = call('HGET', KEYS[1], ARGV[1])
if id then return tonumber(id) end
id = call('INCR', KEYS[3]) - 1
call('HSET', KEYS[1], ARGV[1], id)
call('HSET', KEYS[2], id, ARGV[1])
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
                 max_connections: int = 32) -> None:
        self.url = url
        self.prefix = key_prefix
        self.timeout_s = timeout_s
        # Bounded: past max_connections a caller waits (up to timeout_s) for a free connection. One retry
        # on a connection error: after a Redis restart every pooled connection is stale.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, decode_responses=False,
            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
        self._r = aioredis.Redis.from_pool(pool)  # closes the pool with the client
        self._ids: dict[tuple[str, str], int] = {}
        self._run_id: str | None = None
        self._fences: dict[tuple[str, str], str] = {}  # (model, worker) -> our fencing token (lease held)
        self._known_models: set[str] = set()
        self._store = _Script(_STORE)
        self._remove = _Script(_REMOVE)
        self._clear = _Script(_CLEAR)
        self._lookup = _Script(_LOOKUP)
        self._wid = _Script(_WORKER_ID)
        self._save_h = _Script(_SAVE_HANDLES)
        self._lease = _Script(_LEASE)

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
    class _StaleId(Exception):
        """A cached worker id no longer names the worker in Redis (it restarted): ids are looked up again."""

    def _forget_ids(self) -> None:
        self._ids.clear()
        self._known_models.clear()

    async def _write(self, script: _Script, model: str, member: int, hashes: Sequence[int],
                     worker: str = "") -> int:
        if len(hashes) == 0:
            return 0
        b = self.base(model)
        packed = pack_hashes(hashes, unique=True)  # the write scripts expect each field once
        token = self._fences.get((model, worker), "") if worker else ""
        return self._checked(int(await script(self._r, [b + "n", b + "blocks"], [b, member, packed, worker, token])),
                             model, worker)

    def _checked(self, n: int, model: str, worker: str) -> int:
        if n == -1:
            self._forget_ids()
            raise self._StaleId(worker)
        if n == -2:
            self._fences[(model, worker)] = _LOST  # fenced until this index takes the lease again
            raise LeaseLost(f"{worker}: another gateway holds its lease")
        return n

    async def _member_write(self, script: _Script, model: str, worker: str, tier: Tier, hashes,
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

    async def _clear_member(self, model: str, member: int, worker: str = "", token: str | None = None) -> int:
        b = self.base(model)
        if token is None:
            token = self._fences.get((model, worker), "") if worker else ""
        removed = 0
        for start in range(0, BUCKETS, _CLEAR_CHUNK):
            n = int(await self._clear(self._r, [b + "n", b + "blocks"],
                                      [b, member, start, start + _CLEAR_CHUNK, worker, token]))
            removed += self._checked(n, model, worker)
        return removed

    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None, *,
                           _token: str | None = None) -> int:
        tiers = (Tier(tier),) if tier is not None else (Tier.GPU, Tier.CPU)
        removed = 0
        for attempt in (0, 1):
            wid = await self._known_worker_id(model, worker)
            if wid is None:
                break
            try:
                for t in tiers:
                    removed += await self._clear_member(model, wid * 2 + _TIER_CODE[t], worker, _token)
                break
            except self._StaleId:
                if attempt:
                    raise
        if tier is None:
            await self._drop_handles(model, worker)
        return removed

    # -- handle maps, leases, sweep ---------------------------------------------------------------------
    def _hkeys(self, model: str, worker: str) -> tuple[str, str]:
        b = self.base(model)
        return b + "h:" + worker, b + "hseq"

    async def save_handles(self, model: str, worker: str, upserts: dict[HandleKey, Handle],
                           deletes, seq: int | None) -> None:
        dels = np.array([k for k in deletes if k not in upserts], dtype=_HKEY).tobytes() if deletes else b""
        ups = b""
        if upserts:
            rec = np.empty(len(upserts), dtype=_HREC)
            rec["k"] = list(upserts)
            rec["v"] = list(upserts.values())
            ups = rec.tobytes()
        token = self._fences.get((model, worker), "")
        n = await self._save_h(self._r, list(self._hkeys(model, worker)),
                               [self.base(model), worker, token, "" if seq is None else seq, dels, ups])
        self._checked(int(n), model, worker)

    async def load_handles(self, model: str, worker: str) -> tuple[dict[HandleKey, Handle], int | None]:
        hkey, seqkey = self._hkeys(model, worker)
        out: dict[HandleKey, Handle] = {}
        cursor = 0
        while True:
            cursor, chunk = await self._r.hscan(hkey, cursor, count=10_000)
            if chunk:
                ks = np.frombuffer(b"".join(chunk.keys()), dtype=_HKEY)
                vs = np.frombuffer(b"".join(chunk.values()), dtype=_HVAL)
                out.update(zip(map(tuple, ks.tolist()), map(tuple, vs.tolist())))
            if cursor == 0:
                break
        raw = await self._r.hget(seqkey, worker)
        return out, (int(raw) if raw is not None else None)

    async def _drop_handles(self, model: str, worker: str) -> None:
        hkey, seqkey = self._hkeys(model, worker)
        await self._r.unlink(hkey)
        await self._r.hdel(seqkey, worker)

    async def acquire_lease(self, model: str, worker: str, owner: str, ttl_s: float) -> bool:
        b = self.base(model)
        token = await self._lease(self._r, [b + "lease:" + worker, b + "fence:" + worker, b + "seen"],
                                  [owner, max(1, int(ttl_s * 1000)), worker])
        if token is None:
            if (model, worker) in self._fences:
                self._fences[(model, worker)] = _LOST
            return False
        self._fences[(model, worker)] = token.decode() if isinstance(token, bytes) else str(token)
        return True

    async def release_lease(self, model: str, worker: str, owner: str) -> None:
        b = self.base(model)
        key = b + "lease:" + worker
        if await self._r.get(key) == owner.encode():
            await self._r.delete(key)
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
            await self._r.hdel(b + "seen", name)
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
        out = await self._lookup(self._r, [b + "i", b + "w", b + "blocks"], args)
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
        info = await self._r.info("server")
        run_id = str(info.get("run_id"))
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
