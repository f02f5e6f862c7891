"""A vLLM server as the gateway sees it: its configuration, the load it last reported (``WorkerLoad``, read
from ``/metrics`` by router/vllm_metrics.py), the gateway's own load tracker and calibrations, and its
data-parallel ranks as routing targets of their own (``RankTarget``). The registry (router/registry.py)
keeps these up to date; the cost model and the policies read them."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from indexer.events.state import local_g4_member, shared_g4_member
from router.admission import PrefillGate
from router.calibrate import EngineCalibration, PredictionErrors, default_calibration
from router.config import Settings, WorkerConfig
from router.eviction import EvictionCalibration
from router.load import ActiveSequences, LoadView
from router.ttft_fit import TtftFit


@dataclass(frozen=True)
class EngineSample:
    """One scrape interval's engine figures: mean inter-token latency, mean running requests, mean
    per-request time outside the engine, and prompt tokens computed per engine step (None: unknown)."""

    itl_s: float | None
    running: float
    overhead_s: float | None
    prefill_tokens_per_step: float | None = None


@dataclass
class WorkerLoad:
    """vLLM's own load gauges from the last /metrics scrape: a server's summed over its engines (DP ranks),
    a rank target's from its own ``engine="r"`` series."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    updated_at: float = 0.0
    usage_known: bool = True  # False: the page had no valid kv_cache_usage_perc (kv_usage is no evidence)
    # Cumulative, from vLLM's per-request histograms (recorded together when a request finishes):
    # tokens computed in prefill, seconds from scheduled to first token, and the requests counted.
    prefill_tokens: float = 0.0
    prefill_seconds: float = 0.0
    prefill_requests: float = 0.0
    prompt_tokens: float = 0.0  # vllm:request_prompt_tokens (sum): with prefill_tokens, the cached context
    process_start: float | None = None  # process_start_time_seconds: changes when the server restarts
    # Cumulative (sum, count) of the latency histograms the scheduler model calibrates from (router/calibrate.py)
    itl: tuple[float, float] = (0.0, 0.0)  # vllm:inter_token_latency_seconds: one step per token
    ttft: tuple[float, float] = (0.0, 0.0)  # vllm:time_to_first_token_seconds
    queue: tuple[float, float] = (0.0, 0.0)  # vllm:request_queue_time_seconds
    e2e: tuple[float, float] = (0.0, 0.0)  # vllm:e2e_request_latency_seconds (at finish)
    inference: tuple[float, float] = (0.0, 0.0)  # vllm:request_inference_time_seconds (at finish)
    # Per engine step, counted as it happens (not at a request's finish): the steps that output tokens
    # (vllm:iteration_tokens_total's count) and the prompt tokens they computed
    # (vllm:prompt_tokens_by_source_total{source="local_compute"}); None: not exported.
    steps: float = 0.0
    computed_tokens: float | None = None
    num_gpu_blocks: int | None = None  # vllm:cache_config_info
    rejected: int = 0  # samples dropped from the page: not a finite, non-negative number

    def engine_since(self, before: WorkerLoad) -> EngineSample:
        """The engine's figures between two scrapes (router/calibrate.py says how each is used); a mean is
        None when its histograms saw nothing new (or went back)."""
        def mean(now: tuple[float, float], then: tuple[float, float]) -> float | None:
            dn = now[1] - then[1]
            return (now[0] - then[0]) / dn if dn > 0 and now[0] >= then[0] else None

        itl = mean(self.itl, before.itl)
        e2e, queue, inference = mean(self.e2e, before.e2e), mean(self.queue, before.queue), \
            mean(self.inference, before.inference)
        if None not in (e2e, queue, inference):
            # the same finished requests' time outside the engine (API server, tokenization, output)
            overhead = e2e - queue - inference
        else:  # older vLLM: first tokens of this interval against the queue and prefill of those finished
            ttft = mean(self.ttft, before.ttft)
            prefill = mean((self.prefill_seconds, self.prefill_requests),
                           (before.prefill_seconds, before.prefill_requests))
            overhead = ttft - queue - prefill if None not in (ttft, queue, prefill) else None
        steps = self.steps - before.steps
        per_step = None
        if steps > 0 and self.computed_tokens is not None and before.computed_tokens is not None \
                and self.computed_tokens >= before.computed_tokens:
            per_step = (self.computed_tokens - before.computed_tokens) / steps
            if not math.isfinite(per_step):
                per_step = None
        return EngineSample(itl, (self.running + before.running) / 2.0, overhead, per_step)

    def prefill_since(self, before: WorkerLoad) -> tuple[float, float, float, float] | None:
        """(computed tokens, seconds, requests, prompt tokens) of the requests finished between two
        scrapes; None when nothing finished or the counters went back (a restarted server)."""
        d = (self.prefill_tokens - before.prefill_tokens, self.prefill_seconds - before.prefill_seconds,
             self.prefill_requests - before.prefill_requests, self.prompt_tokens - before.prompt_tokens)
        return d if d[2] > 0 and d[0] >= 0 and d[1] > 0 and d[3] >= 0 else None


