"""The request path's view of the index: a short deadline and a circuit breaker around ``lookup``.

Why: the index answers in well under a millisecond when it is up; when Redis is down or slow, a request
must not wait seconds for it. Each lookup gets ``index.lookup_timeout_s`` (tens of ms); after
``index.breaker_failures`` failures in a row the breaker opens and lookups fail at once for
``index.breaker_open_s``, then one goes through to try again (half-open). A failed or skipped lookup
routes *degraded*: load-aware and cache-blind (every worker matches nothing). Each such request counts in
``kvgate_routing_degraded_total{reason}``; the warning is logged at most once per ``log_every_s`` with the
number of degraded requests since the last one.

"In a row" counts failure *episodes*, not lookups: a lookup that fails after being sent before the last
counted failure was in flight through the same trouble and is not counted again. One stall (a Redis
latency spike, or the gateway's own event loop busy past the deadline: a timeout measures both) times out
every lookup in flight at once; counted one by one, three concurrent requests opened the breaker and
routed the next second's requests cache-blind (16 simulated workers on two cores: 27 requests, 1.9
points of hit rate; docs/BENCHMARKS.md session 25). A dead or persistently slow Redis still opens it after
``breaker_failures`` lookups sent one after another. (A hand-written breaker: the libraries' count every
failure, and excluding one counts it as a success, which resets the count.)
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence

from indexer.index.base import LookupResult

log = logging.getLogger("kvgate.index")


class IndexUnavailable(Exception):
    """The lookup failed, timed out, or the breaker is open: route without the cache."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class Breaker:
    """Consecutive failure episodes open it for ``open_s``; then one trial call closes it or reopens it.
    :meth:`allow` hands each call a ticket (its start time, and whether it is the trial) that its outcome
    is reported with."""

    def __init__(self, failures: int, open_s: float, clock=time.monotonic) -> None:
        self.failures, self.open_s, self._clock = max(1, failures), open_s, clock
        self.count = 0  # failure episodes in a row
        self._last_failure = -math.inf  # when the last counted failure was recorded
        self._opened_at: float | None = None
        self._trial = False  # a half-open trial is in flight

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "open" if self._trial or self._clock() - self._opened_at < self.open_s else "half_open"

    def allow(self) -> tuple[float, bool] | None:
        """The call's ticket, or None when the breaker fails it at once."""
        state = self.state
        if state == "open":
            return None
        trial = state == "half_open"
        self._trial = self._trial or trial
        return self._clock(), trial

    def success(self) -> None:
        """An answer in time, whichever call gave it: the index works."""
        self.count, self._opened_at, self._trial = 0, None, False

    def abandon(self, ticket: tuple[float, bool]) -> None:
        """The call ended without an answer either way (cancelled): a trial may be made again."""
        if ticket[1]:
            self._trial = False

    def failure(self, ticket: tuple[float, bool]) -> None:
        """The call failed. A failed trial reopens the breaker; any other failure counts unless the call was
        in flight when the last one counted (the same episode)."""
        started, trial = ticket
        now = self._clock()
        if trial:
            self._trial, self._opened_at, self._last_failure = False, now, now
            return
        if started < self._last_failure:
            return
        self._last_failure = now
        self.count += 1
        if self.count >= self.failures:
            self._opened_at = now


class LookupGuard:
    def __init__(self, index, *, timeout_s: float, breaker_failures: int = 3, breaker_open_s: float = 1.0,
                 on_degraded=None, log_every_s: float = 10.0) -> None:
        self.index = index
        self.timeout_s = timeout_s
        self.breaker = Breaker(breaker_failures, breaker_open_s)
        self.on_degraded = on_degraded  # called with the reason of each degraded request
        self.log_every_s = log_every_s
        self._last_log = 0.0
        self._since_log = 0
        self.degraded = 0

    async def lookup(self, model: str, hashes: Sequence[int], workers: Collection[str] | None = None
                     ) -> LookupResult:
        breaker = self.breaker
        ticket = breaker.allow()
        if ticket is None:
            raise self._degraded("breaker_open", "index circuit breaker open")
        try:
            # asyncio.timeout, not wait_for: the lookup runs in this task, so an index that answers without
            # suspending (the in-memory one) answers without a trip through the event loop, where the
            # request would queue behind every ready callback (event batches, other requests' streams)
            async with asyncio.timeout(self.timeout_s):
                result = await self.index.lookup(model, hashes, workers)
        except TimeoutError:
            breaker.failure(ticket)
            raise self._degraded("timeout", f"index lookup took over {self.timeout_s * 1e3:.0f} ms") from None
        except asyncio.CancelledError:  # the request went away: says nothing about the index
            breaker.abandon(ticket)
            raise
        except Exception as e:
            breaker.failure(ticket)
            raise self._degraded("error", f"{type(e).__name__}: {e}") from None
        breaker.success()
        return result

    @property
    def open(self) -> bool:
        """True while the breaker fails lookups at once (the admin API and tests read it)."""
        return self.breaker.state == "open"

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
