"""Which worker created each Responses API response id, shared by every gateway replica.

vLLM keeps a stored response (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the one server that
created it: a follow-up with ``previous_response_id``, and a GET, cancel or delete of that id, succeed
only there. The gateway learns the owner from the responses passing through it and keeps it here, next
to the block index (the same backend and Redis settings), so a follow-up that reaches another gateway
replica still goes to the right worker.

A record is ``{"worker", "model", "history"}``: ``history`` is the conversation vLLM will prepend to a
follow-up (its stored input messages without system ones, then the response's output messages), so the
gateway can tokenize the follow-up exactly and predict its cached prefix; None when unknown (a response
still in the background, or one too large to keep). Every record expires after ``ttl_s`` and at most
``max_entries`` are kept (the oldest go first): an expired id is answered 404 like one never seen.
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


class ResponseOwners(abc.ABC):
    """The seam: response id -> record (see the module docstring)."""

    @abc.abstractmethod
    async def put(self, response_id: str, record: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    async def delete(self, response_id: str) -> None: ...

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
