"""Response and request models of the admin API, so the app's OpenAPI document describes every route."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class _Open(BaseModel):
    """Carries extra keys through: the ingestor and the index may report more than we name here."""

    model_config = ConfigDict(extra="allow")


# --- workers --------------------------------------------------------------------------------------------


class EventsStatus(_Open):
    connected: bool | None = None
    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0
    resets: int = 0
    applied: int = 0
    dropped: int = 0
    unknown_parent: int = 0
    synced: bool = Field(True, description="false while an index outage keeps writes back; the exact state "
                                           "is pushed back when the index answers")
    resyncs: int = Field(0, description="replays asked for after a health flap (no restart seen)")
    skipped: int = Field(0, description="events of a medium or KV cache kind kvgate does not index, dropped")
    bad_locality: int = Field(0, description="STORAGE events whose locality is neither LOCAL nor REMOTE, "
                                             "dropped")
    g4_backlog_dropped: int = Field(0, description="G4 blocks whose index write was dropped from the full "
                                    "backlog kept during an index outage (the G4 entries then need a "
                                    "rebuild)")


class WorkerLoadOut(BaseModel):
    running: float = Field(0, description="vLLM's num_requests_running (last scrape)")
    waiting: float = Field(0, description="vLLM's num_requests_waiting (last scrape)")
    kv_usage: float = Field(0, description="vLLM's kv_cache_usage_perc (0-1)")
    kv_usage_known: bool = Field(True, description="false when the last /metrics page had no valid "
                                 "kv_cache_usage_perc: the free KV room is unknown, no eviction is priced "
                                 "from it")
    rejected_samples: int = Field(0, description="/metrics samples dropped so far: not a finite, "
                                  "non-negative number within what vLLM can report (a broken exporter)")
    inflight: int = Field(0, description="requests the gateway has in flight on this worker")
    pending_tokens: int = Field(0, description="prefill work sent and not yet prefilled, in tokens at "
                                               "context 0 (see routing.attention_knee_tokens)")
    prefill_tokens_per_s: float = Field(0, description="calibrated prefill speed in use: the fleet-wide "
                                                      "estimate (times prefill_ratio with routing."
                                                      "per_worker_prefill_speed)")
    prefill_ratio: float = Field(1.0, description="this worker's observed speed relative to the fleet's "
                                                  "(slow EWMA); a persistent value far from 1 suggests "
                                                  "different hardware")
    prefill_samples: int = Field(0, description="observations that calibrated it: streamed TTFTs and "
                                                "vLLM's prefill histograms between two scrapes")
    ttft_samples: int = Field(0, description="streamed responses whose time to first byte was seen")
    pending_requests: int = Field(0, description="requests the gateway sent that have no first token yet "
                                  "(those waiting at its prefill gate too)")
    gated_requests: int = Field(0, description="of those, the ones waiting at the gateway's prefill gate "
                                "(routing.prefill_gate): not sent yet, the shortest goes first")
    decodes: int = Field(0, description="requests decoding: the gateway's own, or vLLM's running beyond "
                                        "the gateway's prefilling ones, the larger")
    engine: dict = Field(default_factory=dict, description="the scheduler model's parameters for this worker "
                         "(router/calibrate.py): step_ms, per_decode_ms, request_overhead_ms, their samples, "
                         "and source: defaults (no samples yet), partial or vllm-metrics")
    prediction: dict = Field(default_factory=dict, description="observed / predicted TTFT over the last "
                             "streamed responses: samples, median, p90 (1 = exact)")
    eviction: dict = Field(default_factory=dict, description="the eviction model's pressure scale learnt from "
                           "delivered cached tokens (router/eviction.py): pressure_scale (1 = the prior), "
                           "samples, shortfalls (requests that got less of their local prefix than indexed)")
    ttft_fit: dict = Field(default_factory=dict, description="what the scheduler model's sum still gets wrong, "
                           "learnt from this worker's streamed TTFTs (router/ttft_fit.py): intercept_ms, the "
                           "scales of compute, steps and queue, cached_ms_per_1k, g4_load_ms (what a request "
                           "loading from G4 waits beyond its bytes), samples, active (used once it has 8; the "
                           "fleet-wide fit prices every worker unless routing.per_worker_prefill_speed)")


class WorkerOut(BaseModel):
    name: str
    url: str
    healthy: bool
    draining: bool
    model: str | None = Field(None, description="base model (index namespace)")
    models: list[str] = Field(default_factory=list, description="model ids served, LoRA adapters included")
    block_size: int | None = None
    events: EventsStatus | None = Field(None, description="KV event ingestion status (None: not subscribed)")
    load: WorkerLoadOut
    cached_blocks: dict[str, int] = Field(default_factory=dict, description="index entries per tier: GPU, "
                                          "CPU, and G4_LOCAL (blocks on its own LOCAL offload storage)")
    prefetch_url: str | None = Field(None, description="kvgate's connector endpoint prefetch orders go to: "
                                     "the worker's own prefetch_url (configuration, pod annotation "
                                     "kvgate.io/prefetch-url), else g4.prefetch_port on its host; null: none")
    g4_tier: str = Field("shared", description="the shared G4 tier it mounts (g4_tier, pod annotation "
                         "kvgate.io/g4-tier, else g4.tier; empty: none): it is credited with the blocks "
                         "of every worker of its model mounting the same tier")
    parity: ParityOut | None = Field(None, description="last parity check (at registration or on demand)")
    cache_blind: bool = Field(False, description="parity failed: routing ignores its cache entries")
    chat_cache_blind: bool = Field(False, description="cache-blind, or the chat parity probe failed: chat "
                                                      "routing ignores its cache entries")
    restarts: int = 0
    last_error: str | None = None
    dp_rank: int | None = Field(None, description="set on an entry of ``ranks``: its data-parallel rank")
    ranks: list[WorkerOut] = Field(
        default_factory=list,
        description="a data-parallel server's ranks (more than one rank in its /kv_event_sources), each a "
                    "routing target of its own named <server>@dp<r>: that name is its index key, its event "
                    "stream and its candidate in decisions; requests go to it with X-data-parallel-rank: r. "
                    "Each has its own events, load (vLLM's engine=\"r\" series) and cached blocks; the "
                    "server's cached_blocks add theirs up. Empty for a server with one rank")
    skipped_sources: list[dict] = Field(
        default_factory=list, description="ranks of /kv_event_sources not subscribed, and why (no endpoint, "
                                          "events off, not a rank): those ranks are routed by load only")


class ParityOut(_Open):
    """The gateway's parity check of a worker (router/parity.py): do kvgate's block keys of a probe
    prompt come back in the worker's KV events?"""

    status: str = Field(..., description="ok | cache-blind (routing ignores its cache) | unverified | "
                                         "no-events (the worker has no KV event source)")
    reason: str = ""
    model: str | None = None
    block_size: int = 0
    expected_blocks: int = 0
    matched_blocks: int = 0
    kvgate_tokens: int = 0
    worker_tokens: int | None = None
    attempts: int = 0
    elapsed_s: float = 0.0
    checked_at: float | None = None
    apis: dict[str, dict] = Field(
        default_factory=dict,
        description="per-API probes (responses, messages): status ok | cache-blind (routing ignores the "
                    "worker's cache for that API only) | unverified, with reason and token/block counts")
    chat: ChatParityOut | None = Field(None, description="the chat probe (None: not run)")


