"""Gateway settings: a YAML file (``kvgate serve --config kvgate.yaml``) overlaid by environment variables.

Environment variables are prefixed ``KVGATE_`` and nest with ``__``, e.g. ``KVGATE_INDEX__BACKEND=redis``,
``KVGATE_INDEX__REDIS_URL=redis://redis:6379/0``, ``KVGATE_ADMIN__TOKEN=...``. Precedence: init kwargs >
environment > YAML file > defaults.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict,
                               YamlConfigSettingsSource)


class _Section(BaseModel):
    """A settings section: an unknown key is an error, not ignored (a typo such as ``routing: {polcy: ...}``
    was accepted and did nothing; the top level already refused them)."""

    model_config = ConfigDict(extra="forbid")


class WorkerConfig(_Section):
    """One vLLM server. The events endpoint is discovered from ``/kv_event_sources`` when not given."""

    url: str
    name: str | None = None
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    # The server's --max-num-batched-tokens when it differs from routing.max_num_batched_tokens.
    max_num_batched_tokens: int | None = Field(None, ge=16)
    # kvgate's connector endpoint on this worker (prefetch orders, G4 counters), e.g.
    # http://10.0.0.5:8201; None: the fleet default, g4.prefetch_port on the worker's host.
    prefetch_url: str | None = None
    # The shared G4 tier this worker mounts (docs/g4.md): None = the fleet's (g4.tier, the model-wide
    # G4 set); another name = a tier only the workers naming it mount; "" = none. Blocks it publishes
    # as shared (vLLM: locality REMOTE, or kvgate's connector) are credited to every worker of the model
    # naming the same tier; LOCAL ones to this worker only.
    g4_tier: str | None = None


class DiscoveryConfig(_Section):
    """Where workers come from: the static list below, or Kubernetes EndpointSlices by label."""

    kind: Literal["static", "kubernetes"] = "static"
    namespace: str | None = None
    label_selector: str = "app=vllm"
    port: int = 8000
    scheme: str = "http"
    events_annotation: str = "kvgate.io/events-endpoint"
    replay_annotation: str = "kvgate.io/replay-endpoint"
    # A pod's own prefetch URL (``http://*:8200``: ``*`` is the pod IP) and the shared G4 tier it mounts.
    prefetch_annotation: str = "kvgate.io/prefetch-url"
    g4_tier_annotation: str = "kvgate.io/g4-tier"


class IndexConfig(_Section):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvg"
    cluster: bool = False  # redis_url names one node of a Redis Cluster (every model's keys share a slot)
    timeout_s: float = 2.0  # every Redis call's socket timeout (event writes, admin reads)
    # The request path's lookup deadline: past it the request is routed load-aware, cache-blind.
    lookup_timeout_s: float = Field(0.05, gt=0)
    # Lookups failing in a row that open the circuit breaker (lookups in flight together that fail
    # together count once: router/index_guard.py), and how long it stays open (lookups then fail at once)
    # before one is let through to try again.
    breaker_failures: int = Field(3, ge=1)
    breaker_open_s: float = Field(1.0, gt=0)
    # Redis connections per gateway process (a bounded pool: a caller waits up to timeout_s for one).
    max_connections: int = Field(32, ge=1)
    # One gateway writes each worker's entries (a lease with fencing); the others follow its stream and
    # take over when the lease expires.
    lease_ttl_s: float = Field(10.0, gt=0)
    # Handles (vLLM blocks) one worker's state may reach before it is taken for corrupt (lost removals)
    # and rebuilt; and how long a worker's entries stay without any gateway writing for it.
    max_handles_per_worker: int = Field(2_000_000, ge=1)
    sweep_idle_s: float = Field(600.0, gt=0)


class ModelConfig(_Section):
    """Per-model settings: a local tokenizer (file or directory) or None to use a worker's /tokenize."""

    tokenizer: str | None = None
    block_size: int | None = None


