"""The request path's view of the index: a short deadline and a circuit breaker around ``lookup``.

Why: the index answers in well under a millisecond when it is up; when Redis is down or slow, a request
must not wait seconds for it. Each lookup gets ``index.lookup_timeout_s`` (tens of ms); after
``index.breaker_failures`` failures in a row the breaker opens and lookups fail at once for
``index.breaker_open_s``, then one goes through to try again (purgatory's half-open state). A failed or
skipped lookup routes *degraded*: load-aware and cache-blind (every worker matches nothing). Each such
request counts in ``kvgate_routing_degraded_total{reason}``; the warning is logged at most once per
``log_every_s`` with the number of degraded requests since the last one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence

from purgatory import AsyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState

from indexer.index.base import LookupResult

log = logging.getLogger("kvgate.index")


class IndexUnavailable(Exception):
    """The lookup failed, timed out, or the breaker is open: route without the cache."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class LookupGuard:
    def __init__(self, index, *, timeout_s: float, breaker_failures: int = 3, breaker_open_s: float = 1.0,
                 on_degraded=None, log_every_s: float = 10.0) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self._factory = AsyncCircuitBreakerFactory(default_threshold=max(1, breaker_failures),
                                                   default_ttl=breaker_open_s)
        self.on_degraded = on_degraded  # called with the reason of each degraded request
        self.log_every_s = log_every_s
        self._last_log = 0.0
        self._since_log = 0
        self.degraded = 0
        self._breaker = None

    async def lookup(self, model: str, hashes: Sequence[int], workers: Collection[str] | None = None
                     ) -> LookupResult:
        if self._breaker is None:
            self._breaker = await self._factory.get_breaker("index")
        breaker = self._breaker
        try:
            # asyncio.timeout, not wait_for: the lookup runs in this task, so an index that answers without
            # suspending (the in-memory one) answers without a trip through the event loop, where the
            # request would queue behind every ready callback (event batches, other requests' streams)
            async with breaker, asyncio.timeout(self.timeout_s):
                return await self.index.lookup(model, hashes, workers)
        except OpenedState:
            raise self._degraded("breaker_open", "index circuit breaker open") from None
        except TimeoutError:
            raise self._degraded("timeout", f"index lookup took over {self.timeout_s * 1e3:.0f} ms") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise self._degraded("error", f"{type(e).__name__}: {e}") from None

    @property
    def open(self) -> bool:
        """True while the breaker fails lookups at once (the admin API and tests read it)."""
        return self._breaker is not None and self._breaker.context.state == "opened"

    def _degraded(self, reason: str, detail: str) -> IndexUnavailable:
        self.degraded += 1
        self._since_log += 1
        if self.on_degraded is not None:
            self.on_degraded(reason)
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            log.warning("index unavailable (%s): routing load-aware, cache-blind (%d request(s) since the "
                        "last report)", detail, self._since_log)
            self._last_log, self._since_log = now, 0
        return IndexUnavailable(reason, detail)
