"""The worker half of kvgate's connector (one per TP rank): moves KV bytes between vLLM's paged tensors
and the G4 store, serves prefetch orders and counters.

Loads run on bounded thread pools (``read_threads`` each: one for loads in the background, one for loads
in the step, so these never wait behind those). Asynchronous loads (the scheduler's choice per
request, ``load_async``) are reported through ``get_finished`` when every block of the request is in
place, so a long G4 read never stalls the step of the other requests; a block that fails to load is
reported through ``get_block_ids_with_load_errors`` no later than its request's completion, and vLLM
recomputes from it. Synchronous loads finish in ``start_load_kv`` before the forward pass. The blocks
loaded and their time go to the scheduler with each step's output: its load rate. Saves are copied out
of the paged KV to host memory after the forward pass (the blocks may be reused next step) and written
by one background thread; the writer's queue is bounded in blocks and bytes, and a save that does not
fit is dropped before it is copied, never waited for.

Bad G4 state never yields a wrong token: a block that is missing, truncated, corrupt, of another
namespace or unreadable is reported to vLLM (which recomputes it), counted by reason, removed when the
file is bad, and reported to the scheduler (which stops offering it and rewinds the request's saves so
the recomputed blocks are written again). In sync mode the blocks a request computes in the step of its
failed load attended to the unloaded block, so that step's saves of the request are dropped, on every
tensor-parallel rank: the ranks' partial results are summed every layer, so a block missing on one rank
makes that step's new KV of the request wrong on all of them (the ranks agree on the step's failures with
one small all-reduce). A pipeline stage after the failing one computes from its wrong hidden states and
saves; the scheduler's re-save of those blocks overwrites them. A write
that fails (full disk, unwritable or vanished directory) is a dropped save, counted by reason; the next
writes retry, so saves resume when the store is writable again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cache_tier.connector import BlockOp, ConnectorConfig, KvgateWorkerMeta, namespace_for
from cache_tier.kv_copy import block_dim, gather_blocks, scatter_block
from cache_tier.stager import Stager
from cache_tier.store import (
    LOAD_FAILURE_REASONS,
    SAVE_FAILURE_REASONS,
    BlockCorrupt,
    G4Error,
    G4Store,
    save_failure_reason,
)

logger = logging.getLogger("kvgate.g4")


@dataclass
class _LoadJob:
    """The loads of one step (sync) or of one request (async, ``req_id``), and how they ended."""

    req_id: str | None
    ops: list[BlockOp]
    left: int
    t0: float
    nbytes: int = 0
    errors: list[tuple[BlockOp, Exception]] = field(default_factory=list)
    failed_reqs: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[BlockOp]:
        return [op for op, _ in self.errors]

    def add(self, op: BlockOp, res) -> None:
        if isinstance(res, Exception):
            self.errors.append((op, res))
        else:
            self.nbytes += res


def step_group():
    """The process group of the ranks that run every step together (the tensor-parallel group, CPU side),
    when it has more than one rank; None otherwise. Every rank gets the same step metadata, so all of
    them reach the agreement on a step's failed loads, or none does."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        return g.cpu_group if g.world_size > 1 else None
    except Exception:  # noqa: BLE001 - no TP group (single process)
        return None


