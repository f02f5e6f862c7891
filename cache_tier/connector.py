"""kvgate's vLLM KV connector: saves full blocks to the G4 store and loads G4 blocks before prefill.

Loaded by vLLM with ``--kv-transfer-config '{"kv_connector":"KvgateConnector",
"kv_connector_module_path":"cache_tier.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute",
"kv_connector_extra_config":{"g4_path":"/mnt/g4"}}'`` (options: docs/g4.md).

Two instances run: the SCHEDULER one (engine-core process) decides, per request, how many blocks beyond
the local prefix hit are on G4 (consecutive, never the last prompt token) and which newly full blocks to
save; the WORKER one (one per TP rank) copies loaded blocks into vLLM's paged KV tensors before the
forward pass and copies saved blocks out to host memory after it, handing them to a bounded background
writer. The worker reports what it wrote (and what the store's GC evicted) back through the connector
worker metadata; the scheduler then announces the blocks as ``BlockStored(medium="STORAGE")`` through
``take_events`` so the gateway's event pipeline records them as G4.

Blocks are keyed by kvgate's sequence hash (``indexer.hashing``), not vLLM's, so any worker of the model
and the gateway agree on a block's name without sharing vLLM's hash seed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from cache_tier.kv_copy import block_dim, gather_blocks, scatter_block
from cache_tier.stager import Stager
from cache_tier.store import BlockCorrupt, G4Store, Namespace, PresenceCache
from indexer import hashing

try:  # vLLM >= 0.11
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
except ImportError:  # pragma: no cover
    BlockStored = BlockRemoved = None  # type: ignore[assignment]

logger = logging.getLogger("kvgate.g4")

MEDIUM_STORAGE = "STORAGE"
# BlockRemoved events for G4 evictions carry kvgate sequence hashes (not engine hashes), marked by this.
G4_OWNERSHIP = "kvgate-g4"
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------------------
# metadata exchanged between the two roles
# ---------------------------------------------------------------------------------------------------------
@dataclass
class BlockOp:
    """One block to load or save: vLLM's block id, kvgate hash, parent hash and token ids."""

    block_id: int
    hash: int
    parent: int | None
    token_ids: list[int]


@dataclass
class KvgateMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: dict[str, list[BlockOp]] = field(default_factory=dict)
    saves: dict[str, list[BlockOp]] = field(default_factory=dict)


@dataclass
class KvgateWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: blocks written, saves dropped, blocks evicted by GC."""

    saved: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvgateWorkerMeta):
            return KvgateWorkerMeta(
                self.saved + other.saved, self.dropped + other.dropped, self.evicted + other.evicted
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
        return cfg


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
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = ConnectorConfig.from_vllm(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._sched: _SchedulerSide | None = _SchedulerSide(vllm_config, kv_cache_config, self.cfg)
            self._worker: _WorkerSide | None = None
        else:
            self._sched = None
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self.cfg)

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
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # all layers are copied out at once in wait_for_save

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvgateMetadata) and meta.saves:
            self._worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()


# ---------------------------------------------------------------------------------------------------------
# scheduler side
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _ReqState:
    request: Any
    hashes: list[int] = field(default_factory=list)  # kvgate sequence hashes of full blocks seen so far
    saved_upto: int = 0  # blocks [0, saved_upto) are known to be on G4 or planned for saving
    plan: tuple[int, int] = (0, 0)  # (first block, count) of the last G4 match
    eligible: bool = True  # False: the KV depends on more than the token ids (multimodal, embeddings)


def _eligible(request) -> bool:
    """Token ids name a block's KV only without multimodal inputs or prompt embeddings."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