class ChatMismatch(_Open):
    index: int = Field(..., description="position of the first token that differs")
    kvgate_token: int | None = Field(None, description="kvgate's token id there (None: kvgate's ids end)")
    worker_token: int | None = Field(None, description="the worker's token id there (None: its ids end)")
    kvgate_text: str | None = Field(None, description="kvgate's next few tokens there, decoded")
    worker_text: str | None = Field(None, description="the worker's next few tokens there, decoded")


class ChatParityOut(_Open):
    """kvgate's token ids of a probe conversation (system prompt, content list, tool call and tool
    message) against the worker's own /tokenize of it."""

    status: str = Field(..., description="ok | cache-blind (chat routing ignores its cache) | unverified")
    reason: str = ""
    kvgate_tokens: int | None = None
    worker_tokens: int | None = None
    first_mismatch: ChatMismatch | None = None


class WorkerList(BaseModel):
    workers: list[WorkerOut]
    index_error: str | None = Field(None, description="why cached_blocks are missing (index unreachable)")


class AddWorker(BaseModel):
    """A vLLM server to add at run time (same fields as a ``workers:`` entry of the configuration)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., description="base URL, e.g. http://10.0.0.7:8000")
    name: str | None = Field(None, max_length=200, pattern=r"^[^/\s]+$",
                             description="unique name (default host:port); no '/' or spaces")
    events_endpoint: str | None = Field(None, description="ZMQ PUB endpoint; discovered when omitted")
    replay_endpoint: str | None = None
    prefetch_url: str | None = Field(None, description="kvgate's connector endpoint on this worker (http(s) "
                                     "URL); default: g4.prefetch_port on its host")
    g4_tier: str | None = Field(None, max_length=200, description="the shared G4 tier it mounts (default "
                                "g4.tier; empty: none)")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="the server's --max-num-batched-tokens "
                                               "when it differs from routing.max_num_batched_tokens")

    @field_validator("url", "prefetch_url")
    @classmethod
    def _http_url(cls, v: str | None, info: ValidationInfo) -> str | None:
        from urllib.parse import urlsplit

        if v is None:
            return v
        parts = urlsplit(v)
        # the data path speaks plain HTTP to workers; the connector's endpoint may be https (httpx)
        schemes = ("http",) if info.field_name == "url" else ("http", "https")
        try:
            parts.port  # noqa: B018 - raises for a port that is no number in 0-65535
            ascii_host = (parts.hostname or "").isascii()
        except ValueError:
            ascii_host = False
        if parts.scheme not in schemes or not parts.hostname or not ascii_host:
            raise ValueError(f"{info.field_name} must be an {'/'.join(schemes)} URL with an ASCII host "
                             "(IDNA) and a numeric port, e.g. http://10.0.0.7:8000")
        return v

    @field_validator("events_endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError("must be a ZMQ endpoint such as tcp://10.0.0.7:5557")
        return v


class WorkerRemoved(BaseModel):
    removed: str


# --- index ----------------------------------------------------------------------------------------------


class ModelIndexStats(BaseModel):
    model: str
    blocks: int = Field(0, description="distinct blocks known for the model (G4 included)")
    entries_per_tier: dict[str, int] = Field(default_factory=dict, description="GPU, CPU, and the G4 tiers kept "
                                             "as index entries: G4_TIER (named shared tiers), G4_LOCAL "
                                             "(workers' LOCAL offload storage)")
    g4_blocks: int = Field(0, description="blocks on the model-wide G4 tier (g4.tier)")
    workers: dict[str, dict[str, int]] = Field(default_factory=dict, description="worker (a data-parallel "
                                               "worker's ranks: <name>@dp<r>) -> tier -> entries")
    redis_used_memory: int | None = Field(None, description="Redis used_memory in bytes (Redis backend)")
    events_applied: int = 0
    events_dropped: int = 0
    events_replays: int = 0


class IndexStats(BaseModel):
    backend: str
    models: list[ModelIndexStats]


class Flushed(BaseModel):
    model: str
    worker: str | None = None
    removed: int = Field(..., description="index entries removed")


# --- blocks ---------------------------------------------------------------------------------------------


class BlockOut(BaseModel):
    model: str
    hash: int = Field(..., description="kvgate sequence hash (unsigned 64-bit)")
    hash_hex: str
    workers: dict[str, list[str]] = Field(default_factory=dict, description="worker -> tiers holding it")
    g4: bool = Field(False, description="the index records the block on G4")
    g4_file: dict[str, Any] | None = Field(None, description="G4 file header, when a G4 store is configured")


# --- explain / decisions --------------------------------------------------------------------------------


class ExplainRequest(BaseModel):
    """A request as a client would send it, and where it would be sent."""

    model_config = ConfigDict(extra="forbid")

    body: dict[str, Any] = Field(..., description="the JSON body a client would POST")
    path: str | None = Field(None, description="/v1/chat/completions or /v1/completions; "
                                               "inferred from the body when omitted")
    model: str | None = Field(None, description="overrides body.model")
    headers: dict[str, str] = Field(default_factory=dict, description="request headers that matter to "
                                                                      "routing (e.g. the session header)")


class CandidateOut(_Open):
    """One worker's inputs and prediction for one request (best first in a decision)."""

    worker: str = Field(..., description="the routing target: a worker, or one rank of a data-parallel "
                                         "worker (<name>@dp<r>, sent with X-data-parallel-rank: r)")
    gpu_blocks: int = Field(0, description="leading prompt blocks held on GPU")
    cpu_blocks: int = Field(0, description="leading prompt blocks held on CPU")
    local_blocks: int = Field(0, description="leading blocks held on either tier (the usable local prefix)")
    g4_blocks: int = Field(0, description="blocks loadable from G4 beyond the local prefix")
    cached_tokens: int = 0
    uncached_tokens: int = 0
    inflight: int = 0
    pending_requests: int = 0
    pending_tokens: int = 0
    vllm_running: float = 0
    vllm_waiting: float = 0
    kv_usage: float = 0
    prefill_tokens_per_s: float = 0
    queue_ms: float = Field(0, description="load term: predicted queue wait (the queue's prefill work and "
                                           "the engine steps it takes)")
    prefill_work: float = Field(0, description="the uncached tokens' prefill work, in tokens at context 0 "
                                               "(attention makes later tokens cost more)")
    prefill_ms: float = Field(0, description="this request's prefill: its work / speed, its own engine "
                                             "steps and the per-request overhead")
    g4_load_ms: float = Field(0, description="time to load the G4 blocks")
    predicted_ttft_ms: float = Field(0, description="model_ttft_ms corrected by the learnt fit (fit_ms)")
    model_ttft_ms: float = Field(0, description="the scheduler model's sum: queue_ms + prefill_ms + g4_load_ms")
    fit_ms: float = Field(0, description="the correction learnt from observed TTFTs (router/ttft_fit.py), "
                          "within a factor of 4 of model_ttft_ms either way; 0 until 8 responses were seen")
    score_ms: float | None = Field(None, description="the policy's ordering key, lowest first (kv: the sum "
                                                     "of terms_ms); null for policies that do not score")
    terms_ms: dict[str, float] = Field(default_factory=dict, description=(
        "kv: score_ms by scorer (router/policies/scorers.py), weights applied: ttft (predicted TTFT), "
        "affinity (the cache edge, <= 0), recompute (prefill work beyond the best holder's), continuity "
        "(leaving the conversation's holder: future turns and the stay margin, larger where the holder's "
        "cache is roomy for the prompt), footprint (low-overlap prompts: how much more recently used cache "
        "it would evict here than on the best worker), load, delay (the wait it adds to the longer prompts "
        "held at the worker's prefill gate, which it goes before: its prefill time each)"))
    score_notes: list[str] = Field(default_factory=list, description="inputs a scorer found missing or "
                                   "malformed and the neutral value it used instead")
    load: float = 0
    queue_requests: float = Field(0, description="the queue the scheduler model stepped through: requests "
                                                 "ahead (the gateway's own prefilling ones and vLLM's waiting "
                                                 "beyond them)")
    queue_tokens: float = Field(0, description="their uncached prompt tokens, queue_lost_tokens included")
    queue_lost_tokens: float = Field(0, description="of queue_tokens: the cached prefixes the queued requests "
                                     "were sent for that the queue's own demand evicts before they run (the "
                                     "LRU model stepped through the queue), which they recompute")
    queue_done_ms: float = Field(0, description="of the queue's prefill, what the worker has done already and "
                                 "queue_ms leaves out: the time since the first of the gateway's requests "
                                 "without a first token was sent (or since the last first token), at most "
                                 "that request's prefill")
    jumped_requests: int = Field(0, description="prompts held at the worker's prefill gate that are longer "
                                 "than this one: the gate sends this one before them (the delay term)")
    kv_demand_tokens: float = Field(0, description="the KV the queue still allocates beyond the scraped usage "
                                    "(the requests vLLM was not running at the last scrape, and "
                                    "queue_lost_tokens): what the eviction model, the KV wait and the footprint "
                                    "scorer compare with kv_free_tokens")
    decodes: int = Field(0, description="requests decoding in every step (each adds per_decode_ms)")
    steps: int = Field(0, description="engine steps until this request's first token "
                                      "(max_num_batched_tokens less the decodes per step)")
    step_ms: float = Field(0, description="one step's fixed and decode cost")
    overhead_ms: float = Field(0, description="the per-request overhead: vLLM's time outside the engine "
                               "(e2e less queue and inference time of finished requests), its floor over "
                               "recent scrapes (the rest is the wait for the step in progress: queue)")
    calibration: str = Field("defaults", description="where step and overhead figures come from: defaults "
                                                     "(the worker's metrics gave no samples yet), partial, "
                                                     "vllm-metrics")
    clamped: bool = Field(False, description="the prediction was clamped (bad or missing figures)")
    evicted_blocks: int = Field(0, description="blocks of the local prefix expected to be evicted by the "
                                               "queue ahead before this request is scheduled (not counted "
                                               "as cached)")
    eviction_model: str = Field("", description="what priced evicted_blocks: empty (no queue ahead, no "
                                "prefix, or the room unknown), pressure (the queue's demand over the free room), "
                                "lru (this gateway's recent releases on the worker place the prefix in vLLM's "
                                "free queue: the demand evicts it past the free blocks released before it), "
                                "held (a request in flight holds it), waiting (routing.waiting_evicts: vLLM "
                                "reports requests waiting, so the part no request holds is priced lost), occupancy "
                                "(routing.occupancy_evicts: the requests in flight hold so much KV once "
                                "scheduled that the part of the prefix no request holds does not fit beside "
                                "them)")
    lru_older_tokens: float = Field(0.0, description="lru: the free tokens released before the prefix, which "
                                    "the queue's demand evicts first")
    prefix_age_tokens: float | None = Field(
        None, description="the KV the worker released since the prefix's last use, where an eviction model "
        "looked it up (null: not looked up, unknown, or a request in flight holds it)")
    eviction_scale: float = Field(1.0, description="the worker's learnt eviction pressure scale when this "
                                  "candidate was priced")
    occupancy_tokens: float | None = Field(None, description=(
        "occupancy, where it looked (null: not): the KV the requests in flight on the worker hold once this "
        "one is admitted (the decoding ones at their expected answer), with vLLM's waiting requests the "
        "gateway did not send at its mean prompt"))
    occupancy_held_blocks: int | None = Field(None, description=(
        "occupancy: the prefix's leading blocks a request in flight has in its prompt (not evictable; null: "
        "not probed, the prefix fitted)"))
    occupancy_excess_tokens: float | None = Field(None, description=(
        "occupancy: occupancy_tokens + the prefix + the KV released after it - the capacity - held blocks; "
        "the part over 0 is priced evicted from the prefix's tail (<= 0: it fits)"))
    eviction_pressure: float = Field(0.0, description="the queue ahead's block demand / the worker's free "
                                     "blocks, before the worker's learnt pressure scale (0: no queue or "
                                     "capacity unknown; -1: no free block)")
    kv_free: float | None = Field(None, description="the share of KV blocks no running request holds (1 - "
                                  "vllm:kv_cache_usage_perc at the last scrape, moved by what the gateway's "
                                  "own requests took and freed since when num_gpu_blocks is known); null when "
                                  "the metrics are missing or malformed")
    kv_free_tokens: float | None = Field(None, description="those blocks in tokens (with num_gpu_blocks from "
                                         "vllm:cache_config_info); null when unknown")
    kv_wait_ms: float = Field(0.0, description="of queue_ms: the wait until the gateway's decoding requests "
                              "end and free the KV the queue ahead and this request need beyond kv_free_tokens")


