"""Every ``kvgate_`` Prometheus metric, defined on a registry owned by one :class:`GatewayMetrics`
object (no module-level singletons, so several gateways can live in one test process).

Counts that other parts keep themselves (index sizes, event ingestion, worker health) are copied in by
:meth:`GatewayMetrics.refresh` just before a scrape, through a custom collector.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from indexer.events.state import entries_per_tier

_OVERHEAD_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GONE_KEPT = 4096  # removed worker names remembered (their late updates discarded)


class _Discard:
    """A removed worker's series child: updates go nowhere."""

    def inc(self, *a, **k) -> None:
        pass

    dec = set = observe = inc


_DISCARD = _Discard()


class _Snapshot:
    """Collector for values owned elsewhere; filled by :meth:`GatewayMetrics.refresh`."""

    def __init__(self) -> None:
        self.index_blocks: dict[tuple[str, str], float] = {}
        self.events: dict[str, dict] = {}
        self.health: dict[str, bool] = {}
        self.gated: dict[str, int] = {}  # routing target -> requests at its prefill gate
        self.rejected: dict[str, int] = {}  # worker -> /metrics samples dropped so far
        self.tokenize: dict[str, dict] = {}

    def collect(self):
        blocks = GaugeMetricFamily("kvgate_index_blocks", "Index entries per model and tier (G4: blocks)",
                                   labels=["model", "tier"])
        for (model, tier), v in self.index_blocks.items():
            blocks.add_metric([model, tier], v)
        yield blocks
        fams = {k: CounterMetricFamily(f"kvgate_events_{k}", f"KV events {k} per worker", labels=["worker"])
                for k in ("applied", "dropped", "replays", "resets", "gaps", "g4_backlog_dropped")}
        for worker, st in self.events.items():
            for k, fam in fams.items():
                fam.add_metric([worker], float(st.get(k, 0) or 0))
        yield from fams.values()
        health = GaugeMetricFamily("kvgate_worker_healthy", "1 when the worker passes health checks",
                                   labels=["worker"])
        for worker, ok in self.health.items():
            health.add_metric([worker], 1.0 if ok else 0.0)
        yield health
        rejected = CounterMetricFamily("kvgate_worker_metrics_rejected", "Samples dropped from the worker's "
                                       "/metrics page: not a finite, non-negative number within what vLLM "
                                       "can report", labels=["worker"])
        for worker, n in self.rejected.items():
            rejected.add_metric([worker], float(n))
        yield rejected
        gated = GaugeMetricFamily("kvgate_prefill_gate_held", "Requests waiting at the worker's prefill gate "
                                  "(routing.prefill_gate), not sent yet", labels=["worker"])
        for worker, n in self.gated.items():
            gated.add_metric([worker], float(n))
        yield gated
        yield from self._tokenize_families()

    def _tokenize_families(self):
        """The prefix token cache (router/prefix_cache.py), per model with a local tokenizer."""
        counters = {"hits": "Prompts that reused ids of a known prefix",
                    "misses": "Prompts with no known prefix",
                    "reused_bytes": "Prompt bytes whose ids came from the cache",
                    "encoded_bytes": "Prompt bytes tokenized",
                    "deferred_bytes": "Prompt bytes not tokenized: past every worker's cached prefix",
                    "saved_seconds": "Tokenizer time saved (reused bytes x measured encoding time per byte)",
                    "mismatches": "Cached encodings that differed from the whole text's (the cache turns off)",
                    "segment_reused_chars": "Short-prompt characters whose ids came from the segment memo",
                    "segment_encoded_chars": "Short-prompt characters tokenized"}
        fams = {k: CounterMetricFamily(f"kvgate_tokenize_cache_{k}", h, labels=["model"]) for k, h in counters.items()}
        held = GaugeMetricFamily("kvgate_tokenize_cache_bytes", "Bytes held by the prefix token cache",
                                 labels=["model"])
        ratio = GaugeMetricFamily("kvgate_tokenize_cache_hit_ratio", "hits / (hits + misses) since start",
                                  labels=["model"])
        seg = GaugeMetricFamily("kvgate_tokenize_cache_segment_bytes",
                                "Bytes held by the segment memo of short prompts", labels=["model"])
        for model, st in self.tokenize.items():
            for k, fam in fams.items():
                fam.add_metric([model], float(st.get(k, 0) or 0))
            held.add_metric([model], float(st.get("bytes", 0)))
            seg.add_metric([model], float(st.get("segment_bytes", 0)))
            n = st.get("hits", 0) + st.get("misses", 0)
            ratio.add_metric([model], st.get("hits", 0) / n if n else 0.0)
        yield from fams.values()
        yield held
        yield ratio
        yield seg