class _SchedulerSide:
    """Decides loads and saves; turns the workers' confirmations into STORAGE events."""

    PENDING_TIMEOUT_S = 60.0

    def __init__(self, vllm_config, kv_cache_config, cfg: ConnectorConfig):
        self.cfg = cfg
        self.ns, _ = namespace_for(vllm_config, kv_cache_config, cfg, tp_rank=0)
        self.block_size = self.ns.block_size
        self.store = G4Store(cfg.g4_path, self.ns, scan=False)
        self.present = PresenceCache(self.store)
        pc = vllm_config.parallel_config
        self.world = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
        self.reqs: dict[str, _ReqState] = {}
        self.loads: dict[str, list[BlockOp]] = {}
        # kvgate hash -> [engine hash, engine parent, token ids, confirmations, deadline, lora name, extra keys]
        self.pending: dict[int, list] = {}
        self.events: list = []
        self.lock = threading.Lock()
        self.matched_tokens = 0

    # -- request tracking --
    def track(self, request) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request, eligible=_eligible(request))
            self.reqs[request.request_id] = st
        return st

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
        self.loads.pop(req_id, None)

    def _hashes(self, st: _ReqState, n_blocks: int) -> list[int]:
        """kvgate sequence hashes of the request's first ``n_blocks`` full blocks (computed incrementally)."""
        have = len(st.hashes)
        if n_blocks > have:
            req = st.request
            toks = req.all_token_ids
            B = self.block_size
            lora = req.lora_request.lora_name if getattr(req, "lora_request", None) else None
            salt = getattr(req, "cache_salt", None)
            seg = toks[have * B : n_blocks * B]
            if have == 0:
                local = hashing.local_hashes(seg, B, lora, salt)
            else:
                local = hashing.local_hashes(seg, B, lora)
            st.hashes.extend(hashing.chain(local, st.hashes[-1] if have else None))
        return st.hashes[:n_blocks]

    # -- loads --
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        st = self.track(request)
        B = self.block_size
        i0 = num_computed_tokens // B
        limit = max(0, (request.num_tokens - 1) // B)  # never the last prompt token
        if i0 >= limit or not st.eligible:
            st.plan = (i0, 0)
            return 0, False
        hs = self._hashes(st, limit)
        n = 0
        for h in hs[i0:limit]:
            if not self.present.contains(h):
                break
            n += 1
        st.plan = (i0, n)
        return n * B, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self.track(request)
        if num_external_tokens <= 0:
            return
        B = self.block_size
        i0, n = st.plan
        n = min(n, num_external_tokens // B)
        block_ids = blocks.get_block_ids()[0]
        toks = request.all_token_ids
        ops = []
        for i in range(i0, i0 + n):
            ops.append(
                BlockOp(
                    block_ids[i],
                    st.hashes[i],
                    st.hashes[i - 1] if i else None,
                    list(toks[i * B : (i + 1) * B]),
                )
            )
        self.loads[request.request_id] = ops
        # loaded blocks are on G4 already: never save them again
        st.saved_upto = max(st.saved_upto, i0 + n)
        self.matched_tokens += n * B

    # -- per step --
    def build_meta(self, so, kv_cache_manager) -> KvgateMetadata:
        meta = KvgateMetadata(loads=self.loads)
        self.loads = {}
        B = self.block_size
        items: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        items += list(zip(cached.req_ids, cached.num_computed_tokens))
        now = time.monotonic()
        for req_id, computed in items:
            st = self.reqs.get(req_id)
            if st is None or kv_cache_manager is None or not st.eligible:
                continue
            req = st.request
            full = (computed + so.num_scheduled_tokens.get(req_id, 0)) // B
            known = len(req.all_token_ids) // B
            if not self.cfg.save_decode_blocks:
                known = min(known, req.num_prompt_tokens // B)
            upto = min(full, known)
            if upto <= st.saved_upto:
                continue
            hs = self._hashes(st, upto)
            block_ids = kv_cache_manager.get_block_ids(req_id)[0]
            engine = getattr(req, "block_hashes", None) or []
            toks = req.all_token_ids
            lora = req.lora_request.lora_name if getattr(req, "lora_request", None) else None
            salt = getattr(req, "cache_salt", None)
            ops = []
            for i in range(st.saved_upto, min(upto, len(block_ids))):
                h = hs[i]
                if h in self.pending or self.present.contains(h):
                    continue
                tk = list(toks[i * B : (i + 1) * B])
                ops.append(BlockOp(block_ids[i], h, hs[i - 1] if i else None, tk))
                eh = _engine_hash(engine[i]) if i < len(engine) else h
                ep = (_engine_hash(engine[i - 1]) if i - 1 < len(engine) else hs[i - 1]) if i else None
                # what the ingestion needs to re-derive kvgate's hash: the LoRA name, and block 0's salt
                extra = [[x for x in (lora, salt) if x]] if i == 0 and salt else None
                self.pending[h] = [eh, ep, tk, 0, now + self.PENDING_TIMEOUT_S, lora, extra]
            st.saved_upto = upto
            if ops:
                meta.saves[req_id] = ops
        self._expire(now)
        return meta

    def _expire(self, now: float) -> None:
        if not self.pending:
            return
        stale = [h for h, p in self.pending.items() if p[4] < now]
        for h in stale:
            del self.pending[h]

    def update_output(self, out) -> None:
        wm = getattr(out, "kv_connector_worker_meta", None)
        if not isinstance(wm, KvgateWorkerMeta):
            return
        stored = []
        for h in wm.saved:
            p = self.pending.get(h)
            if p is None:
                continue
            p[3] += 1
            if p[3] >= self.world:
                del self.pending[h]
                stored.append(p)
                self.present.add(h)
        for h in wm.dropped:
            self.pending.pop(h, None)
        for h in wm.evicted:
            self.present.discard(h)
        if BlockStored is None:
            return
        for eh, ep, tk, _, _, lora, extra in stored:
            self.events.append(
                BlockStored(
                    block_hashes=[eh],
                    parent_block_hash=ep,
                    token_ids=tk,
                    block_size=self.block_size,
                    lora_id=None,
                    medium=MEDIUM_STORAGE,
                    lora_name=lora,
                    extra_keys=extra,
                )
            )
        if wm.evicted:
            self.events.append(
                BlockRemoved(
                    block_hashes=sorted(set(wm.evicted)), medium=MEDIUM_STORAGE, ownership=G4_OWNERSHIP
                )
            )

    def take_events(self):
        ev, self.events = self.events, []
        return ev

    def has_pending(self) -> bool:
        if self.pending:
            self._expire(time.monotonic())
        return bool(self.pending)


def _engine_hash(h) -> int:
    if isinstance(h, int):
        return h & _MASK64
    return int.from_bytes(bytes(h), "big") & _MASK64


# ---------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------
class _WorkerSide:
    """Copies blocks between vLLM's paged KV tensors and the store; serves prefetch and stats."""

    def __init__(self, vllm_config, kv_cache_config, cfg: ConnectorConfig):
        self.cfg = cfg
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
            rank = 0
        self.rank = rank
        self.ns, self.layer_names = namespace_for(vllm_config, kv_cache_config, cfg, tp_rank=rank)
        self.num_blocks = kv_cache_config.num_blocks
        self.lock = threading.Lock()
        self.saved: list[int] = []
        self.dropped: list[int] = []
        self.evicted: list[int] = []
        self.load_errors: set[int] = set()
        self.counters = {
            "loads": 0,
            "load_failures": 0,
            "load_bytes": 0,
            "load_seconds": 0.0,
            "prefetch_hits": 0,
            "saves_planned": 0,
            "saves_written": 0,
            "saves_dropped": 0,
            "save_copy_seconds": 0.0,
            "corruptions": 0,
            "missing": 0,
        }
        self.store = G4Store(
            cfg.g4_path,
            self.ns,
            capacity_bytes=cfg.capacity_bytes,
            on_evict=self._on_evict,
            touch_on_read=cfg.touch_on_read,
            fsync=cfg.fsync,
        )
        self.stager = Stager(self.store, cfg.staging_bytes, cfg.max_prefetch_hashes)
        self.kv: list[torch.Tensor] = []
        self.bdim = 0
        self.pool = ThreadPoolExecutor(max(1, cfg.read_threads), thread_name_prefix="kvgate-g4-read")
        self.q: queue.Queue = queue.Queue(maxsize=max(1, cfg.writer_queue_blocks))
        self._queued_bytes = 0
        self.writer = threading.Thread(target=self._write_loop, name="kvgate-g4-writer", daemon=True)
        self.writer.start()
        self.server = None
        if cfg.prefetch_port is not None and rank == 0:
            from cache_tier.prefetch_server import serve_in_thread

            self.server = serve_in_thread(self, cfg.prefetch_host, int(cfg.prefetch_port))
        self._stats_t = 0.0

    # -- registration --
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KvgateConnector: KV tensors missing for layers {missing[:3]}")
        self.kv = [kv_caches[n] for n in self.layer_names]
        t = self.kv[0]
        self.bdim = block_dim(t, self.num_blocks)
        per_block = t.select(self.bdim, 0).numel()
        want = self.ns.layer_shapes[0][0]
        if per_block != want:
            raise ValueError(
                f"KvgateConnector: a block holds {per_block} elements per layer, spec says {want}"
            )
        logger.info(
            "kvgate G4: %d layers, KV %s (block dim %d) on %s, store %s",
            len(self.kv),
            tuple(t.shape),
            self.bdim,
            t.device,
            self.store.dir,
        )

    # -- loads --
    def _load_one(self, op: BlockOp) -> int:
        """Copy one block into the paged KV; returns bytes loaded (raises G4Error on failure)."""
        staged = self.stager.take(op.hash, op.token_ids)
        if staged is not None:
            raw = staged
            with self.lock:
                self.counters["prefetch_hits"] += 1
        else:
            raw = self.store.read(op.hash, op.token_ids)
        return scatter_block(self.kv, self.bdim, op.block_id, raw)

    def load(self, loads: dict[str, list[BlockOp]]) -> None:
        t0 = time.perf_counter()
        ops = [op for lst in loads.values() for op in lst]
        nbytes = 0
        errors = []
        for op, res in zip(ops, self.pool.map(self._safe_load, ops)):
            if isinstance(res, Exception):
                errors.append((op, res))
            else:
                nbytes += res
        dt = time.perf_counter() - t0
        with self.lock:
            self.counters["loads"] += len(ops) - len(errors)
            self.counters["load_bytes"] += nbytes
            self.counters["load_seconds"] += dt
            for op, err in errors:
                self.counters["load_failures"] += 1
                self.counters["corruptions" if isinstance(err, BlockCorrupt) else "missing"] += 1
                self.load_errors.add(op.block_id)
        for op, err in errors:
            logger.warning("kvgate G4: load of block %016x failed (%s); vLLM recomputes it", op.hash, err)
            if isinstance(err, BlockCorrupt):  # never serve it again; a later save rewrites it
                self.store.remove([op.hash])
        self._maybe_write_stats()

    def _safe_load(self, op: BlockOp):
        try:
            return self._load_one(op)
        except Exception as e:  # noqa: BLE001 - any failure: recompute, never use
            return e

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errs, self.load_errors = self.load_errors, set()
        return errs

    # -- saves --
    def save(self, saves: dict[str, list[BlockOp]]) -> None:
        """Copy the blocks out of the paged KV now (so vLLM may reuse them), write them in the background."""
        ops = [op for lst in saves.values() for op in lst]
        if not ops:
            return
        t0 = time.perf_counter()
        host = gather_blocks(self.kv, self.bdim, [op.block_id for op in ops])  # [n, layers, elems] on host
        with self.lock:
            self.counters["saves_planned"] += len(ops)
            self.counters["save_copy_seconds"] += time.perf_counter() - t0
        row = host[0].numel() * host.element_size()
        for j, op in enumerate(ops):
            with self.lock:
                fits = self._queued_bytes + row <= self.cfg.writer_queue_bytes
                if fits:
                    self._queued_bytes += row
            try:
                if not fits:
                    raise queue.Full
                self.q.put_nowait((op, host[j]))
            except queue.Full:  # the store is slower than the engine: drop the save, never stall
                with self.lock:
                    if fits:
                        self._queued_bytes -= row
                    self.dropped.append(op.hash)
                    self.counters["saves_dropped"] += 1

    def _write_loop(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            op, payload = item
            with self.lock:
                self._queued_bytes -= payload.numel() * payload.element_size()
            try:
                self.store.put(op.hash, op.token_ids, op.parent, payload)
                with self.lock:
                    self.saved.append(op.hash)
                    self.counters["saves_written"] += 1
                if self.q.empty():
                    self._maybe_write_stats(force=True)
            except Exception as e:  # noqa: BLE001 - a failed write is a dropped save, never fatal
                logger.warning("kvgate G4: write of block %016x failed: %s", op.hash, e)
                with self.lock:
                    self.dropped.append(op.hash)
                    self.counters["saves_dropped"] += 1

    def _on_evict(self, hashes: list[int]) -> None:
        with self.lock:
            self.evicted.extend(hashes)

    def take_worker_meta(self) -> KvgateWorkerMeta | None:
        with self.lock:
            if not (self.saved or self.dropped or self.evicted):
                return None
            m = KvgateWorkerMeta(self.saved, self.dropped, self.evicted)
            self.saved, self.dropped, self.evicted = [], [], []
        self._maybe_write_stats()
        return m

    # -- stats --
    def stats(self) -> dict:
        with self.lock:
            c = dict(self.counters)
        c["load_bytes_per_s"] = c["load_bytes"] / c["load_seconds"] if c["load_seconds"] else 0.0
        c["writer_queue"] = self.q.qsize()
        c["staging"] = self.stager.stats()
        c["store"] = self.store.snapshot()
        c["block_bytes"] = self.store.file_bytes
        c["model"] = self.cfg.model
        c["rank"] = self.rank
        return c

    def _maybe_write_stats(self, force: bool = False) -> None:
        if not self.cfg.stats_path:
            return
        now = time.monotonic()
        if not force and now - self._stats_t < 0.2:
            return
        self._stats_t = now
        import json

        p = self.cfg.stats_path
        tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.stats(), f)
            os.replace(tmp, p)
        except OSError:
            pass

    def shutdown(self) -> None:
        try:
            self.q.put(None, timeout=1.0)
        except queue.Full:
            logger.warning("kvgate G4: writer queue full at shutdown; pending saves are dropped")
        self.writer.join(timeout=10.0)
        self._maybe_write_stats(force=True)
        self.pool.shutdown(wait=False)
        if self.server is not None:
            self.server.shutdown()