@dataclass
class Worker:
    """One vLLM server as the gateway sees it. Gateway-side counters are updated by the proxy."""

    name: str
    url: str
    config: WorkerConfig
    healthy: bool = False
    draining: bool = False
    ever_healthy: bool = False
    models: dict[str, dict] = field(default_factory=dict)  # id -> {"parent", "root", "max_model_len"}
    block_size: int | None = None
    event_sources: list[dict] = field(default_factory=list)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # The requests this gateway has in flight on the worker, by phase (router/load.py), and the scheduler
    # model's parameters learnt from its metrics (router/calibrate.py).
    active: ActiveSequences = field(default_factory=ActiveSequences)
    gate: PrefillGate = field(default_factory=PrefillGate)  # requests held before it (router/admission.py)
    engine: EngineCalibration = field(default_factory=default_calibration)
    prediction: PredictionErrors = field(default_factory=PredictionErrors)  # observed / predicted TTFT
    ttft_fit: TtftFit = field(default_factory=TtftFit)  # the model's learnt correction (router/ttft_fit.py)
    eviction: EvictionCalibration = field(default_factory=EvictionCalibration)  # router/eviction.py
    prefill_ratio: float = 1.0  # this worker's speed relative to the fleet-wide estimate (router/cost.py)
    g4_bytes_per_s: float = 0.0  # G4 load bandwidth measured by the worker's connector (0: use the default)
    g4_bytes_per_block: int = 0  # bytes of one block file on G4 (0: use the default)
    # kvgate's connector endpoint (prefetch orders, G4 counters): the worker's own prefetch_url, else
    # g4.prefetch_port on its host; None: no endpoint, no orders.
    prefetch_url: str | None = None
    # The shared G4 tier it mounts ("" none) and that tier's index entry (None: the model-wide G4 set).
    g4_tier: str = "shared"
    g4_member: str | None = None
    ttft_samples: int = 0
    prefill_samples: int = 0  # observations that calibrated it: streamed TTFTs, vLLM prefill histograms
    failures: int = 0
    restarts: int = 0
    lost_at: float | None = None  # monotonic time it left discovery (removed after lost_grace_s)
    down: bool = False  # refused connections check after check: entries dropped (router/registry.py _down)
    refused: int = 0  # health checks in a row that found nothing listening
    last_error: str | None = None
    # /metrics samples dropped so far (router/vllm_metrics.py: not a finite, non-negative number within
    # what vLLM can report): a broken exporter, counted on the server
    metrics_rejected: int = 0
    last_check: float = 0.0
    added_at: float = field(default_factory=time.time)
    # Last parity check (router/parity.py), at registration or on demand (POST /admin/workers/{name}/parity).
    parity: dict | None = None
    # A data-parallel server (more than one rank in /kv_event_sources): one routing target per rank.
    ranks: list[RankTarget] = field(default_factory=list)
    skipped_sources: list[dict] = field(default_factory=list)  # ranks of /kv_event_sources left out, and why
    dp_rank = None  # the server itself pins no rank (a RankTarget does)

    def targets(self) -> list:
        """What routing picks from: the ranks of a data-parallel server, else the server itself."""
        return list(self.ranks) or [self]

    def pin(self, headers: dict[str, str]) -> dict[str, str]:
        """The headers a request routed to this target goes with (a server pins nothing)."""
        return headers

    def probe_target(self):
        """Where the parity probe goes: the server, or (data-parallel) its first rank with an event stream,
        pinned there so that stream is the one watched; every rank shares the verdict (same model, keys)."""
        return next((t for t in self.targets() if t.event_sources), self.targets()[0])

    @property
    def inflight(self) -> int:
        return len(self.active)

    def view(self) -> LoadView:
        """The gateway's load on the worker now, reconciled with vLLM's gauges (router/load.py)."""
        return self.active.view(self.load.running, self.load.waiting)

    @property
    def pending_tokens(self) -> int:
        """Prefill work sent and not yet prefilled (no first token), in tokens at context 0."""
        return round(self.view().prefill_work)

    @property
    def cache_blind(self) -> bool:
        """kvgate's block keys do not match this worker's: routing ignores its index entries."""
        return bool(self.parity and self.parity.get("status") == "cache-blind")

    @property
    def chat_cache_blind(self) -> bool:
        """Cache-blind, or kvgate's chat token ids differ from the worker's (the chat parity probe)."""
        chat = (self.parity or {}).get("chat") or {}
        return self.cache_blind or chat.get("status") == "cache-blind"

    def blind_for(self, kind: str) -> bool:
        """Whether kvgate's block keys of a ``kind`` request ("chat", "completion", ...) miss this worker."""
        return self.chat_cache_blind if kind == "chat" else self.cache_blind

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def g4_reads(self) -> list[str | None]:
        """The G4 index entries this target can load from: the shared tier it mounts (None: the
        model-wide set) unless it mounts none, and its own LOCAL storage."""
        own = local_g4_member(self.name)
        return ([self.g4_member] if self.g4_tier else []) + [own]

    def g4_writes(self) -> str | None:
        """Where the shared G4 blocks this target publishes are indexed (one mounting no shared tier:
        its own LOCAL entry)."""
        return self.g4_member if self.g4_tier else local_g4_member(self.name)

    @property
    def routable(self) -> bool:
        """Healthy, in the fleet and not draining: it takes new work."""
        return self.healthy and self.lost_at is None and not self.draining

    @property
    def owner_reachable(self) -> bool:
        """In the fleet and its process not seen gone (connections refused): asked for what only it holds
        (a stored response's GET, cancel or delete) even while draining or failing health checks. No other
        worker can answer those, and a /health that timed out on a busy server says nothing of the response
        (a cancel during a long generation on a loaded CPU server was refused, 503, while vLLM was up)."""
        return self.lost_at is None and not self.down

    def base_model(self) -> str | None:
        for mid, info in self.models.items():
            if not info.get("parent"):
                return mid
        return next(iter(self.models), None)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "url": self.url, "healthy": self.healthy, "draining": self.draining,
            "models": sorted(self.models), "model": self.base_model(), "block_size": self.block_size,
            "event_sources": self.event_sources,
            "load": {"running": self.load.running, "waiting": self.load.waiting,
                     "kv_usage": self.load.kv_usage, "updated_at": self.load.updated_at},
            "inflight": self.inflight, "pending_tokens": self.pending_tokens, "engine": self.engine.to_dict(),
            "prediction": self.prediction.to_dict(), "eviction": self.eviction.to_dict(),
            "ttft_fit": self.ttft_fit.to_dict(), "prefill_ratio": self.prefill_ratio, "ttft_samples": self.ttft_samples,
            "prefill_samples": self.prefill_samples,
            "failures": self.failures, "restarts": self.restarts, "last_error": self.last_error,
            "last_check": self.last_check, "cache_blind": self.cache_blind, "parity": self.parity,
            "ranks": [r.to_dict() for r in self.ranks], "skipped_sources": self.skipped_sources,
            "prefetch_url": self.prefetch_url, "g4_tier": self.g4_tier,
        }


