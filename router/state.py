"""Everything one gateway owns, on ``app.state.kv``: settings, index, event ingestor, worker registry,
tokenizers, policy, router, decision log, metrics, HTTP client and prefetcher. No module singletons:
two gateways can run in one process (tests do)."""
from __future__ import annotations

import asyncio
import logging

import httpx

from router.config import Settings
from router.metrics import GatewayMetrics
from router.policies import Policy, create_policy
from router.prefetch import NoopPrefetcher, Prefetcher
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


def make_ingestor(index, on_reset):
    """The KV event ingestor, or None when the events part is not installed."""
    try:
        from indexer.events import EventIngestor
    except ImportError:
        log.warning("indexer.events is not available: KV events are not ingested")
        return None
    return EventIngestor(index, queue_size=10000, on_reset=on_reset)


class GatewayState:
    def __init__(self, settings: Settings, *, index=None, prefetcher: Prefetcher | None = None,
                 ingestor=None, with_events: bool = True) -> None:
        self.settings = settings
        self.index = index if index is not None else make_index(settings)
        self.metrics = GatewayMetrics()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s),
            limits=httpx.Limits(max_connections=settings.max_connections,
                                max_keepalive_connections=settings.max_keepalive_connections),
            follow_redirects=False, trust_env=False)
        self.upstream = Upstream(settings)
        self.ingestor = ingestor if ingestor is not None or not with_events else make_ingestor(
            self.index, self._on_events_reset)
        self.registry = WorkerRegistry(settings, self.client, self.index, self.ingestor, self.metrics)
        self.tokenizers = Tokenizers(settings, self.client)
        self.policy: Policy = create_policy(settings.routing)
        self.decisions = DecisionLog(settings.routing.decisions_kept)
        self.router = Router(self)
        self.prefetcher: Prefetcher = prefetcher or NoopPrefetcher()
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

    def _on_events_reset(self, worker: str, *_args) -> None:
        try:
            self.spawn(self.registry.on_events_reset(worker))
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
        await self.upstream.close()
        self.tokenizers.close()
        try:
            await self.index.close()
        except Exception:
            pass
        self.started = False
