"""Everything one gateway owns, on ``app.state.kv``: settings, index, event ingestor, worker registry,
tokenizers, policy, router, decision log, metrics, HTTP client and prefetcher. No module singletons:
two gateways can run in one process (tests do)."""
from __future__ import annotations

import asyncio
import logging

import httpx

from indexer.events import EventIngestor
from indexer.index import create_index
from indexer.index.base import Tier
from indexer.index.owners import create_owners
from router.apis.probes import make_probes
from router.config import Settings
from router.index_guard import LookupGuard
from router.metrics import GatewayMetrics
from router.parity import ParityChecker
from router.pending import PendingBlocks
from router.policies import Policy, create_policy
from router.prefetch import Prefetcher, make_prefetcher
from router.proxy import DataPath
from router.registry import WorkerRegistry
from router.routing import DecisionLog, Router
from router.tokenize import Tokenizers
from router.upstream import Upstream

log = logging.getLogger("kvgate.state")


class GatewayState:
    def __init__(self, settings: Settings, *, index=None, prefetcher: Prefetcher | None = None,
                 ingestor=None, with_events: bool = True) -> None:
        self.settings = settings
        self.index = index if index is not None else create_index(settings.index)
        # Responses API: which worker created each response id (indexer/index/owners.py), on the index's
        # backend so every gateway replica shares it.
        self.owners = create_owners(settings.index, settings.responses.owner_ttl_s,
                                    settings.responses.owner_max_entries, settings.responses.delta_max_bytes)
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
                                    metrics=self.metrics, tokenize_chat=self._tokenize_chat_probe,
                                    decode=self._decode, api_probes=make_probes(self))
        ic = settings.index
        self.ingestor = ingestor if ingestor is not None or not with_events else EventIngestor(
            self.index, queue_size=10000, on_reset=self._on_events_reset, observer=self._observe_events,
            lease_ttl_s=ic.lease_ttl_s, max_handles=ic.max_handles_per_worker, sweep_idle_s=ic.sweep_idle_s)
        if self.ingestor is not None and getattr(self.ingestor, "observer", False) is None:
            self.ingestor.observer = self._observe_events  # an ingestor passed in by the caller
        self.registry = WorkerRegistry(settings, self.index, self.ingestor, self.metrics)
        self.registry.on_removed = self.parity.forget
        if settings.routing.parity_check and self.ingestor is not None:
            self.registry.on_ready = self._check_parity
            self.parity.recheck = self._recheck_parity
        self.policy: Policy = create_policy(settings.routing)
        self.decisions = DecisionLog(settings.routing.decisions_kept)
        self.pending = PendingBlocks(settings.routing.pending_ttl_s, settings.routing.pending_max_blocks,
                                     settings.routing.pending_settle_s, settings.routing.pending_text_bytes)
        self.registry.on_cleared = self.pending.forget_worker
        self.router = Router(registry=self.registry, tokenizers=self.tokenizers, index_guard=self.index_guard,
                             pending=self.pending, routing=settings.routing, policy=lambda: self.policy)
        self.registry.on_prefill = self.router.cost.observe_engine_prefill
        self.registry.on_engine = self.router.cost.observe_engine
        self.prefetcher: Prefetcher = prefetcher or make_prefetcher(settings)
        self._background: set[asyncio.Task] = set()
        self.datapath = DataPath(registry=self.registry, upstream=self.upstream, router=self.router,
                                 pending=self.pending, metrics=self.metrics, decisions=self.decisions,
                                 prefetcher=self.prefetcher, spawn=self.spawn, routing=settings.routing,
                                 max_body_bytes=settings.max_body_bytes,
                                 body_timeout_s=settings.body_timeout_s)
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
            target = worker.probe_target()
            result = await self.parity.check(target.name, worker.url, model, headers=target.pin({}))
            worker.parity = result.to_dict()

        self.spawn(run())

    def _recheck_parity(self, name: str) -> None:
        w = self.registry.get(name)  # the server, also when ``name`` is one of its ranks
        if w is not None and w.routable:
            self._check_parity(w)

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

    async def _tokenize_chat_probe(self, model: str, body: dict) -> tuple[list[int] | None, str]:
        """kvgate's own token ids of a chat request (its local template), never a worker's /tokenize."""
        ns, _ = self.registry.namespace(model)
        if self.tokenizers.for_model(model, ns) is None:
            return None, "kvgate has no chat template of its own for this model (it uses the workers' /tokenize)"
        res = await self.tokenizers.tokenize(model, "chat", body, size=0, namespace=ns, worker_url=None)
        return (list(res.tokens) if res.tokens is not None else None,
                res.error or "kvgate cannot tokenize the probe conversation")

    def _decode(self, model: str, ids: list[int]) -> str | None:
        tok = self.tokenizers.for_model(model, self.registry.namespace(model)[0])
        return tok.hf.decode(ids) if tok is not None else None

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

    def _observe_events(self, worker: str, tier: str, hashes: list[int]) -> None:
        """Stored blocks, as the ingestor applies them: the parity check's watches, and the worker's load
        tracker (a request whose first new blocks vLLM stored is running: router/load.py ``stored``)."""
        self.parity.observe(worker, tier, hashes)
        if tier == Tier.GPU.value and self.settings.routing.admit_on_events:
            target = self.registry.target(worker)
            if target is not None:
                target.active.stored(hashes)

    def _on_events_reset(self, worker: str, reason: str = "restart") -> None:
        try:
            self.spawn(self.registry.on_events_reset(worker, reason))
        except RuntimeError:  # no running loop (called from a foreign thread)
            pass

    async def start(self) -> None:
        """Load tokenizers (off the loop), start event ingestion and the registry's health loop."""
        await self.tokenizers.load_async()
        if self.ingestor is not None:
            await self.ingestor.start()
        await self.registry.start()
        if self.settings.loop_lag_interval_s > 0:
            self.spawn(self._watch_loop(self.settings.loop_lag_interval_s))
        self.started = True

    async def _watch_loop(self, interval: float) -> None:
        """Sample how late the loop wakes a timer: tokenizing, hashing and event application are kept off
        it or bounded, and this says whether that holds under the real load (bench/bench_loop_stall.py
        measures the same from a client)."""
        loop = asyncio.get_running_loop()
        lag = self.metrics.loop_lag
        while True:
            t = loop.time()
            await asyncio.sleep(interval)
            lag.observe(max(0.0, loop.time() - t - interval))

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
        for store in (self.index, self.owners):
            try:
                await store.close()
            except Exception:
                pass
        self.started = False