class RoutingConfig(_Section):
    policy: Literal["kv", "round_robin", "least_loaded", "session"] = "kv"
    session_header: str = "x-session-id"
    # (the predictor's figures below are bounded and finite: nan or inf put every prediction at a clamp)
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, le=1e8, allow_inf_nan=False)
    # Attention makes a prompt token's prefill cost grow with its context: a token at context L costs
    # (1 + L / attention_knee_tokens) times one at context 0 (router/cost.py); 0 = linear in tokens.
    attention_knee_tokens: int = Field(16_384, ge=0)
    g4_bytes_per_s: float = Field(2e9, gt=0, allow_inf_nan=False)
    decisions_kept: int = 1000
    # Probe each worker when it registers (router/parity.py): a mismatch marks it cache-blind.
    parity_check: bool = True
    max_attempts: int = 3
    # Scheduler model (router/cost.py), priors until a worker's metrics calibrate them (router/calibrate.py):
    # an engine step costs step_ms plus per_decode_ms for each request decoding in it; a request pays
    # request_overhead_ms once (API server: tokenize, detokenize, HTTP); a step batches at most
    # max_num_batched_tokens prompt tokens (vLLM's --max-num-batched-tokens; WorkerConfig overrides it).
    step_ms: float = Field(10.0, gt=0, le=60_000, allow_inf_nan=False)
    per_decode_ms: float = Field(0.5, ge=0, le=60_000, allow_inf_nan=False)
    request_overhead_ms: float = Field(5.0, ge=0, le=3_600_000, allow_inf_nan=False)
    max_num_batched_tokens: int = Field(8192, ge=16)
    # A request vLLM reports waiting that the gateway did not send counts as this many prompt tokens (until
    # the worker's own mean is known).
    queued_request_tokens: int = 1024
    # EWMA weight of one observation in the fleet-wide prefill-speed calibration (router/cost.py).
    calibration_alpha: float = Field(0.2, gt=0, le=1, allow_inf_nan=False)
    # Price each worker at its own calibrated speed (the fleet's times its learnt ratio) instead of the
    # fleet's: for fleets of mixed hardware. Off by default: on identical workers the ratios drift apart
    # with each worker's request mix, and the one that looks fastest draws more than its share.
    per_worker_prefill_speed: bool = False
    # Correct the scheduler model's sum by a regression of the observed TTFTs of streamed responses on its
    # parts (compute, steps, queue, a fixed part; router/ttft_fit.py), within a factor of 4 either way.
    ttft_fit: bool = True
    # Bytes of KV per block on G4 (model dependent; the g4 part calibrates it).
    g4_bytes_per_block: int = 2 * 1024 * 1024
    prefetch_timeout_s: float = 0.5
    sessions_kept: int = 100_000
    # Blocks of a forwarded prompt count as the chosen worker's until its KV events reach the index
    # (router/pending.py); 0 turns it off.
    pending_ttl_s: float = 30.0
    # ... and this long after the prompt's first token (computed, so its events follow; router/pending.py)
    pending_settle_s: float = Field(2.0, ge=0)
    # kv policy: a worker holding the whole prompt counts its predicted TTFT up to this share lower
    # (router/policies/kv.py), so near ties stay where the conversation's prefix lives.
    cache_affinity: float = Field(0.1, ge=0.0, lt=1.0)
    # kv policy: a worker pays this many times the prefill time of the prompt tokens it would recompute
    # that another candidate holds (router/policies/kv.py); 0 prices only this request's TTFT.
    recompute_weight: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    # kv policy, hysteresis (router/policies/scorers.py): the conversation's holder (the longest local prefix,
    # when it holds at least overlap_share of the prompt) loses the request only to a worker better by
    # future_turns x the holder's prefix it would compute (the turns still to come) plus stay_margin x the
    # holder's predicted TTFT plus stay_margin_ms.
    # Defaults from the virtual-clock fleet (bench/policy_virtual.py, docs/BENCHMARKS.md): 3 and 0.3 raised
    # the hit rate on each of three trace slices and lowered the mean TTFT; 1 and 0.1 changed little.
    future_turns: float = Field(3.0, ge=0.0, le=100.0, allow_inf_nan=False)
    stay_margin: float = Field(0.3, ge=0.0, le=10.0, allow_inf_nan=False)
    stay_margin_ms: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # ... plus stay_margin_roomy x that TTFT when the holder's KV cache is roomy for the prompt: it holds
    # roomy_prompts prompts of its size or more (in proportion below), so its prefix outlives the turns to
    # come; a cache that holds only a few (capacity-bound) leaves the margin at stay_margin.
    stay_margin_roomy: float = Field(1.2, ge=0.0, le=10.0, allow_inf_nan=False)
    roomy_prompts: float = Field(8.0, gt=0.0, allow_inf_nan=False)
    # ... but to a worker with nothing queued ahead of the request, the margin is at most this share: the
    # conversation leaves a holder whose queue makes it several times slower than that idle worker.
    stay_margin_idle: float = Field(0.8, ge=0.0, le=10.0, allow_inf_nan=False)
    # ... and for the part of the holder's lead this worker would load from G4 instead of computing, this
    # share of the holder's predicted TTFT. Capacity-bound real vLLM with G4 (docs/BENCHMARKS.md, session
    # 26): 1.0 halved the G4 loads (to sglang-router's count) at an equal mean TTFT; 0 moved conversations
    # for any shorter queue and loaded their prefix again on the other worker.
    stay_margin_g4: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False)
    # kv policy: a share of the prompt below which a worker's cached prefix is not meaningful; when no
    # worker holds that much, the prompt goes where it evicts the least recently used cache: it pays
    # footprint_weight x its prefill time x how much more of the worker's free KV it and the queue take than
    # on the best worker (vLLM's kv_cache_usage_perc and num_gpu_blocks). Off by default: on the virtual-clock
    # fleet it lowered the hit rate and raised the mean TTFT (vLLM's usage counts running requests' blocks,
    # not the reusable cache, so it mostly follows load).
    overlap_share: float = Field(0.1, ge=0.0, le=1.0, allow_inf_nan=False)
    footprint_weight: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # kv policy: ms per request in flight beyond the least loaded candidate (0: the TTFT prices the queue).
    load_weight: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # kv policy: a candidate pays this many times its prefill time for each longer prompt held at its prefill
    # gate (the gate sends this one first: each of them waits that much longer); 0 prices this request alone.
    held_delay_weight: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    # Eviction model (router/cost.py): while vLLM's last scrape shows requests waiting, a candidate's cached
    # prefix that no request in flight holds is priced evicted before this request runs (its blocks sit in
    # the free queue, and the waiting prompts allocate first).
    waiting_evicts: bool = False
    # Occupancy (router/cost.py): the KV the requests in flight on the worker hold once scheduled (all are
    # ahead of this request) plus the part of this prompt's cached prefix no request holds, beyond the
    # worker's capacity, is priced evicted from the prefix's tail before it is scheduled.
    occupancy_evicts: bool = True
    # ... and the KV released after the prefix (behind it in vLLM's free queue) does not spare it.
    occupancy_age: bool = True
    # Load tracker (router/load.py): a request whose first new blocks vLLM's events show stored is running
    # (its KV taken, no longer demand on the room) at once; off: only from the waiting gauge at the next
    # scrape (every health_interval_s).
    admit_on_events: bool = True
    # The queue ahead leaves out what the worker has prefilled of the first request it was sent (router/cost.py:
    # since it was sent, or since the worker's last first token); off: the queue is priced whole.
    queue_progress: bool = True
    # Prefill admission (router/admission.py): a request waits at the gateway while the gateway's prompts its
    # worker is prefilling would, with it, pass prefill_gate_tokens uncached tokens (default: one step's
    # max_num_batched_tokens), and the shortest waiting prefill goes first; a worker prefilling none of them
    # takes the next at once.
    prefill_gate: bool = True
    prefill_gate_tokens: int | None = Field(None, ge=1)
    # ... and a request waits there at most this long (then it goes whatever the queue).
    prefill_gate_max_wait_s: float = Field(5.0, ge=0.0, le=600.0, allow_inf_nan=False)
    pending_max_blocks: int = 100_000
    # Texts of deferred prompts in flight kept beside their blocks (router/pending.py), in bytes; 0: none.
    pending_text_bytes: int = Field(16 << 20, ge=0)


