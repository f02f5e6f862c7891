"""The prefetch seam: when the chosen plan reads blocks from G4, the gateway orders the chosen worker to
stage them while the request is still on its way. The g4 part supplies the real implementation."""
from __future__ import annotations

from typing import Protocol

from router.worker import rank_url


class Prefetcher(Protocol):
    async def order(self, worker, model: str, hashes: list[int]) -> str:
        """Ask ``worker`` (a registry Worker) to stage ``hashes`` from G4. The outcome, as
        ``kvgate_prefetch_orders_total`` counts it: ``sent`` (accepted), ``declined`` (the connector answered
        otherwise), ``failed`` (no answer), ``skipped`` (no endpoint for this worker)."""


class NoopPrefetcher:
    """Default: no G4 tier, nothing to stage."""

    async def order(self, worker, model: str, hashes: list[int]) -> str:
        return "skipped"


class G4Prefetcher:
    """Prefetch orders to kvgate's connector endpoint on each worker -- its own ``prefetch_url``
    (WorkerConfig, a pod annotation), else ``g4.prefetch_port`` on its host (a data-parallel rank r: that
    port + r, router/worker.py ``RankTarget.prefetch_url``); a worker with neither gets
    no order (vLLM's own offloading connector has no prefetch endpoint) -- see docs/g4.md. After an
    order it refreshes, at most every ``g4.stats_interval_s``, the worker's G4 load bandwidth and block
    size from the connector's counters (``worker.g4_bytes_per_s``, ``worker.g4_bytes_per_block``), which
    the cost model uses to price G4 loads."""

    def __init__(self, settings) -> None:
        from cache_tier.prefetch_client import G4Bandwidth
        from cache_tier.prefetch_client import G4Prefetcher as _Client

        g4, routing = settings.g4, settings.routing
        self.port = g4.prefetch_port
        self.scheme = g4.prefetch_scheme
        self.interval_s = g4.stats_interval_s
        self.client = _Client(timeout_s=routing.prefetch_timeout_s)
        self.bandwidth = G4Bandwidth(routing.g4_bytes_per_s, timeout_s=max(1.0, routing.prefetch_timeout_s))
        self._polled: dict[str, float] = {}

    def base_url(self, worker) -> str | None:
        from cache_tier.prefetch_client import prefetch_base

        base = prefetch_base(worker)
        if base is None and self.port:  # a data-parallel rank's connector serves on the port + its rank
            base = rank_url(f"{self.scheme}://{worker.host}:{self.port}",
                            getattr(worker, "dp_rank", None) or 0)
        return base

    async def order(self, worker, model: str, hashes: list[int]) -> str:
        import time

        base = self.base_url(worker)
        if base is None:
            return "skipped"
        outcome = await self.client.order(base, model, hashes)
        now = time.monotonic()
        if now - self._polled.get(worker.name, 0.0) >= self.interval_s:
            self._polled[worker.name] = now
            if await self.bandwidth.poll(worker.name, base) is not None:
                worker.g4_bytes_per_s = self.bandwidth.bytes_per_s(worker.name)
                worker.g4_bytes_per_block = self.bandwidth.block_bytes.get(worker.name, 0)
        return outcome

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.bandwidth.aclose()


def make_prefetcher(settings) -> Prefetcher:
    """The G4 prefetcher: any worker may name its endpoint (configuration, discovery, the admin API);
    one without an endpoint costs nothing (no order, no connection)."""
    return G4Prefetcher(settings)
