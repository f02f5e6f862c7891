"""kvgate's vLLM KV connector: saves full blocks to the G4 store and loads G4 blocks before prefill.

Loaded by vLLM with ``--kv-transfer-config '{"kv_connector":"KvgateConnector",
"kv_connector_module_path":"cache_tier.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute",
"kv_connector_extra_config":{"g4_path":"/mnt/g4"}}'`` (options: docs/g4.md).

vLLM instantiates the class twice: the SCHEDULER instance (engine-core process) decides what to load and
save (``cache_tier.connector_scheduler``); the WORKER instance (one per TP rank) moves the bytes
(``cache_tier.connector_worker``). This module keeps what both need and what vLLM imports by name: the
thin ``KvgateConnector`` that forwards each hook to its side, the metadata the two sides exchange, the
configuration and the store namespace. Each side is imported only in the process that runs it.

Blocks are keyed by kvgate's sequence hash (``indexer.hashing``), not vLLM's, so any worker of the model
and the gateway agree on a block's name without sharing vLLM's hash seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)


from cache_tier.store import Namespace

MEDIUM_STORAGE = "STORAGE"
# BlockRemoved events for G4 evictions carry kvgate sequence hashes (not engine hashes), marked by this.
G4_OWNERSHIP = "kvgate-g4"


# ---------------------------------------------------------------------------------------------------------
# metadata exchanged between the two roles
# ---------------------------------------------------------------------------------------------------------
@dataclass
class BlockOp:
    """One block to load or save: vLLM's block id, kvgate hash, parent hash and token ids. ``overwrite``: a
    save that replaces the block's file if there is one (a block a rank may have written from a step whose
    KV was wrong: connector_scheduler.py ``tainted``)."""

    block_id: int
    hash: int
    parent: int | None
    token_ids: list[int]
    overwrite: bool = False


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: dict[str, list[BlockOp]] = field(default_factory=dict)
    saves: dict[str, list[BlockOp]] = field(default_factory=dict)
    # the requests whose loads are reported through get_finished; the others' are done in start_load_kv
    async_reqs: set[str] = field(default_factory=set)


@dataclass
class KvgateWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: blocks written, saves dropped, blocks evicted by GC, the
    requests whose G4 load failed (the scheduler stops offering G4 to them, so a recompute after a failed
    first block does not load the same bad block again) and the blocks that failed to load (no longer
    offered to any request, announced as removed from G4)."""

    saved: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    # loads finished since the last report: blocks and their wall time (the scheduler's load rate)
    load_blocks: int = 0
    load_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvgateWorkerMeta):
            return KvgateWorkerMeta(
                self.saved + other.saved,
                self.dropped + other.dropped,
                self.evicted + other.evicted,
                self.failed_loads + other.failed_loads,
                self.lost + other.lost,
                self.load_blocks + other.load_blocks,
                self.load_seconds + other.load_seconds,
            )
        return self


# ---------------------------------------------------------------------------------------------------------
# configuration shared by both roles
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ConnectorConfig:
    g4_path: str
    model: str
    capacity_bytes: int | None = None
    save_decode_blocks: bool = True
    writer_queue_blocks: int = 4096
    writer_queue_bytes: int = 512 * 1024 * 1024
    read_threads: int = 4
    # True: every load in the background (its request waits a step); False: in the step (every request of
    # the step waits for it); "auto": in the step when the measured load rate says it takes at most
    # sync_load_max_s, else in the background (and in the background until a load was measured)
    load_async: bool | str = "auto"
    sync_load_max_s: float = 0.02
    read_bytes_per_s: float | None = None
    prefetch_host: str = "127.0.0.1"
    prefetch_port: int | None = None
    staging_bytes: int = 512 * 1024 * 1024
    max_prefetch_hashes: int = 8192
    stats_path: str | None = None
    kv_layout: str | None = None
    touch_on_read: bool = True
    fsync: bool = False

    @classmethod
    def from_vllm(cls, vllm_config) -> ConnectorConfig:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        path = extra.pop("g4_path", None) or os.environ.get("KVGATE_G4_PATH")
        if not path:
            raise ValueError("KvgateConnector needs kv_connector_extra_config.g4_path (or KVGATE_G4_PATH)")
        model = extra.pop("model", None) or _served_name(vllm_config)
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"KvgateConnector: unknown kv_connector_extra_config keys {sorted(unknown)}")
        cfg = cls(g4_path=path, model=model, **extra)
        if cfg.capacity_bytes is not None:
            cfg.capacity_bytes = int(cfg.capacity_bytes)
        if cfg.read_bytes_per_s is not None:
            cfg.read_bytes_per_s = float(cfg.read_bytes_per_s)
        auto = isinstance(cfg.load_async, str) and cfg.load_async.strip().lower() == "auto"
        cfg.load_async = "auto" if auto else _as_bool(cfg.load_async)
        cfg.sync_load_max_s = float(cfg.sync_load_max_s)
        return cfg


