"""The worker registry: which vLLM servers exist, which models they serve, their block size, load and
health, and the subscription of their KV events.

Per worker it reads ``/v1/models``, ``/kv_event_sources`` (unless the events endpoint is configured) and
``/metrics`` (``vllm:cache_config_info`` for the block size; running/waiting/KV usage gauges), and checks
``/health`` periodically. A worker that fails ``unhealthy_after`` checks in a row, or refuses a connection,
leaves the candidate set; it returns when a check passes.

Coming back is not evidence of a restart (a flap, a keep-alive race, a readiness blip): the worker's index
entries stay and its event stream is asked to replay what it missed (``EventIngestor.resync``). A worker
whose port refuses ``unhealthy_after`` health checks in a row is down (the process is gone, and its KV
cache with it): its entries are dropped then. Only
evidence counts as a restart: vLLM's ``process_start_time_seconds`` on ``/metrics`` changing (then the
entries are dropped and the events re-subscribed from scratch), or the event stream itself (its sequence
going backwards, ``AllBlocksCleared``), which the ingestor handles in its apply order. A worker that
leaves discovery (Kubernetes readiness) stops taking requests at once and is removed only after
``lost_grace_s``; back within it, it keeps its entries.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from indexer.events.state import local_g4_member, shared_g4_member
from indexer.events.subscriber import resolve_endpoint
from router.calibrate import EngineCalibration, PredictionErrors, default_calibration
from router.config import Settings, WorkerConfig
from router.eviction import EvictionCalibration
from router.admission import PrefillGate
from router.load import ActiveSequences, LoadView
from router.ttft_fit import TtftFit
from router.upstream import Upstream, UpstreamError

log = logging.getLogger("kvgate.registry")


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
        return self.healthy and not self.draining and self.lost_at is None

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


_LATENCY_HISTOGRAMS = {"vllm:inter_token_latency_seconds": "itl", "vllm:time_to_first_token_seconds": "ttft",
                       "vllm:request_queue_time_seconds": "queue", "vllm:e2e_request_latency_seconds": "e2e",
                       "vllm:request_inference_time_seconds": "inference"}
_PREFILL_HISTOGRAMS = {"vllm:request_prefill_kv_computed_tokens": "prefill_tokens",
                       "vllm:request_prefill_time_seconds": "prefill_seconds",
                       "vllm:request_prompt_tokens": "prompt_tokens"}


# Every family parse_metrics reads. The rest of a page (histogram buckets, Python and process collectors,
# speculative decoding, LoRA) is dropped before prometheus_client's parser sees it.
_READ = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         *_PREFILL_HISTOGRAMS, *_LATENCY_HISTOGRAMS, "vllm:iteration_tokens_total",
         "vllm:prompt_tokens_by_source", "process_start_time_seconds", "vllm:cache_config_info")
_KEEP = tuple(_READ) + tuple(f"# TYPE {n}" for n in _READ)


def wanted_metrics(text: str) -> str:
    """The lines of a /metrics page that :func:`parse_metrics` reads: the ``# TYPE`` line and the samples of
    its families, without histogram buckets. Why: prometheus_client's parser is pure Python, ~5 ms per
    page of the simulator (265 lines, 181 of them buckets; vLLM's own pages are longer), and with 16
    workers scraped every second it was 19% of the gateway's CPU in a simulator replay (py-spy). A line of
    another family that shares a prefix is kept and, as before, ignored by the parser's reader."""
    keep = _KEEP
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(keep) and "_bucket" not in line.partition("{")[0]) + "\n"


