"""Everything one gateway owns, on ``app.state.kv``: settings, index, event ingestor, worker registry,
tokenizers, policy, router, decision log, metrics, HTTP client and prefetcher. No module singletons:
two gateways can run in one process (tests do)."""
from __future__ import annotations

import asyncio
import logging

import httpx

from router.config import Settings
from router.index_guard import LookupGuard
from router.metrics import GatewayMetrics
from router.parity import ParityChecker
from router.pending import PendingBlocks
from router.policies import Policy, create_policy
from router.prefetch import Prefetcher, make_prefetcher
from router.registry import WorkerRegistry
from router.routing import DecisionLog, Router
from router.tokenize import Tokenizers
from router.upstream import Upstream

log = logging.getLogger("kvgate.state")


def make_index(settings: Settings):
    """The configured index backend (the index part's factory when present)."""
    try:
        from indexer.index import create_index  # type: ignore[attr-defined]
    except ImportError:
        create_index = None
    if create_index is not None:
        return create_index(settings.index)
    if settings.index.backend == "redis":
        from indexer.index.redis import RedisIndex

        return RedisIndex(settings.index.redis_url, key_prefix=settings.index.key_prefix,
                          timeout_s=settings.index.timeout_s)
    from indexer.index.memory import MemoryIndex

    return MemoryIndex()


def make_ingestor(index, on_reset, observer=None, index_settings=None):
    """The KV event ingestor, or None when the events part is not installed."""
    try:
        from indexer.events import EventIngestor
    except ImportError:
        log.warning("indexer.events is not available: KV events are not ingested")
        return None
    kw = {}
    if index_settings is not None:
        kw = dict(lease_ttl_s=index_settings.lease_ttl_s, max_handles=index_settings.max_handles_per_worker,
                  sweep_idle_s=index_settings.sweep_idle_s)
    return EventIngestor(index, queue_size=10000, on_reset=on_reset, observer=observer, **kw)


class GatewayState:
    def __init__(self, settings: Settings, *, index=None, prefetcher: Prefetcher | None = None,
                 ingestor=None, with_events: bool = True) -> None:
        self.settings = settings
        self.index = index if index is not None else make_index(settings)
        self.metrics = GatewayMetrics()
        ic = settings.index
        self.index_guard = LookupGuard(
            self.index, timeout_s=ic.lookup_timeout_s, breaker_failures=ic.breaker_failures,
            breaker_open_s=ic.breaker_open_s,
            on_degraded=lambda reason: self.metrics.child(self.metrics.routing_degraded, reason).inc())
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=settings.max_connections,
                                max_keepalive_connections=settings.max_keepalive_connections),
            follow_redirects=False, trust_env=False)
        self.upstream = Upstream(settings)
        self.tokenizers = Tokenizers(settings, self.client)
        # Parity check at registration (router/parity.py): fed by the ingestor's observer, run by the
        # registry's on_ready hook each time a worker becomes routable.
        self.parity = ParityChecker(self.client, self._tokenize_probe, self._block_size,
                                    events_seen=self._events_seen, has_events=self._has_events,
                                    indexed=self._indexed_blocks,
                                    metrics=self.metrics)
        self.ingestor = ingestor if ingestor is not None or not with_events else make_ingestor(
            self.index, self._on_events_reset, self.parity.observe, settings.index)
        if self.ingestor is not None and getattr(self.ingestor, "observer", False) is None:
            self.ingestor.observer = self.parity.observe  # an ingestor passed in by the caller
        self.registry = WorkerRegistry(settings, self.client, self.index, self.ingestor, self.metrics)
        if settings.routing.parity_check and self.ingestor is not None:
            self.registry.on_ready = self._check_parity
        self.policy: Policy = create_policy(settings.routing)
        self.decisions = DecisionLog(settings.routing.decisions_kept)
        self.pending = PendingBlocks(settings.routing.pending_ttl_s, settings.routing.pending_max_blocks)
        self.registry.on_cleared = self.pending.forget_worker
        self.router = Router(self)
        self.registry.on_prefill = self.router.cost.observe_engine_prefill
        self.prefetcher: Prefetcher = prefetcher or make_prefetcher(settings)
        self._background: set[asyncio.Task] = set()
        self.started = False

    def set_policy(self, name: str) -> Policy:
        self.policy = create_policy(self.settings.routing, name)
        return self.policy

    def spawn(self, coro) -> asyncio.Task:
        """Fire and forget, keeping a reference so the task is not collected mid-flight."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- parity check at registration (router/parity.py) --------------------------------------------
    def _check_parity(self, worker) -> None:
        async def run() -> None:
            model = worker.base_model()
            if model is None:
                return
            result = await self.parity.check(worker.name, worker.url, model)
            worker.parity = result.to_dict()

        self.spawn(run())

    async def _indexed_blocks(self, worker: str, model: str, hashes: list[int]) -> int:
        """Leading probe blocks the index already holds for ``worker`` (parity when no new events came)."""
        ns, _ = self.registry.namespace(model)
        try:
            res = await self.index.lookup(ns, hashes, workers=[worker])
        except Exception:  # an unreachable index proves nothing either way
            return 0
        return res.match(worker).local

    async def _tokenize_probe(self, model: str, text: str) -> list[int] | None:
        ns, _ = self.registry.namespace(model)
        w = next((w for w in self.registry.workers() if model in w.models), None)
        res = await self.tokenizers.tokenize(model, "completion", {"prompt": text}, size=len(text),
                                             namespace=ns, worker_url=w.url if w else None)
        return res.tokens

    def _block_size(self, model: str) -> int:
        return self.registry.block_size(model)

    def _events_seen(self, worker: str) -> bool:
        try:
            return self.ingestor is not None and self.ingestor.status(worker).get("last_seq") is not None
        except KeyError:
            return False

    def _has_events(self, worker: str) -> bool:
        try:
            return self.ingestor is not None and self.ingestor.status(worker) is not None
        except KeyError:
            return False

    def _on_events_reset(self, worker: str, reason: str = "restart") -> None:
        try:
            self.spawn(self.registry.on_events_reset(worker, reason))
        except RuntimeError:  # no running loop (called from a foreign thread)
            pass

    async def start(self) -> None:
        """Load tokenizers (off the loop), start event ingestion and the registry's health loop."""
        await asyncio.to_thread(self.tokenizers.load)
        if self.ingestor is not None:
            await self.ingestor.start()
        await self.registry.start()
        self.started = True

    async def stop(self) -> None:
        await self.registry.stop()
        if self.ingestor is not None:
            try:
                await self.ingestor.stop()
            except Exception as e:
                log.warning("stopping the event ingestor: %s", e)
        for t in list(self._background):
            t.cancel()
        await self.client.aclose()
        closer = getattr(self.prefetcher, "aclose", None)
        if closer is not None:
            await closer()
        await self.upstream.close()
        self.tokenizers.close()
        try:
            await self.index.close()
        except Exception:
            pass
        self.started = False