class TokenizerConfig(_Section):
    """Local tokenization: new text longer than ``offload_chars`` is encoded in a thread pool off the
    event loop; tokenized texts are kept (bounded by bytes) so a prompt that extends one encodes only its
    new part (router/prefix_cache.py)."""

    offload_chars: int = 4096
    # Chat bodies larger than this are also rendered (chat template) off the event loop.
    offload_render_chars: int = 1_000_000
    threads: int = 2
    # Threads the tokenizers library uses for one batch (None: one less than the cores, so the event loop
    # keeps one); it reads RAYON_NUM_THREADS once, so an explicit RAYON_NUM_THREADS in the environment wins.
    batch_threads: int | None = Field(None, ge=1)
    # Nice increment of the tokenizer pool's threads (and the batch threads they start), so long prompts
    # being tokenized yield the CPU to request handling; 0 keeps the normal priority.
    pool_nice: int = Field(10, ge=0, le=19)
    # The prefix cache: bytes held (0 turns it off), anchor spacing and cut spacing (bytes of text).
    prefix_cache_bytes: int = Field(256 * 1024 * 1024, ge=0)
    prefix_chunk_bytes: int = Field(2048, ge=64)
    prefix_cut_bytes: int = Field(256, ge=16)
    # A text too short to hold a prefix-cache anchor (under ``prefix_chunk_bytes``: a small chat) skips the
    # prefix cache; its pieces between special tokens (a system prompt, role headers) are kept by their
    # exact text up to this many bytes (0 turns it off) and only the rest is encoded.
    segment_cache_bytes: int = Field(16 * 1024 * 1024, ge=0)
    # Every Nth request that reused cached ids is re-encoded whole off the loop to check (0: never).
    prefix_verify_every: int = Field(100, ge=0)
    # New prompt text longer than twice this is encoded in stages (this many bytes, then 4x more each) only
    # as far as the index shows some worker's or G4's prefix reaching; routing needs no ids past that, and
    # the prompt's length is estimated from the part encoded (0: always encode the whole prompt). 2 KB, not
    # 16 KB: in two simulator runs the gateway's tokenization wall time per request fell 28-35 -> 2-3 ms
    # (p50) and kv had more hits and a lower mean TTFT at 4 and 16 workers (docs/BENCHMARKS.md, session 11).
    defer_tail_bytes: int = Field(2048, ge=0)

    @model_validator(mode="after")
    def _chunk_multiple(self):
        if self.prefix_chunk_bytes % self.prefix_cut_bytes:
            raise ValueError("tokenizer.prefix_chunk_bytes must be a multiple of tokenizer.prefix_cut_bytes")
        return self