def parse_metrics(text: str, engine: str | None = None, kept: bool = False) -> tuple[WorkerLoad, int | None]:
    """Load gauges and block size from a vLLM /metrics page: summed over engines (DP ranks), or those of
    one ``engine`` label only (series without that label, such as the process start, always count).
    ``kept``: ``text`` is :func:`wanted_metrics`' output already (the scrape filters a page once for the
    server and each of its ranks)."""
    load = WorkerLoad(updated_at=time.time())
    block_size = None
    usage: list[float] = []
    for fam in text_string_to_metric_families(text if kept else wanted_metrics(text)):
        name = fam.name
        if engine is not None:
            fam.samples = [s for s in fam.samples if s.labels.get("engine", engine) == engine]
        if name == "vllm:num_requests_running":
            load.running += sum(s.value for s in fam.samples)
        elif name == "vllm:num_requests_waiting":
            load.waiting += sum(s.value for s in fam.samples)
        elif name == "vllm:kv_cache_usage_perc":
            usage.extend(s.value for s in fam.samples)
        elif name in _PREFILL_HISTOGRAMS:
            for smp in fam.samples:
                if smp.name == name + "_sum":
                    setattr(load, _PREFILL_HISTOGRAMS[name], getattr(load, _PREFILL_HISTOGRAMS[name]) + smp.value)
                elif smp.name == name + "_count" and name == "vllm:request_prefill_time_seconds":
                    load.prefill_requests += smp.value
        elif name in _LATENCY_HISTOGRAMS:
            attr = _LATENCY_HISTOGRAMS[name]
            total, count = getattr(load, attr)
            for smp in fam.samples:
                if smp.name == name + "_sum":
                    total += smp.value
                elif smp.name == name + "_count":
                    count += smp.value
            setattr(load, attr, (total, count))
        elif name == "vllm:iteration_tokens_total":
            load.steps += sum(smp.value for smp in fam.samples if smp.name == name + "_count")
        elif name == "vllm:prompt_tokens_by_source":
            computed = [smp.value for smp in fam.samples if smp.labels.get("source") == "local_compute"
                        and smp.name == name + "_total"]
            if computed:
                load.computed_tokens = (load.computed_tokens or 0.0) + sum(computed)
        elif name == "process_start_time_seconds":
            for s in fam.samples:
                load.process_start = s.value
        elif name == "vllm:cache_config_info":
            for s in fam.samples:
                bs = s.labels.get("block_size")
                if bs and bs.isdigit():
                    block_size = int(bs)
                nb = s.labels.get("num_gpu_blocks")
                if nb and nb.isdigit():
                    load.num_gpu_blocks = (load.num_gpu_blocks or 0) + int(nb)
    if usage:
        load.kv_usage = max(usage)
    return load, block_size