class DecisionOut(_Open):
    """A routing decision: its inputs, every candidate's prediction, and (after the response) the outcome."""

    request_id: str
    ts: float
    model: str
    path: str
    policy: str
    namespace: str = ""
    lora_name: str | None = None
    num_tokens: int = 0
    block_size: int = 0
    num_blocks: int = 0
    tokenizer: str | None = None
    tokenize_error: str | None = None
    reused_bytes: int = Field(0, description="prompt text whose token ids came from the prefix token cache")
    new_bytes: int = Field(0, description="prompt text tokenized for this request")
    tokens_estimated: bool = Field(False, description="the prompt's tail was not tokenized (no worker's cached "
                                   "prefix reaches it): num_tokens is estimated from its bytes")
    index_error: str | None = None
    g4_blocks: int = Field(0, description="leading prompt blocks on G4 (model-wide)")
    max_tokens: int = Field(0, description="the generation limit the request gave (0: none), which prices "
                            "how long it holds its KV (kv_wait_ms)")
    candidates: list[CandidateOut] = Field(default_factory=list)
    chosen: str | None = None
    attempts: list[str] = Field(default_factory=list)
    timings_ms: dict[str, float] = Field(default_factory=dict, description=(
        "milliseconds per stage: read (the request body); tokenize, hash, lookup, decide, total (routing); "
        "first_byte (the gateway's own time to the client's first byte, the worker's and the prefill "
        "gate's left out)"))
    predicted_cached_tokens: int = 0
    predicted_ttft_ms: float | None = None
    status: int | None = None
    outcome: str | None = None
    observed_ttft_ms: float | None = None
    gate_wait_ms: float = Field(0.0, description="time the request waited at the gateway's prefill gate before "
                                "it was sent (routing.prefill_gate): the worker was prefilling a step's worth "
                                "of the gateway's prompts, and shorter ones went first; part of the TTFT "
                                "(every attempt's, when one failed over)")
    prompt_tokens: int | None = None
    delivered_cached_tokens: int | None = Field(None, description="usage.prompt_tokens_details.cached_tokens")


class Explanation(DecisionOut):
    """What the gateway would do with a request; nothing was sent to any worker."""

    hashes: list[str] = Field(default_factory=list, description="block sequence hashes, decimal strings")
    hashes_hex: list[str] = Field(default_factory=list, description="the same hashes, 16 hex digits")


class DecisionList(BaseModel):
    count: int
    capacity: int
    decisions: list[DecisionOut]


# --- g4 -------------------------------------------------------------------------------------------------


class G4Stats(_Open):
    configured: bool
    path: str | None = None
    capacity_bytes: int | None = None
    namespaces: list[dict[str, Any]] = Field(default_factory=list)


class G4Maintenance(BaseModel):
    model: str
    blocks: int | None = Field(None, description="blocks recorded in the index (rebuild)")
    evicted: int | None = Field(None, description="blocks evicted and dropped from the index (gc)")
    capacity_bytes: int | None = None
