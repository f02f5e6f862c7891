"""Gateway side of prefetch: send a worker the G4 block hashes it is about to load, and read back the
connector's measured load bandwidth for the cost model.

``G4Prefetcher.order(worker, model, hashes)`` is what ``router/prefetch.py`` calls before forwarding a
request whose plan loads blocks from G4. It never raises and never waits long: an order that is late,
lost or refused only means the connector reads the blocks from the store itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

log = logging.getLogger("kvgate.g4.prefetch")

PREFETCH_PATH = "/kvgate/prefetch"
STATS_PATH = "/kvgate/g4/stats"


def prefetch_base(worker: Any) -> str | None:
    """The worker's connector endpoint: a URL string, or ``worker.prefetch_url`` (the registry resolves
    it: the worker's own, else the fleet's port on its host) / ``worker.config.prefetch_url`` (None: that
    worker has no prefetch endpoint)."""
    if worker is None:
        return None
    if isinstance(worker, str):
        return worker.rstrip("/")
    for obj in (worker, getattr(worker, "config", None)):
        url = getattr(obj, "prefetch_url", None) if obj is not None else None
        if url:
            return str(url).rstrip("/")
    return None


class G4Prefetcher:
    """Sends prefetch orders; counts what happened: ``sent`` (202), ``declined`` (the connector answered
    otherwise), ``failed`` (no answer: refused connection, timeout), ``skipped`` (no endpoint, no hashes)."""

    def __init__(
        self, *, timeout_s: float = 0.5, max_hashes: int = 4096, client: httpx.AsyncClient | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.max_hashes = max_hashes
        self._client = client
        self._own = client is None
        self.counters = {"sent": 0, "declined": 0, "failed": 0, "skipped": 0, "hashes": 0}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s))
        return self._client

    async def order(self, worker: Any, model: str, hashes: Sequence[int]) -> str:
        """Ask ``worker`` to stage ``hashes`` (the G4 blocks of the plan, in prompt order); the outcome."""
        base = prefetch_base(worker)
        if base is None or not hashes:
            self.counters["skipped"] += 1
            return "skipped"
        body = {
            "model": model,
            "hashes": [f"{h & 0xFFFFFFFFFFFFFFFF:016x}" for h in hashes[: self.max_hashes]],
        }
        try:
            r = await self._http().post(base + PREFETCH_PATH, json=body, timeout=self.timeout_s)
            outcome = "sent" if r.status_code == 202 else "declined"
        except Exception as e:  # noqa: BLE001 - an order is advisory: a bad URL or a refused socket too
            log.debug("prefetch order to %s failed: %s", base, e)
            outcome = "failed"
        self.counters[outcome] += 1
        if outcome == "sent":
            self.counters["hashes"] += len(body["hashes"])
        return outcome

    async def aclose(self) -> None:
        if self._own and self._client is not None:
            await self._client.aclose()
            self._client = None


class G4Bandwidth:
    """Per-worker G4 load bandwidth calibrated from the connector's own counters.

    Each ``poll`` reads ``load_bytes``/``load_seconds`` from the worker's stats endpoint; the bandwidth is an
    EWMA over the deltas between polls (so it follows the filesystem's current speed), seeded from the
    cumulative figure. Until a worker has loaded ``min_bytes``, ``bytes_per_s`` answers the default.
    """

    def __init__(
        self,
        default_bytes_per_s: float = 2e9,
        *,
        alpha: float = 0.3,
        min_bytes: int = 1 << 20,
        timeout_s: float = 2.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.default = default_bytes_per_s
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.timeout_s = timeout_s
        self._client = client
        self._last: dict[str, tuple[int, float]] = {}
        self._bw: dict[str, float] = {}
        self.block_bytes: dict[str, int] = {}
        self.updated: dict[str, float] = {}

    def observe(
        self, worker: str, load_bytes: int, load_seconds: float, block_bytes: int | None = None
    ) -> None:
        """Feed one counter snapshot (cumulative since the worker started)."""
        if block_bytes:
            self.block_bytes[worker] = int(block_bytes)
        prev = self._last.get(worker)
        self._last[worker] = (load_bytes, load_seconds)
        if prev is None or load_bytes < prev[0]:  # first snapshot, or the worker restarted
            if load_bytes >= self.min_bytes and load_seconds > 0:
                self._bw.setdefault(worker, load_bytes / load_seconds)
            return
        db, dt = load_bytes - prev[0], load_seconds - prev[1]
        if db < self.min_bytes or dt <= 0:
            return
        sample = db / dt
        old = self._bw.get(worker)
        self._bw[worker] = sample if old is None else (1 - self.alpha) * old + self.alpha * sample
        self.updated[worker] = time.time()

    def bytes_per_s(self, worker: str) -> float:
        return self._bw.get(worker, self.default)

    def seconds_for_blocks(self, worker: str, n_blocks: int, default_block_bytes: int = 0) -> float:
        """Predicted time to load ``n_blocks`` from G4 on ``worker``."""
        bb = self.block_bytes.get(worker, default_block_bytes)
        return n_blocks * bb / self.bytes_per_s(worker) if bb else 0.0

    async def poll(self, worker: str, base_url: Any) -> dict | None:
        base = prefetch_base(base_url)
        if base is None:
            return None
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s))
        try:
            r = await self._client.get(base + STATS_PATH, timeout=self.timeout_s)
            r.raise_for_status()
            st = r.json()
        except (httpx.HTTPError, ValueError):
            return None
        self.observe(
            worker, int(st.get("load_bytes", 0)), float(st.get("load_seconds", 0.0)), st.get("block_bytes")
        )
        return st

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