class DuplicateWorker(ValueError):
    """A worker name or URL that is registered already; ``param`` says which."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class WorkerRegistry:
    """Workers by name. ``add``/``remove``/``drain`` work at run time (the admin API calls them)."""

    def __init__(self, settings: Settings, index, ingestor=None, metrics=None):
        self.settings = settings
        # health checks, scrapes, models and event sources: their own pool (router/upstream.py)
        self.control = Upstream(settings, timeout_s=settings.health_timeout_s)
        self.index = index
        self.ingestor = ingestor
        self.metrics = metrics
        self._workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self._last_refresh: dict[str, float] = {}
        self._subscribed: dict[str, dict[str, tuple]] = {}  # server -> {index name: its subscribed source}
        self._targets: dict[str, RankTarget] = {}  # rank targets of data-parallel servers, by name
        # Called with a worker each time it becomes routable (first time, or back after a failure), once
        # its events are subscribed: the gateway runs the parity check there (router/parity.py).
        self.on_ready = None
        # Called with a worker's name whenever its index entries are dropped (restart, removal).
        self.on_cleared = None
        # Called with (worker, computed tokens, seconds, requests, prompt tokens) of prefills vLLM finished
        # between two scrapes.
        self.on_prefill = None
        self.on_engine = None  # (worker, EngineSample) per scrape
        self._discovery = None

    # --- queries -------------------------------------------------------------------------------
    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def get(self, name: str) -> Worker | None:
        """The server named ``name``, or the server of the rank target named so."""
        t = self._targets.get(name)
        return t.server if t is not None else self._workers.get(name)

    def target(self, name: str):
        """The routing target named ``name`` (a candidate's ``worker``): a rank of a data-parallel server
        (:class:`RankTarget`) or a server."""
        return self._targets.get(name) or self._workers.get(name)

    def models(self) -> dict[str, list[Worker]]:
        """Every model id (base models and LoRA adapters) -> workers that list it."""
        out: dict[str, list[Worker]] = {}
        for w in self._workers.values():
            for mid in w.models:
                out.setdefault(mid, []).append(w)
        return out

    def knows_model(self, model: str) -> bool:
        return any(model in w.models for w in self._workers.values()) or model in self.settings.models

    def candidates(self, model: str) -> list[Worker]:
        """Routing targets serving ``model`` on healthy, non-draining servers: each rank of a data-parallel
        server, every other server itself."""
        return [t for w in self._workers.values() if w.routable and model in w.models for t in w.targets()]

    def namespace(self, model: str) -> tuple[str, str | None]:
        """(index namespace, LoRA name) of a model id: a LoRA adapter lives in its base model's namespace."""
        for w in self._workers.values():
            info = w.models.get(model)
            if info is not None and info.get("parent"):
                return info["parent"], model
        return model, None

    def block_size(self, model: str) -> int:
        cfg = self.settings.models.get(model)
        if cfg is not None and cfg.block_size:
            return cfg.block_size
        ns, _ = self.namespace(model)
        if ns != model and ns in self.settings.models and self.settings.models[ns].block_size:
            return self.settings.models[ns].block_size
        for w in self._workers.values():
            if w.block_size and (model in w.models):
                return w.block_size
        return 16

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start discovery (static workers or Kubernetes), probe what it announced, start health checks."""
        from router.discovery import create_discovery

        self._discovery = create_discovery(self.settings, self._on_discovered, self._on_lost)
        await self._discovery.start()
        await asyncio.gather(*(self._probe(w, full=True) for w in self.workers() if not w.last_check),
                             return_exceptions=True)
        self._task = asyncio.create_task(self._loop(), name="kvgate-health")

    async def _on_discovered(self, cfg: WorkerConfig) -> None:
        w = self._workers.get(worker_name(cfg))
        if w is not None and w.lost_at is not None:
            if w.url == cfg.url.rstrip("/") and w.config == cfg:
                w.lost_at = None  # back within the grace period: a readiness flap, entries kept
                log.info("worker %s back in discovery", w.name)
                return
            await self.remove(w.name)
        await self.add(cfg, probe=self._task is not None)

    async def _on_lost(self, name: str) -> None:
        """Out of routing now; removed (and its entries dropped) only if it stays away ``lost_grace_s``."""
        w = self._workers.get(name)
        if w is None:
            return
        if self.settings.lost_grace_s <= 0:
            await self.remove(name)
        elif w.lost_at is None:
            w.lost_at = time.monotonic()
            self._unhold(w)
            log.info("worker %s left discovery; removed in %.0f s unless it returns", name,
                     self.settings.lost_grace_s)

    async def stop(self) -> None:
        if self._discovery is not None:
            try:
                await self._discovery.stop()
            except Exception as e:
                log.warning("stopping discovery: %s", e)
            self._discovery = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        await self.control.close()

    async def add(self, cfg: WorkerConfig, *, probe: bool = True) -> Worker:
        name = worker_name(cfg)
        if name in self._workers:
            raise DuplicateWorker(f"worker {name!r} already exists", "name")
        url = cfg.url.rstrip("/")
        same = next((o for o in self._workers.values() if o.url == url), None)
        if same is not None and same.lost_at is not None:
            await self.remove(same.name)  # a pod gone from discovery whose IP a new pod reuses
        elif same is not None:  # one server counted twice would get twice its share
            raise DuplicateWorker(f"worker {same.name!r} already has the URL {url}", "url")
        r = self.settings.routing
        w = Worker(name=name, url=cfg.url.rstrip("/"), config=cfg,
                   active=ActiveSequences(float(r.queued_request_tokens)),
                   engine=EngineCalibration(r.step_ms / 1000.0, r.per_decode_ms / 1000.0,
                                            r.request_overhead_ms / 1000.0))
        w.prefetch_url, w.g4_tier, w.g4_member = resolve_g4(cfg, self.settings, w.host)
        self._workers[name] = w
        if probe:
            await self._probe(w, full=True)
        return w

    @staticmethod
    def _unhold(w: Worker) -> None:
        """Out of routing: the requests held at its prefill gates (router/admission.py), every rank's of a
        data-parallel server, go elsewhere now."""
        for t in getattr(w, "server", w).targets():
            t.gate.release_all()

    async def remove(self, name: str) -> Worker:
        w = self._workers.pop(name, None)
        if w is None:
            raise KeyError(name)
        w.draining = True  # what still holds it (a request in flight, one held at its gate) sees it gone
        self._unhold(w)
        await self._unsubscribe(w)
        await self._clear_index(w, local_g4=True)
        if self.metrics is not None:
            for n in index_names(w):
                self.metrics.forget_worker(n)
        for t in w.ranks:
            self._targets.pop(t.name, None)
        return w

    async def drain(self, name: str, draining: bool = True) -> Worker:
        """No new requests go to a draining worker; in-flight ones finish."""
        w = self._workers.get(name)
        if w is None:
            raise KeyError(name)
        w.draining = draining
        if draining:
            self._unhold(w)
        return w

    def mark_failed(self, w: Worker, reason: str) -> None:
        """Passive health: a refused connection takes the worker out until a health check passes."""
        w.last_error = reason
        if w.healthy:
            log.warning("worker %s unhealthy: %s", w.name, reason)
        w.healthy = False
        w.failures = max(w.failures, self.settings.unhealthy_after)
        self._unhold(w)

    async def on_events_reset(self, worker: str, reason: str = "restart") -> None:
        """The ingestor reset the worker's entries (sequence went backwards: a restart; or an unfillable
        gap). The ingestor already cleared the index in its apply order: clearing again here would race
        with what it stores next, so only the gateway-side bookkeeping follows."""
        w = self.target(worker)  # the stream of one rank: that rank's entries were reset
        if w is None:
            return
        if reason == "restart":
            w.restarts += 1
        if self.on_cleared is not None:
            self.on_cleared(w.name)

    async def _down(self, w: Worker) -> None:
        """Nothing listens on the worker's port any more, check after check: the process is gone and its
        KV cache with it. Drop the entries now (not only when a new process shows up) and stay subscribed
        for the one that comes back; its first scrape is not compared with the old process's start."""
        log.info("worker %s is down (connection refused): dropping its index entries", w.name)
        w.down = True
        await self._unsubscribe(w)
        await self._clear_index(w)
        await self._subscribe(w)
        w.load.process_start = None

    async def _restarted(self, w: Worker, reason: str) -> None:
        """Evidence of a restart outside the event stream: drop the entries and subscribe afresh (the
        new source replays what the new process's publisher already buffers)."""
        log.info("worker %s restarted (%s): dropping its index entries", w.name, reason)
        await self._unsubscribe(w)
        await self._clear_index(w)
        await self._subscribe(w)
        w.restarts += 1

    # --- probing -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        interval = max(0.05, self.settings.health_interval_s)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            jobs = []
            for w in self.workers():
                if w.lost_at is not None and now - w.lost_at >= self.settings.lost_grace_s:
                    jobs.append(self._remove_lost(w.name))
                    continue
                full = now - self._last_refresh.get(w.name, 0.0) >= self.settings.refresh_interval_s
                jobs.append(self._probe(w, full=full))
            await asyncio.gather(*jobs, return_exceptions=True)

    async def _remove_lost(self, name: str) -> None:
        w = self._workers.get(name)
        if w is not None and w.lost_at is not None:
            log.info("worker %s did not return to discovery: removed", name)
            await self.remove(name)

    async def _get(self, w: Worker, path: str) -> tuple[int, bytes]:
        """``GET`` a worker's control path: (status, body); raises UpstreamError."""
        return await self.control.get(w.url + path)

    async def _probe(self, w: Worker, *, full: bool) -> None:
        """Health check, load scrape, and (``full``) models and event sources."""
        w.last_check = time.time()
        try:
            status, _ = await self._get(w, "/health")
            ok = status == 200
            reason = None if ok else f"/health answered {status}"
        except UpstreamError as e:
            ok, reason = False, f"/health: {e.kind}: {e}"
            refused = e.kind == "connect"
        else:
            refused = False
        if not ok:
            w.failures += 1
            w.last_error = reason
            if w.healthy and w.failures >= self.settings.unhealthy_after:
                log.warning("worker %s unhealthy: %s", w.name, reason)
                w.healthy = False
                self._unhold(w)
            w.refused = w.refused + 1 if refused else 0
            if w.refused >= self.settings.unhealthy_after and w.ever_healthy and not w.down:
                await self._down(w)
            return
        returning = not w.healthy
        if w.down:
            w.restarts += 1  # nothing listened, now something does: a new process
        w.failures = w.refused = 0
        w.down = False
        flapped = returning and w.ever_healthy
        if flapped:
            full = True  # refresh models and event sources; the scrape below tells a restart
        if full or not w.models:
            await self._refresh_models(w)
            self._last_refresh[w.name] = time.monotonic()
        await self._scrape(w)
        if returning:
            if not w.models:
                return  # healthy but serves nothing we know yet: try again next tick
            w.healthy = True
            w.ever_healthy = True
            w.last_error = None
            log.info("worker %s healthy (%s)", w.name, ", ".join(w.models))
        subscribed = (full or returning) and await self._subscribe(w)
        if flapped and self.ingestor is not None and self._subscribed.get(w.name):
            resync = getattr(self.ingestor, "resync", None)
            if resync is not None:
                for name in self._subscribed[w.name]:
                    resync(name)  # no restart seen: keep the entries, replay what may have been missed
        # Ready again, or ready with a new event stream (its sources could not be read when it came up,
        # or they changed): the parity check (router/parity.py) needs the stream it checks.
        if (returning or subscribed) and self.on_ready is not None:
            self.on_ready(w)

    async def _refresh_models(self, w: Worker) -> None:
        try:
            status, body = await self._get(w, "/v1/models")
            if status != 200:
                raise ValueError(f"answered {status}")
            data = json.loads(body).get("data", [])
            w.models = {m["id"]: {"parent": m.get("parent"), "root": m.get("root"),
                                  "max_model_len": m.get("max_model_len"), "card": m}
                        for m in data if isinstance(m, dict) and m.get("id")}
        except (UpstreamError, ValueError, AttributeError) as e:
            w.last_error = f"/v1/models: {e}"
        if w.config.events_endpoint:
            w.event_sources = [{"rank": 0, "endpoint": resolve_endpoint(w.config.events_endpoint, w.url),
                                "replay_endpoint": resolve_endpoint(w.config.replay_endpoint, w.url),
                                "topic": ""}]
            return
        try:
            status, body = await self._get(w, "/kv_event_sources")
            if status == 200:
                self._set_sources(w, json.loads(body))
        except (UpstreamError, ValueError) as e:
            w.last_error = f"/kv_event_sources: {e}"

    def _set_sources(self, w: Worker, data) -> None:
        """Take ``/kv_event_sources`` (``{"<dp rank>": KVEventsConfig}``): one event source per rank, and
        with more than one rank listed a :class:`RankTarget` per rank. A rank that cannot be subscribed (no
        endpoint, events off, a value that is no object) stays a target without events; a key that is no
        rank number is ignored. Each left-out rank is listed in ``w.skipped_sources`` and logged when that
        list changes; the other ranks stand."""
        srcs: dict[int, dict] = {}
        skipped: list[dict] = []
        for key, cfg in (data.items() if isinstance(data, dict) else [(None, data)]):
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                skipped.append({"rank": key, "reason": "not a data-parallel rank"})
                continue
            rank = int(key)
            endpoint = cfg.get("endpoint") if isinstance(cfg, dict) else None
            if not isinstance(cfg, dict):
                skipped.append({"rank": rank, "reason": "no config"})
                srcs[rank] = {}
            elif not cfg.get("enable_kv_cache_events", True):
                skipped.append({"rank": rank, "reason": "KV events off"})
                srcs[rank] = {}
            elif not endpoint or not isinstance(endpoint, str):
                skipped.append({"rank": rank, "reason": "no endpoint"})
                srcs[rank] = {}
            else:
                replay = cfg.get("replay_endpoint")
                replay = resolve_endpoint(replay, w.url) if isinstance(replay, str) else None
                srcs[rank] = {"rank": rank, "endpoint": resolve_endpoint(endpoint, w.url),
                              "replay_endpoint": replay, "topic": str(cfg.get("topic") or "")}
        if skipped != w.skipped_sources and skipped:
            log.warning("worker %s: event sources left out: %s", w.name,
                        ", ".join(f"rank {s['rank']!r} ({s['reason']})" for s in skipped))
        w.skipped_sources = skipped
        w.event_sources = [srcs[r] for r in sorted(srcs) if srcs[r]]
        old = {t.dp_rank: t for t in w.ranks}
        w.ranks = [] if len(srcs) < 2 else [old.get(r) or RankTarget(w, r) for r in sorted(srcs)]
        for t in old.values():
            self._targets.pop(t.name, None)
        for t in w.ranks:
            t.event_sources = [srcs[t.dp_rank]] if srcs[t.dp_rank] else []
            self._targets[t.name] = t

    async def _scrape(self, w: Worker) -> None:
        try:
            status, body = await self._get(w, "/metrics")
            if status != 200:
                return
            ranks = list(w.ranks)

            def parse(text: str = body.decode("utf-8", "replace")) -> list:
                text = wanted_metrics(text)  # once for the server and its ranks
                return [parse_metrics(text, kept=True)] + [parse_metrics(text, str(t.dp_rank), kept=True)
                                                           for t in ranks]

            (load, bs), *per_rank = await asyncio.to_thread(parse)
        except (UpstreamError, ValueError) as e:
            w.last_error = f"/metrics: {e}"
            return
        before = w.load.process_start
        # Prefills finished since the last scrape calibrate the target that ran them: each rank, or the
        # server. The first scrape compares with zero: what the server did before this gateway saw it
        # (warm-up, earlier traffic) calibrates it at once, instead of the priors routing the first burst.
        done = []
        for t, tload in list(zip(ranks, (lo for lo, _ in per_rank))) or [(w, load)]:
            then = t.load if t.load.updated_at else WorkerLoad(running=tload.running, computed_tokens=(
                None if tload.computed_tokens is None else 0.0))
            done.append((t, tload.prefill_since(then), tload.engine_since(then)))
            t.load = tload
            t.active.mark_scrape(tload.waiting)  # the usage now includes what the gateway's requests took
        w.load = load
        if before is not None and load.process_start is not None and load.process_start != before:
            await self._restarted(w, "process_start_time_seconds changed")
        elif self.ingestor is not None and not w.down:
            record = getattr(self.ingestor, "record_incarnation", None)
            for name in self._subscribed.get(w.name, ()) if record is not None else ():
                inc = self._incarnation(w, name)
                if inc is not None:
                    await record(name, inc)
        for t, d, engine in done:
            if d is not None and self.on_prefill is not None:
                self.on_prefill(t, *d)
            if self.on_engine is not None:
                self.on_engine(t, engine)
        if bs:
            w.block_size = bs

    async def _subscribe(self, w: Worker) -> bool:
        """Subscribe to each of the worker's event streams (one per routing target: the server, or each
        rank, under its index name) unless already subscribed to it; True when a new subscription was
        made. A stream that fails to subscribe leaves the others subscribed; a stream no longer listed
        (a rank gone, or left without an endpoint) is unsubscribed and its entries dropped."""
        model = w.base_model()
        if self.ingestor is None or model is None:
            return False
        from indexer.events import EventSource

        want = {t.name: (model, s["endpoint"], s["replay_endpoint"], s["topic"])
                for t in w.targets() for s in t.event_sources[:1]}
        if not want:  # no stream known (yet): what is subscribed stays
            return False
        have = self._subscribed.setdefault(w.name, {})
        for name in [n for n in have if n not in want]:
            await self._remove_source(have, name, clear=True)
        new = False
        for name, key in want.items():
            if have.get(name) == key:
                continue
            have.pop(name, None)  # add_source replaces the old stream of that name, entries kept
            try:
                await self.ingestor.add_source(EventSource(
                    worker=name, model=model, endpoint=key[1], replay_endpoint=key[2], topic=key[3],
                    block_size=w.block_size, worker_url=w.url, g4_member=self._g4_writes(w, name),
                    incarnation=self._incarnation(w, name)))
            except Exception as e:  # a bad endpoint must not take the worker (or its other ranks) out
                w.last_error = f"events of {name}: {type(e).__name__}: {e}"
                log.warning("subscribing to the events of %s: %s", name, e)
                continue
            have[name] = key
            new = True
        return new

    @staticmethod
    def _target(w: Worker, name: str) -> Worker:
        """The routing target (the server, or one of its ranks) whose event stream is ``name``."""
        return next((t for t in w.targets() if t.name == name), w)

    def _incarnation(self, w: Worker, name: str) -> str | None:
        """The engine process behind the stream (its process start, from the last scrape); None while
        unknown, and for a worker that is down (the start read last is the dead process's)."""
        start = self._target(w, name).load.process_start
        return None if start is None or w.down else repr(start)

    def _g4_writes(self, w: Worker, name: str) -> str | None:
        return self._target(w, name).g4_writes()

    async def _remove_source(self, have: dict[str, tuple], name: str, clear: bool) -> None:
        have.pop(name, None)
        try:
            await self.ingestor.remove_source(name, clear=clear)
        except Exception as e:  # never let the event side break the registry
            log.warning("removing event source of %s: %s", name, e)

    async def _unsubscribe(self, w: Worker, clear: bool = True) -> None:
        have = self._subscribed.pop(w.name, None)
        if self.ingestor is None or not have:
            return
        for name in list(have):
            await self._remove_source(have, name, clear)

    async def _clear_index(self, w: Worker, local_g4: bool = False) -> None:
        """Drop the worker's entries; ``local_g4`` (it leaves the fleet) also its LOCAL G4 entries, which
        a restart keeps (the files outlive the process)."""
        names = index_names(w)
        if self.on_cleared is not None:
            for n in names:
                self.on_cleared(n)
        models = {self.namespace(m)[0] for m in w.models} or set()
        try:
            models.update(await self.index.models())
        except Exception:
            pass
        if local_g4:
            names = names + [local_g4_member(n) for n in names]
        for m in models:
            for n in names:
                try:
                    await self.index.clear_worker(m, n)
                except Exception as e:
                    log.warning("clearing index entries of %s/%s: %s", n, m, e)