DP_RANK_HEADER = "x-data-parallel-rank"


class RankTarget:
    """One data-parallel rank of a vLLM server, as a routing target of its own.

    With ``--data-parallel-size N`` one API port fronts N engines, each with its own KV cache, its own event
    stream (rank r publishes on the events port + r) and its own ``engine="r"`` series on ``/metrics``; a
    request goes to rank r with ``X-data-parallel-rank: r`` (without it vLLM picks a rank by load, and the
    prefix may be on another one). So each rank is indexed, loaded and picked on its own, under the name
    ``<server>@dp<r>``: that name is its index key, its event source and its candidate in decisions.

    A rank is a view of its server: it owns only the fields listed in ``OWN`` (what the gateway and vLLM
    count per engine). Everything else (health, draining, models, block size, parity, url) is read from
    and written to the server, so the registry's bookkeeping stays per server. A server with one rank
    has no RankTarget: it is routed, indexed and named exactly as before, and no header is sent.
    """

    OWN = frozenset({"server", "dp_rank", "name", "event_sources", "load", "active", "gate", "engine", "prediction",
                     "eviction", "ttft_fit", "prefill_ratio", "ttft_samples", "prefill_samples"})

    def __init__(self, server: Worker, rank: int) -> None:
        e = server.engine  # the rank starts from the server's priors and calibrates on its own series
        own = {"server": server, "dp_rank": rank, "name": f"{server.name}@dp{rank}",
               "event_sources": [], "load": WorkerLoad(), "active": ActiveSequences(server.active.mean_work),
               "gate": PrefillGate(),
               "engine": EngineCalibration(e.step_s, e.seq_s, e.request_s), "prediction": PredictionErrors(),
               "eviction": EvictionCalibration(), "ttft_fit": TtftFit(),
               "prefill_ratio": 1.0, "ttft_samples": 0, "prefill_samples": 0}
        self.__dict__.update(own)

    # the load tracker's figures are the rank's own (the server's properties, read on the rank)
    inflight = Worker.inflight
    view = Worker.view
    pending_tokens = Worker.pending_tokens
    g4_reads = Worker.g4_reads  # with the rank's own name: its LOCAL storage is its own
    g4_writes = Worker.g4_writes

    def __getattr__(self, attr):  # only called for what the rank does not own
        return getattr(self.__dict__["server"], attr)

    def __setattr__(self, attr, value) -> None:
        if attr in self.OWN:
            self.__dict__[attr] = value
        else:
            setattr(self.server, attr, value)

    def targets(self) -> list:
        return [self]

    @property
    def prefetch_url(self) -> str | None:
        """The rank's own connector endpoint: each engine of a data-parallel server runs kvgate's connector,
        and rank r's serves on the server's prefetch port + r (cache_tier/connector_worker.py, as vLLM
        offsets its event ports)."""
        return rank_url(self.server.prefetch_url, self.dp_rank)

    def pin(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with ``X-data-parallel-rank`` set to this rank (a client's own value replaced)."""
        out = {k: v for k, v in headers.items() if k.lower() != DP_RANK_HEADER}
        out[DP_RANK_HEADER] = str(self.dp_rank)
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "dp_rank": self.dp_rank, "event_sources": self.event_sources,
                "load": {"running": self.load.running, "waiting": self.load.waiting,
                         "kv_usage": self.load.kv_usage, "updated_at": self.load.updated_at},
                "inflight": self.inflight, "pending_tokens": self.pending_tokens,
                "prefill_ratio": self.prefill_ratio, "ttft_samples": self.ttft_samples,
                "prefill_samples": self.prefill_samples, "engine": self.engine.to_dict(),
                "prediction": self.prediction.to_dict(), "eviction": self.eviction.to_dict(),
                "ttft_fit": self.ttft_fit.to_dict()}


def rank_url(url: str | None, rank: int) -> str | None:
    """``url`` with its port moved up by ``rank`` (a URL without a port is left alone)."""
    if not url or not rank:
        return url
    parts = urlsplit(url)
    if parts.port is None:
        return url
    host = parts.netloc.rpartition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port + rank}"))


def index_names(w: Worker) -> list[str]:
    """The names a server's entries are kept under in the index: its own, and each rank's."""
    return [w.name, *(t.name for t in w.ranks)]


def resolve_g4(cfg: WorkerConfig, settings: Settings, host: str) -> tuple[str | None, str, str | None]:
    """(prefetch URL, G4 tier, the tier's index entry) of a worker: its own settings, else the fleet's."""
    g4 = settings.g4
    url = cfg.prefetch_url.rstrip("/") if cfg.prefetch_url else None
    if url is None and g4.prefetch_port:
        url = f"{g4.prefetch_scheme}://{host}:{g4.prefetch_port}"
    tier = g4.tier if cfg.g4_tier is None else cfg.g4_tier
    member = None if tier == g4.tier or not tier else shared_g4_member(tier)
    return url, tier, member


def worker_name(cfg: WorkerConfig) -> str:
    if cfg.name:
        return cfg.name
    parts = urlsplit(cfg.url)
    return parts.netloc or cfg.url