def parallel_rank() -> int:
    """This worker's rank among its engine's tensor- and pipeline-parallel workers (stage x TP size + TP
    rank, the namespace's ``tp_rank`` of ``tp_size`` = TP x PP): each holds its own slice of every block
    (TP) or its own layers (PP), so each has its own namespace. The TP rank alone is the same in every
    pipeline stage: two stages with as many layers shared one namespace (one loaded the other's layers,
    checksums valid) and each stage's rank 0 started the prefetch endpoint on the same port."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp = get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no TP group (single process): rank 0
        return 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_world_size

        return get_pp_group().rank_in_group * get_tensor_model_parallel_world_size() + tp
    except Exception:  # noqa: BLE001 - no pipeline group: one stage
        return tp


def data_parallel_rank(vllm_config) -> int:
    """This engine's data-parallel rank: vLLM's ``data_parallel_index``, which, unlike
    ``data_parallel_rank``, is not reset to 0 for a dense model's independent ranks (vLLM offsets its KV
    event ports by it)."""
    pc = getattr(vllm_config, "parallel_config", None)
    for attr in ("data_parallel_index", "data_parallel_rank"):
        rank = getattr(pc, attr, None)
        if isinstance(rank, int):
            return rank
    return 0


class WorkerSide:
    """Copies blocks between vLLM's paged KV tensors and the store; serves prefetch and stats."""

    def __init__(self, vllm_config, kv_cache_config, cfg: ConnectorConfig):
        self.cfg = cfg
        self.rank = rank = parallel_rank()
        self.ns, self.layer_names = namespace_for(vllm_config, kv_cache_config, cfg, tp_rank=rank)
        self.num_blocks = kv_cache_config.num_blocks
        self.lock = threading.Lock()
        self.saved: list[int] = []
        self.dropped: list[int] = []
        self.evicted: list[int] = []
        self.lost: list[int] = []  # hashes whose load failed: no longer offered from G4
        self.load_errors: set[int] = set()
        self.failed_loads: list[str] = []  # requests with a failed block, for the scheduler
        self.loaded_reqs: set[str] = set()  # async loads finished since the last get_finished
        self._failed_this_step: set[str] = set()  # sync loads that failed in this step: no saves
        self.group = step_group()  # the TP ranks that agree on a step's failed loads (None: one rank)
        self._reported = (0, 0.0)  # the load counters as of the last worker meta (blocks, seconds)
        self.counters = {
            "loads": 0,
            "load_failures": 0,
            "load_bytes": 0,
            "load_seconds": 0.0,
            "async_loads": 0,
            "loads_in_flight": 0,
            "prefetch_hits": 0,
            "saves_planned": 0,
            "saves_written": 0,
            "saves_dropped": 0,
            "save_copy_seconds": 0.0,
            "save_failures": 0,
            "agree_failures": 0,
        }
        self.load_failure_reasons = dict.fromkeys(LOAD_FAILURE_REASONS, 0)
        self.save_failure_reasons = dict.fromkeys(SAVE_FAILURE_REASONS, 0)
        self._warned: dict[str, float] = {}
        self.store = G4Store(
            cfg.g4_path,
            self.ns,
            capacity_bytes=cfg.capacity_bytes,
            on_evict=self._on_evict,
            touch_on_read=cfg.touch_on_read,
            fsync=cfg.fsync,
            read_bytes_per_s=cfg.read_bytes_per_s,
        )
        if self.store.init_error is not None:
            logger.warning(
                "kvgate G4: %s cannot be written (%s); loads go on, saves fail until it can",
                self.store.dir, self.store.init_error,
            )
        self.stager = Stager(self.store, cfg.staging_bytes, cfg.max_prefetch_hashes)
        self.kv: list[torch.Tensor] = []
        self.bdim = 0
        self._cuda = False
        self._tls = threading.local()
        self.pool = ThreadPoolExecutor(max(1, cfg.read_threads), thread_name_prefix="kvgate-g4-read")
        # in-step loads have their own readers: on the one pool they queued behind every background load
        # sent before them, and the forward pass waited for loads it had sent to the background
        self.step_pool = ThreadPoolExecutor(max(1, cfg.read_threads), thread_name_prefix="kvgate-g4-step")
        self.q: queue.Queue = queue.Queue()  # bounded by the reservation in save()
        self._queued_blocks = 0
        self._queued_bytes = 0
        self.writer = threading.Thread(target=self._write_loop, name="kvgate-g4-writer", daemon=True)
        self.writer.start()
        self.server = None
        if cfg.prefetch_port is not None and rank == 0:
            from cache_tier.prefetch_server import serve_in_thread

            # one endpoint per engine: a data-parallel server's engines share the host, and the second to
            # bind the one port failed to start; rank r serves on the port + r (the gateway's RankTarget
            # sends that rank's orders there), 0 (any free port) stays 0
            port = int(cfg.prefetch_port)
            self.server = serve_in_thread(self, cfg.prefetch_host,
                                          port + data_parallel_rank(vllm_config) if port else 0)
        self._stats_t = 0.0

    # -- registration --
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"KvgateConnector: KV tensors missing for layers {missing[:3]}")
        self.kv = [kv_caches[n] for n in self.layer_names]
        t = self.kv[0]
        self.bdim = block_dim(t, self.num_blocks)
        self._cuda = t.device.type == "cuda"
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
        if not self._cuda:
            return scatter_block(self.kv, self.bdim, op.block_id, raw)
        # on a GPU each reader thread copies on its own stream, off the forward pass's stream, and waits
        # for its copy: the block is in place when the read returns (the host buffer is reused next read)
        stream = getattr(self._tls, "stream", None)
        if stream is None:
            stream = self._tls.stream = torch.cuda.Stream(device=self.kv[0].device)
        with torch.cuda.stream(stream):
            n = scatter_block(self.kv, self.bdim, op.block_id, raw)
        stream.synchronize()
        return n

    def _safe_load(self, op: BlockOp):
        try:
            return self._load_one(op)
        except Exception as e:  # noqa: BLE001 - any failure: recompute, never use
            return e

    def load(self, loads: dict[str, list[BlockOp]], in_background: bool = False) -> None:
        """Start this step's loads: each request's blocks in the background, reported by
        :meth:`finished_loads` when all are in place; or (sync mode) all of them now, before returning."""
        if in_background:
            for req_id, ops in loads.items():
                job = _LoadJob(req_id, ops, left=len(ops), t0=time.perf_counter())
                with self.lock:
                    self.counters["loads_in_flight"] += 1
                if not ops:
                    self._settle(job)
                for op in ops:
                    self.pool.submit(self._load_in_job, job, op)
            return
        t0 = time.perf_counter()
        ops = [op for lst in loads.values() for op in lst]
        job = _LoadJob(None, ops, left=0, t0=t0)
        for op, res in zip(ops, self.step_pool.map(self._safe_load, ops)):
            job.add(op, res)
        bad = {id(op) for op in job.failed}
        failed = {r for r, lst in loads.items() if any(id(op) in bad for op in lst)}
        agreed = self._agree(sorted(loads), failed)
        job.failed_reqs = sorted(agreed)
        self._failed_this_step = agreed
        self._settle(job)

    def _agree(self, reqs: list[str], failed: set[str]) -> set[str]:
        """The step's requests whose in-step load failed on any tensor-parallel rank (their new KV is wrong
        on every rank). If the ranks cannot agree, no save of this step's loading requests is kept."""
        if self.group is None or not reqs:
            return failed
        flags = torch.tensor([r in failed for r in reqs], dtype=torch.int32)
        try:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
        except Exception as e:  # noqa: BLE001 - never keep a save that may be wrong
            self._warn_once("agree", "kvgate G4: the ranks could not agree on the step's failed loads (%s); "
                            "the step's saves of its loading requests are dropped", e)
            with self.lock:
                self.counters["agree_failures"] += 1
            return failed | set(reqs)
        return {r for r, f in zip(reqs, flags.tolist()) if f}

    def _load_in_job(self, job: _LoadJob, op: BlockOp) -> None:
        res = self._safe_load(op)
        with self.lock:
            job.add(op, res)
            job.left -= 1
            last = job.left == 0
        if last:
            if job.errors:
                job.failed_reqs = [job.req_id]
            self._settle(job)

    def _settle(self, job: _LoadJob) -> None:
        """Account a finished load; for an async one, publish its failed blocks no later than its request.

        vLLM requires an async request's failed block ids by the step that reports it finished
        (``get_block_ids_with_load_errors``), so both are published under one lock."""
        for op, err in job.errors:
            logger.warning("kvgate G4: load of block %016x failed (%s); vLLM recomputes it", op.hash, err)
            if isinstance(err, BlockCorrupt):  # never serve it again; a later save rewrites it
                self.store.remove([op.hash])
        with self.lock:
            c = self.counters
            c["loads"] += len(job.ops) - len(job.errors)
            c["load_bytes"] += job.nbytes
            c["load_seconds"] += time.perf_counter() - job.t0
            for op, err in job.errors:
                c["load_failures"] += 1
                self.load_failure_reasons[err.reason if isinstance(err, G4Error) else "error"] += 1
                self.load_errors.add(op.block_id)
                self.lost.append(op.hash)
            self.failed_loads.extend(job.failed_reqs)
            if job.req_id is not None:
                c["loads_in_flight"] -= 1
                c["async_loads"] += 1
                self.loaded_reqs.add(job.req_id)
        self._maybe_write_stats()

    def finished_loads(self) -> set[str]:
        """Requests whose async load is complete (blocks in place or reported failed) since the last call."""
        with self.lock:
            done, self.loaded_reqs = self.loaded_reqs, set()
        return done

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errs, self.load_errors = self.load_errors, set()
        return errs

    # -- saves --
    def save(self, saves: dict[str, list[BlockOp]]) -> None:
        """Copy the blocks out of the paged KV now (so vLLM may reuse them), write them in the background.

        The writer's queue is bounded by ``writer_queue_blocks`` and ``writer_queue_bytes``: room is
        reserved before the copy, and the saves that do not fit are dropped uncopied (counted, reported
        to the scheduler, retried only when a later request computes the same blocks). The engine never
        waits for the store. Called every step (``saves`` may be empty): it also ends the step's record
        of failed sync loads, whose requests' saves of this step are dropped."""
        failed, self._failed_this_step = self._failed_this_step, set()
        if failed:
            unsafe = [op for r, lst in saves.items() if r in failed for op in lst]
            if unsafe:
                with self.lock:
                    self.counters["saves_planned"] += len(unsafe)
                    self.counters["saves_dropped"] += len(unsafe)
                    self.dropped.extend(op.hash for op in unsafe)
            saves = {r: lst for r, lst in saves.items() if r not in failed}
        ops = [op for lst in saves.values() for op in lst]
        if not ops:
            return
        row = self.ns.payload_bytes
        with self.lock:
            room = min(
                self.cfg.writer_queue_blocks - self._queued_blocks,
                (self.cfg.writer_queue_bytes - self._queued_bytes) // row,
            )
            fit = max(0, min(len(ops), room))
            self._queued_blocks += fit
            self._queued_bytes += fit * row
            self.counters["saves_planned"] += len(ops)
            self.counters["saves_dropped"] += len(ops) - fit
            self.dropped.extend(op.hash for op in ops[fit:])
        if not fit:
            return
        kept = ops[:fit]
        t0 = time.perf_counter()
        host = gather_blocks(self.kv, self.bdim, [op.block_id for op in kept])  # [n, layers, elems] on host
        with self.lock:
            self.counters["save_copy_seconds"] += time.perf_counter() - t0
        for j, op in enumerate(kept):
            self.q.put((op, host[j]))

    def _write_loop(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            op, payload = item
            try:
                self.store.put(op.hash, op.token_ids, op.parent, payload, overwrite=op.overwrite)
                with self.lock:
                    self.saved.append(op.hash)
                    self.counters["saves_written"] += 1
            except Exception as e:  # noqa: BLE001 - a failed write is a dropped save, never fatal
                reason = save_failure_reason(e)
                self._warn_once(reason, "kvgate G4: write of block %016x failed (%s): %s", op.hash, reason, e)
                with self.lock:
                    self.dropped.append(op.hash)
                    self.counters["saves_dropped"] += 1
                    self.counters["save_failures"] += 1
                    self.save_failure_reasons[reason] += 1
            finally:
                with self.lock:
                    self._queued_blocks -= 1
                    self._queued_bytes -= self.ns.payload_bytes
            if self.q.empty():
                self._maybe_write_stats(force=True)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        """A warning per kind of failure per minute: a full disk fails every write."""
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= 60.0:
            self._warned[key] = now
            logger.warning(msg, *args)

    def _on_evict(self, hashes: list[int]) -> None:
        with self.lock:
            self.evicted.extend(hashes)

    def take_worker_meta(self) -> KvgateWorkerMeta | None:
        with self.lock:
            blocks = self.counters["loads"] - self._reported[0]
            seconds = self.counters["load_seconds"] - self._reported[1]
            if not (self.saved or self.dropped or self.evicted or self.failed_loads or self.lost or blocks):
                return None
            m = KvgateWorkerMeta(self.saved, self.dropped, self.evicted, self.failed_loads, self.lost,
                                 blocks, seconds)
            self.saved, self.dropped, self.evicted, self.failed_loads, self.lost = [], [], [], [], []
            self._reported = (self.counters["loads"], self.counters["load_seconds"])
        self._maybe_write_stats()
        return m

    # -- stats --
    def stats(self) -> dict:
        with self.lock:
            c = dict(self.counters)
            c["load_failures_by_reason"] = dict(self.load_failure_reasons)
            c["save_failures_by_reason"] = dict(self.save_failure_reasons)
        c["load_bytes_per_s"] = c["load_bytes"] / c["load_seconds"] if c["load_seconds"] else 0.0
        c["writer_queue"] = self.q.qsize()
        c["writer_queue_bytes"] = self._queued_bytes
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
        self.q.put(None)
        self.writer.join(timeout=10.0)
        if self.writer.is_alive():
            logger.warning("kvgate G4: writer still busy at shutdown; pending saves are dropped")
        self._maybe_write_stats(force=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.step_pool.shutdown(wait=False, cancel_futures=True)
        self.stager.close()
        if self.server is not None:
            from cache_tier.prefetch_server import stop

            stop(self.server)