# observed / predicted: a factor of 10 either way, finer near 1
_LAG_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvgate_requests", "Requests by model, worker, policy and outcome",
                                ["model", "worker", "policy", "outcome"], registry=r)
        self.routing_overhead = Histogram(
            "kvgate_routing_overhead_seconds",
            "Gateway time per request stage: reading the body (read); routing (tokenize, hash, lookup, decide, "
            "total); its own time to the client's first byte, the worker's and the prefill gate's excluded "
            "(first_byte)", ["stage"], buckets=_OVERHEAD_BUCKETS, registry=r)
        self.predicted_cached = Counter("kvgate_predicted_cached_tokens", "Cached prompt tokens predicted",
                                        ["model"], registry=r)
        self.delivered_cached = Counter("kvgate_delivered_cached_tokens",
                                        "Cached prompt tokens reported by vLLM (usage.prompt_tokens_details)",
                                        ["model"], registry=r)
        self.prompt_tokens = Counter("kvgate_prompt_tokens", "Prompt tokens routed", ["model"], registry=r)
        self.hit_rate = Gauge("kvgate_cache_hit_rate",
                              "Delivered cached tokens / prompt tokens (moving average)", ["model"], registry=r)
        self.ttft = Histogram("kvgate_ttft_seconds", "Time to first byte of a streamed response, seen by the gateway",
                              ["model", "worker"], buckets=_TTFT_BUCKETS, registry=r)
        self.ttft_ratio = Histogram("kvgate_ttft_prediction_ratio",
                                    "Observed / predicted TTFT of streamed responses (1 = exact)", ["worker"],
                                    buckets=_RATIO_BUCKETS, registry=r)
        self.prediction_clamped = Counter("kvgate_ttft_prediction_clamped",
                                          "Routed requests whose predicted TTFT was clamped (bad or missing "
                                          "worker figures)", ["worker"], registry=r)
        self.scoring_fallbacks = Counter("kvgate_scoring_fallbacks",
                                         "Routing decisions in which a scorer found this worker's figures missing "
                                         "or malformed and counted a neutral term (explain: score_notes)",
                                         ["worker"], registry=r)
        self.loop_lag = Histogram("kvgate_event_loop_lag_seconds",
                                  "How late the event loop ran a timer, sampled every loop_lag_interval_s: the "
                                  "wait of every request it serves for its turn (a stall shows here first)",
                                  buckets=_LAG_BUCKETS, registry=r)
        self.gate_wait = Histogram("kvgate_prefill_gate_wait_seconds",
                                   "Time a request waited at its worker's prefill gate before it was sent "
                                   "(routing.prefill_gate; 0 for most)", ["worker"], buckets=_LAG_BUCKETS + (10.0,),
                                   registry=r)
        self.inflight = Gauge("kvgate_inflight_requests", "Requests in flight per worker", ["worker"], registry=r)
        self.retries = Counter("kvgate_retries", "Requests retried on another worker before the first byte",
                               ["model", "reason"], registry=r)
        self.prefetch = Counter("kvgate_prefetch_orders", "G4 prefetch orders by outcome: sent (accepted), "
                                "declined (the connector answered otherwise), failed (no answer: a refused "
                                "connection, a timeout), skipped (no prefetch endpoint for the worker)",
                                ["worker", "outcome"], registry=r)
        self.cache_blind = Gauge("kvgate_worker_cache_blind",
                                 "1 when the parity check found that kvgate's block keys do not match the "
                                 "worker's KV events (its cache entries are ignored)", ["worker"], registry=r)
        self.chat_cache_blind = Gauge("kvgate_worker_chat_cache_blind",
                                      "1 when kvgate's chat token ids differ from the worker's /tokenize (or "
                                      "the worker is cache-blind): chat routing ignores its cache entries",
                                      ["worker"], registry=r)
        self.parity_checks = Counter("kvgate_parity_checks", "Parity checks by worker and result",
                                     ["worker", "result"], registry=r)
        self.routing_degraded = Counter(
            "kvgate_routing_degraded", "Requests routed load-aware and cache-blind because the index lookup "
            "failed (error, timeout, or circuit breaker open)", ["reason"], registry=r)
        self.snapshot = _Snapshot()
        r.register(self.snapshot)

        self._children: dict[tuple, object] = {}
        # workers removed (their series dropped), last GONE_KEPT, until a target of that name is added again
        self._gone: dict[str, None] = {}

    def child(self, metric, *labels):
        """``metric.labels(*labels)``, cached: the request path calls this several times per request."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            if self._gone and self._of_gone(metric, labels):
                return _DISCARD
            c = self._children[key] = metric.labels(*labels)
        return c

    def _of_gone(self, metric, labels) -> bool:
        names = getattr(metric, "_labelnames", ())
        return "worker" in names and labels[names.index("worker")] in self._gone

    def forget_worker(self, worker: str) -> None:
        """Drop a removed worker's series, of every metric labelled by worker (and their cached children):
        with Kubernetes discovery (a name per pod) they grew with every rollout. A request still in flight
        there when it was removed updates none of them when it ends (that brought the series back, for good:
        found by a review)."""
        self._gone[worker] = None
        while len(self._gone) > GONE_KEPT:
            del self._gone[next(iter(self._gone))]
        self._children = {k: v for k, v in self._children.items() if worker not in k[1]}
        for metric in vars(self).values():
            names = getattr(metric, "_labelnames", ())
            if "worker" not in names:
                continue
            i = names.index("worker")
            for labels in [k for k in list(getattr(metric, "_metrics", {})) if k[i] == worker]:
                try:
                    metric.remove(*labels)
                except KeyError:
                    pass

    def revive_worker(self, worker: str) -> None:
        """A routing target named ``worker`` is in the fleet (again): its series count."""
        self._gone.pop(worker, None)

    def observe_stages(self, timings: dict[str, float]) -> None:
        for stage, ms in timings.items():
            self.child(self.routing_overhead, stage).observe(ms / 1000.0)

    async def refresh(self, state) -> None:
        """Copy the index, ingestion and health counts into the snapshot collector."""
        snap = self.snapshot
        snap.health = {w.name: w.healthy for w in state.registry.workers()}
        snap.rejected = {w.name: w.metrics_rejected for w in state.registry.workers()}
        snap.gated = {t.name: len(t.gate) for w in state.registry.workers() for t in w.targets()}
        snap.tokenize = state.tokenizers.cache_stats()
        if state.ingestor is not None:
            try:
                snap.events = dict(state.ingestor.statuses())
            except Exception:  # a status call must never break a scrape
                snap.events = {}
        try:
            stats = await state.index.stats()
        except Exception:
            stats = {}
        blocks: dict[tuple[str, str], float] = {}
        for model, st in stats.items():
            for tier, n in entries_per_tier(st).items():
                blocks[(model, tier)] = float(n)
            blocks[(model, "G4")] = float(st.get("g4_blocks", 0))
        snap.index_blocks = blocks

    def render(self) -> bytes:
        return generate_latest(self.registry)
