"""Which worker created each Responses API response id, shared by every gateway replica.

vLLM keeps a stored response (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the one server that
created it: a follow-up with ``previous_response_id``, and a GET, cancel or delete of that id, succeed
only there. The gateway learns the owner from the responses passing through it and keeps it here, next
to the block index (the same backend and Redis settings), so a follow-up that reaches another gateway
replica still goes to the right worker.

A record is ``{"worker", "model", "parent", "delta"}``: ``parent`` is the response it followed up
(``previous_response_id``, or None), ``delta`` the messages this turn adds to the conversation vLLM will
prepend to a follow-up (its input messages without system ones, then its output messages); None when
unknown (a response still in the background, or a turn too large to keep). :meth:`chain` walks the
parents, so the whole conversation is the deltas in order: each turn is stored once, and a chain costs
memory in proportion to its conversation, not to its square. Every record expires after ``ttl_s`` (a walk
renews the records it visits) and at most ``max_entries`` are kept (the oldest go first): an expired id
is answered 404 like one never seen. The deltas together take at most ``delta_max_bytes`` (their JSON):
past it the least recently used records lose theirs and keep the owner, so a follow-up still reaches its
worker (routed on load, as a turn too large to keep). Without it a stream of large single-shot requests
(``store`` is on by default) kept every input whole for the TTL: 55 MiB after 64 requests of 900 KB.
"""
from __future__ import annotations

import abc
import json
import time
from collections import OrderedDict
from typing import Any

DELTA_MAX_BYTES = 256 * 1024 * 1024  # the deltas' JSON, all records together (router.config ResponsesConfig)

# The keys: KEYS[1] the record, KEYS[2] ids by last use (the entry bound and the TTL), KEYS[3] ids with a
# delta by last use, KEYS[4] id -> its delta's bytes, KEYS[5] the deltas' total bytes; ARGV[6]: the
# records' key prefix (same hash tag). ``_forget`` takes an id's delta out of the byte account.
_FORGET = """
local function forget(id)
  local n = tonumber(redis.call('HGET', KEYS[4], id) or '0')
  if n > 0 then
    redis.call('HDEL', KEYS[4], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('DECRBY', KEYS[5], n)
  end
end
"""

# SET the record with its TTL, index it by time, drop the expired and the oldest past the entry bound,
# then strip the least recently used deltas past the byte bound: one round trip, atomic.
# ARGV: record JSON, ttl, now, id, max entries, key prefix, its delta's bytes, max delta bytes.
_PUT = _FORGET + """
local id, now, ttl = ARGV[4], tonumber(ARGV[3]), tonumber(ARGV[2])
forget(id)
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', KEYS[2], now, id)
local size = tonumber(ARGV[7])
if size > 0 then
  redis.call('HSET', KEYS[4], id, size)
  redis.call('ZADD', KEYS[3], now, id)
  redis.call('INCRBY', KEYS[5], size)
end
for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do forget(old) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
local n = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if n > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, n - 1)) do
    redis.call('DEL', ARGV[6] .. old)
    forget(old)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, n - 1)
end
local limit = tonumber(ARGV[8])
while tonumber(redis.call('GET', KEYS[5]) or '0') > limit do
  local first = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #first == 0 then break end
  local key = ARGV[6] .. first[1]
  local raw = redis.call('GET', key)
  if raw then
    local ok, rec = pcall(cjson.decode, raw)
    if ok and type(rec) == 'table' then
      rec['delta'] = cjson.null
      redis.call('SET', key, cjson.encode(rec), 'KEEPTTL')
    end
  end
  forget(first[1])
end
return 1
"""

# Walk the parents of ARGV[1] (at most ARGV[2] records), renewing each one (its TTL, and its place in the
# indexes: by last use): newest first. ARGV[3]: the records' key prefix, ARGV[4] the TTL, ARGV[5] now.
_CHAIN = """
local out = {}
local id = ARGV[1]
for _ = 1, tonumber(ARGV[2]) do
  local key = ARGV[3] .. id
  local raw = redis.call('GET', key)
  if not raw then break end
  redis.call('EXPIRE', key, ARGV[4])
  redis.call('ZADD', KEYS[1], 'XX', ARGV[5], id)
  redis.call('ZADD', KEYS[2], 'XX', ARGV[5], id)
  out[#out + 1] = raw
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec['parent']) ~= 'string' then break end
  id = rec['parent']
end
return out
"""

_DELETE = _FORGET + """
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
forget(ARGV[1])
return 1
"""


def delta_bytes(record: dict[str, Any]) -> int:
    """What a record's delta counts against the byte bound: its JSON (0 without one)."""
    delta = record.get("delta")
    return 0 if delta is None else len(json.dumps(delta, separators=(",", ":")))