class ResponsesConfig(_Section):
    """The Responses API's response-id owners (indexer/index/owners.py), kept on the index's backend."""

    owner_ttl_s: float = Field(7 * 24 * 3600.0, gt=0)
    owner_max_entries: int = Field(1_000_000, ge=1)
    # A record also keeps the messages its turn adds to the conversation (a follow-up is tokenized from
    # its chain's turns); a larger turn keeps the owner only (the chain stays pinned, routed on load).
    turn_max_bytes: int = Field(1024 * 1024, ge=0)
    # ... and the turns kept take this much at most, all records together (their JSON); past it the least
    # recently used records keep their owner only.
    delta_max_bytes: int = Field(256 * 1024 * 1024, ge=0)
    # Longest chain walked to rebuild a follow-up's conversation (a longer one is routed on load, pinned).
    chain_max_depth: int = Field(1000, ge=1)
    # Largest streamed final event (response.completed) read for usage and the conversation.
    stream_event_max_bytes: int = Field(4 * 1024 * 1024, ge=1024)


class AdminConfig(_Section):
    token: str | None = None
    # Without a token the admin API answers loopback clients only, unless explicitly opened.
    open_without_token: bool = False


class G4Config(_Section):
    path: str | None = None
    capacity_bytes: int | None = None
    # The port of kvgate's connector endpoint on every worker (kv_connector_extra_config.prefetch_port):
    # prefetch orders go there, and the connector's measured G4 load bandwidth is read from it. A worker's
    # own prefetch_url (WorkerConfig, or the pod annotation) wins over it.
    prefetch_port: int | None = None
    prefetch_scheme: str = "http"
    # How often (at most) a worker's G4 load bandwidth is refreshed, piggybacked on prefetch orders.
    stats_interval_s: float = 10.0
    # The name of the shared tier a worker mounts unless its g4_tier says otherwise: its blocks are the
    # model-wide G4 set (kvgate's connector store and vLLM offloading tiers with locality REMOTE).
    tier: str = "shared"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid")

    host: str = "0.0.0.0"
    port: int = 8080
    log_level: str = "info"
    workers: list[WorkerConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    g4: G4Config = Field(default_factory=G4Config)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    # Bounds: a value outside passed validation and broke the fleet at run time (unhealthy_after 0: one
    # failed check dropped a live worker's entries; a zero timeout: no worker ever became healthy).
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1)
    # A request's whole body must arrive within this long (a 408 past it): neither uvicorn nor the reads
    # bound it, and a client trickling its body held the request and its connection for as long as it liked.
    body_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    request_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    connect_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    health_interval_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    # How often the event loop's lag is sampled into kvgate_event_loop_lag_seconds (0: not sampled).
    loop_lag_interval_s: float = Field(0.25, ge=0)
    health_timeout_s: float = Field(2.0, gt=0, allow_inf_nan=False)
    # Consecutive failed health checks before a worker leaves the candidate set.
    unhealthy_after: int = Field(2, ge=1)
    max_connections: int = Field(1000, ge=1)
    max_keepalive_connections: int = Field(200, ge=0)
    refresh_interval_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # A worker that leaves discovery (Kubernetes readiness) is out of routing at once but removed, with
    # its index entries, only after this long (0: at once).
    lost_grace_s: float = 60.0

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get("KVGATE_CONFIG")
        if not path:
            return (init_settings, env_settings)
        return (init_settings, env_settings, _yaml_source(settings_cls, Path(path)))


def _yaml_source(settings_cls: type[BaseSettings], path: Path) -> YamlConfigSettingsSource:
    """pydantic-settings' YAML source for the file named by ``KVGATE_CONFIG`` (``kvgate serve --config``),
    which, unlike the library's default, must exist and hold a mapping."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such configuration file")
    try:
        source = YamlConfigSettingsSource(settings_cls, yaml_file=path)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    except (TypeError, ValueError):  # a list or a scalar at the top
        raise ValueError(f"{path}: the configuration must be a mapping") from None
    if not isinstance(source.yaml_data, dict):
        raise ValueError(f"{path}: the configuration must be a mapping")
    return source


def load_settings(config_path: str | None = None, **overrides: Any) -> Settings:
    """Load settings from ``config_path`` (or ``$KVGATE_CONFIG``), the environment and ``overrides``."""
    if config_path:
        os.environ["KVGATE_CONFIG"] = str(config_path)
    return Settings(**overrides)