def _as_bool(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _served_name(vllm_config) -> str:
    mc = vllm_config.model_config
    name = getattr(mc, "served_model_name", None) or mc.model
    if isinstance(name, (list, tuple)):
        name = name[0]
    return str(name)


def namespace_for(
    vllm_config, kv_cache_config, cfg: ConnectorConfig, tp_rank: int
) -> tuple[Namespace, list[str]]:
    """The store namespace: identical in the scheduler and the workers (they derive it from the spec)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KvgateConnector supports one KV cache group, the model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    layers = list(groups[0].layer_names)
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    per_layer = spec.page_size_bytes // itemsize
    pc = vllm_config.parallel_config
    layout = cfg.kv_layout
    if layout is None:
        try:
            from vllm.platforms import current_platform

            device = current_platform.device_type
        except Exception:  # noqa: BLE001 - any platform probe failure: a generic tag
            device = "unknown"
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        layout = f"{device}:{backend or 'auto'}:{getattr(kv_cache_config, 'kv_cache_layout', None) or ''}"
    ns = Namespace(
        model=cfg.model,
        dtype=str(spec.dtype).removeprefix("torch."),
        block_size=spec.block_size,
        layer_shapes=tuple((per_layer,) for _ in layers),
        kv_layout=f"{layout}:h{spec.num_kv_heads}:d{spec.head_size}",
        tp_rank=tp_rank,
        tp_size=pc.tensor_parallel_size * pc.pipeline_parallel_size,
    )
    return ns, layers


# ---------------------------------------------------------------------------------------------------------
# the connector
# ---------------------------------------------------------------------------------------------------------
class KvgateConnector(KVConnectorBase_V1):
    """What vLLM loads: each hook goes to the side of this process's role."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        # imported here: connector_scheduler/connector_worker import this module's types
        if role == KVConnectorRole.SCHEDULER:
            from cache_tier.connector_scheduler import SchedulerSide

            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.cfg)
            self._worker = None
        else:
            from cache_tier.connector_worker import WorkerSide

            self._sched = None
            self._worker = WorkerSide(vllm_config, kv_cache_config, self.cfg)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output, self._kv_cache_manager)

    def update_connector_output(self, connector_output) -> None:
        self._sched.update_output(connector_output)

    def request_finished(self, request, block_ids):
        self._sched.finished(request.request_id)
        return False, None

    def take_events(self):
        return self._sched.take_events()

    def has_pending_push_work(self) -> bool:
        return self._sched.has_pending()

    def on_new_request(self, request) -> None:
        self._sched.track(request)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvgateMetadata) and meta.loads:
            background: dict[str, list[BlockOp]] = {}
            in_step: dict[str, list[BlockOp]] = {}
            for req_id, ops in meta.loads.items():
                (background if req_id in meta.async_reqs else in_step)[req_id] = ops
            if background:
                self._worker.load(background, True)
            if in_step:
                self._worker.load(in_step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # sync loads complete in start_load_kv; async ones before their request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # all layers are copied out at once in wait_for_save

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvgateMetadata):  # every step: it also closes the step's failed sync loads
            self._worker.save(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