class ResponseOwners(abc.ABC):
    """The seam: response id -> record (see the module docstring)."""

    @abc.abstractmethod
    async def put(self, response_id: str, record: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def delete(self, response_id: str) -> None: ...

    @abc.abstractmethod
    async def chain(self, response_id: str, max_depth: int) -> list[dict[str, Any]]:
        """The record of ``response_id`` and its parents', newest first (up to ``max_depth``; it stops
        early at a record without parent or a missing one)."""

    async def close(self) -> None:
        return None


class MemoryOwners(ResponseOwners):
    """One gateway's owners, in memory (the embedded default, like ``MemoryIndex``), least recently used
    first (a walk renews what it visits)."""

    def __init__(self, ttl_s: float, max_entries: int, delta_max_bytes: int = DELTA_MAX_BYTES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max(1, max_entries)
        self.delta_max_bytes = max(0, delta_max_bytes)
        self._d: OrderedDict[str, tuple[float, dict]] = OrderedDict()
        self._deltas: OrderedDict[str, int] = OrderedDict()  # id -> its delta's bytes, least recent first
        self.delta_bytes = 0

    def _drop(self, response_id: str) -> None:
        self._d.pop(response_id, None)
        self.delta_bytes -= self._deltas.pop(response_id, 0)

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        self._drop(response_id)
        now = time.monotonic()
        self._d[response_id] = (now + self.ttl_s, record)
        size = delta_bytes(record)
        if size:
            self._deltas[response_id] = size
            self.delta_bytes += size
        while self._d and (len(self._d) > self.max_entries or next(iter(self._d.values()))[0] < now):
            self._drop(next(iter(self._d)))
        while self.delta_bytes > self.delta_max_bytes and self._deltas:
            rid, size = self._deltas.popitem(last=False)
            self.delta_bytes -= size
            exp, rec = self._d[rid]
            self._d[rid] = (exp, {**rec, "delta": None})

    async def get(self, response_id: str) -> dict[str, Any] | None:
        item = self._d.get(response_id)
        if item is None:
            return None
        if item[0] < time.monotonic():
            self._drop(response_id)
            return None
        return item[1]

    async def delete(self, response_id: str) -> None:
        self._drop(response_id)

    async def chain(self, response_id: str, max_depth: int) -> list[dict[str, Any]]:
        out: list[dict] = []
        rid: Any = response_id
        while isinstance(rid, str) and len(out) < max_depth:
            rec = await self.get(rid)
            if rec is None:
                break
            self._d[rid] = (time.monotonic() + self.ttl_s, rec)
            self._d.move_to_end(rid)
            if rid in self._deltas:
                self._deltas.move_to_end(rid)
            out.append(rec)
            rid = rec.get("parent")
        return out

    def __len__(self) -> int:
        return len(self._d)


class RedisOwners(ResponseOwners):
    """Owners in Redis, shared by every gateway on it: ``<prefix>:{resp}:<id>`` (JSON, with a TTL) and the
    ``<prefix>:{resp}`` sorted set (id by time) that bounds their number; one Redis Cluster hash tag, so
    the script's keys share a slot."""

    def __init__(self, url: str, key_prefix: str = "kvg", timeout_s: float = 2.0, *, ttl_s: float,
                 max_entries: int, delta_max_bytes: int = DELTA_MAX_BYTES) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    decode_responses=False)
        self.prefix = f"{key_prefix}:{{resp}}"
        self.ttl_s = max(1, int(ttl_s))
        self.max_entries = max(1, max_entries)
        self.delta_max_bytes = max(0, delta_max_bytes)
        self._put = self._r.register_script(_PUT)
        self._chain = self._r.register_script(_CHAIN)
        self._delete = self._r.register_script(_DELETE)

    def _keys(self, response_id: str) -> list[str]:
        p = self.prefix
        return [self.key(response_id), p, f"{p}:d", f"{p}:dsz", f"{p}:dbytes"]

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:{response_id}"

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._put(keys=self._keys(response_id),
                        args=[json.dumps(record, separators=(",", ":")), self.ttl_s, time.time(), response_id,
                              self.max_entries, self.prefix + ":", delta_bytes(record), self.delta_max_bytes])

    async def get(self, response_id: str) -> dict[str, Any] | None:
        raw = await self._r.get(self.key(response_id))
        if raw is None:
            return None
        try:
            rec = json.loads(raw)
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    async def chain(self, response_id: str, max_depth: int) -> list[dict[str, Any]]:
        raws = await self._chain(keys=[self.prefix, f"{self.prefix}:d"],
                                 args=[response_id, max(1, max_depth), self.prefix + ":", self.ttl_s,
                                       time.time()])
        out = []
        for raw in raws:
            try:
                rec = json.loads(raw)
            except ValueError:
                break
            if not isinstance(rec, dict):
                break
            out.append(rec)
        return out

    async def delete(self, response_id: str) -> None:
        await self._delete(keys=self._keys(response_id), args=[response_id])

    async def close(self) -> None:
        await self._r.aclose()


def create_owners(index_settings: Any, ttl_s: float, max_entries: int,
                  delta_max_bytes: int = DELTA_MAX_BYTES) -> ResponseOwners:
    """The owner store on the index's backend (``router.config.IndexConfig``: backend, redis_url, ...)."""
    if getattr(index_settings, "backend", "memory") == "redis":
        return RedisOwners(index_settings.redis_url, getattr(index_settings, "key_prefix", "kvg"),
                           getattr(index_settings, "timeout_s", 2.0), ttl_s=ttl_s, max_entries=max_entries,
                           delta_max_bytes=delta_max_bytes)
    return MemoryOwners(ttl_s, max_entries, delta_max_bytes)
