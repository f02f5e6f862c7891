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
is answered 404 like one never seen.
"""
from __future__ import annotations

import abc
import json
import time
from collections import OrderedDict
from typing import Any

# SET the record with its TTL, index it by time, then trim the index (and the records it drops) to the
# bound: one round trip, atomic.
_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3] - ARGV[2])
local n = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if n > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, n - 1)
  for _, id in ipairs(old) do redis.call('DEL', ARGV[6] .. id) end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, n - 1)
end
return 1
"""

# Walk the parents of ARGV[1] (at most ARGV[2] records), renewing each one's TTL: newest first.
_CHAIN = """
local out = {}
local id = ARGV[1]
for _ = 1, tonumber(ARGV[2]) do
  local key = ARGV[3] .. id
  local raw = redis.call('GET', key)
  if not raw then break end
  redis.call('EXPIRE', key, ARGV[4])
  out[#out + 1] = raw
  local ok, rec = pcall(cjson.decode, raw)
  if not ok or type(rec) ~= 'table' or type(rec['parent']) ~= 'string' then break end
  id = rec['parent']
end
return out
"""


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
    """One gateway's owners, in memory (the embedded default, like ``MemoryIndex``)."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max(1, max_entries)
        self._d: OrderedDict[str, tuple[float, dict]] = OrderedDict()

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        self._d.pop(response_id, None)
        self._d[response_id] = (time.monotonic() + self.ttl_s, record)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        item = self._d.get(response_id)
        if item is None:
            return None
        if item[0] < time.monotonic():
            del self._d[response_id]
            return None
        return item[1]

    async def delete(self, response_id: str) -> None:
        self._d.pop(response_id, None)

    async def chain(self, response_id: str, max_depth: int) -> list[dict[str, Any]]:
        out: list[dict] = []
        rid: Any = response_id
        while isinstance(rid, str) and len(out) < max_depth:
            rec = await self.get(rid)
            if rec is None:
                break
            self._d[rid] = (time.monotonic() + self.ttl_s, rec)
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
                 max_entries: int) -> None:
        import redis.asyncio as aioredis

        self._r = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    decode_responses=False)
        self.prefix = f"{key_prefix}:{{resp}}"
        self.ttl_s = max(1, int(ttl_s))
        self.max_entries = max(1, max_entries)
        self._put = self._r.register_script(_PUT)
        self._chain = self._r.register_script(_CHAIN)

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:{response_id}"

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._put(keys=[self.key(response_id), self.prefix],
                        args=[json.dumps(record, separators=(",", ":")), self.ttl_s, time.time(), response_id,
                              self.max_entries, self.prefix + ":"])

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
        raws = await self._chain(keys=[self.key(response_id)],
                                 args=[response_id, max(1, max_depth), self.prefix + ":", self.ttl_s])
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
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self.key(response_id))
        pipe.zrem(self.prefix, response_id)
        await pipe.execute()

    async def close(self) -> None:
        await self._r.aclose()


def create_owners(index_settings: Any, ttl_s: float, max_entries: int) -> ResponseOwners:
    """The owner store on the index's backend (``router.config.IndexConfig``: backend, redis_url, ...)."""
    if getattr(index_settings, "backend", "memory") == "redis":
        return RedisOwners(index_settings.redis_url, getattr(index_settings, "key_prefix", "kvg"),
                           getattr(index_settings, "timeout_s", 2.0), ttl_s=ttl_s, max_entries=max_entries)
    return MemoryOwners(ttl_s, max_entries)
