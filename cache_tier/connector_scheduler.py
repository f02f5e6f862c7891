"""The scheduler half of kvgate's connector (engine-core process): which G4 blocks to load, which to save.

It never touches KV bytes. Per request it computes kvgate's sequence hashes incrementally, answers
``get_num_new_matched_tokens`` with the consecutive G4 blocks after the local prefix hit (a long load
asynchronous, so vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` and keeps stepping the others; a
short one in the step, by the workers' measured load rate: ``load_async``),
plans loads into the blocks vLLM allocated and saves of blocks that become full, and turns the workers'
confirmations (``KvgateWorkerMeta``) into ``BlockStored/BlockRemoved(medium="STORAGE")`` events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cache_tier.connector import (
    G4_OWNERSHIP,
    MEDIUM_STORAGE,
    BlockOp,
    ConnectorConfig,
    KvgateMetadata,
    KvgateWorkerMeta,
    namespace_for,
)
from cache_tier.load_rate import LoadRate
from cache_tier.store import G4Store, PresenceCache
from indexer import hashing

try:  # vLLM >= 0.11
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
except ImportError:  # pragma: no cover
    BlockStored = BlockRemoved = None  # type: ignore[assignment]

_MASK64 = (1 << 64) - 1


@dataclass
class _ReqState:
    request: Any
    hashes: list[int] = field(default_factory=list)  # kvgate sequence hashes of full blocks seen so far
    saved_upto: int = 0  # blocks [0, saved_upto) are known to be on G4 or planned for saving
    plan: tuple[int, int] = (0, 0)  # (first block, count) of the last G4 match
    load_async: bool = False  # how that match is loaded (reported through get_finished, or in the step)
    eligible: bool = True  # False: the KV depends on more than the token ids (multimodal, embeddings)
    load_failed: bool = False  # a G4 load of this request failed: recompute, never offer G4 again


def _eligible(request) -> bool:
    """Token ids name a block's KV only without multimodal inputs or prompt embeddings."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


class SchedulerSide:
    """Decides loads and saves; turns the workers' confirmations into STORAGE events."""

    PENDING_TIMEOUT_S = 60.0
    TAINTED_MAX = 1 << 16

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
        self.async_reqs: set[str] = set()  # of this step's loads, the ones in the background
        # blocks a rank may have written wrong: computed in a step whose in-step load failed (on another
        # pipeline stage the hidden states were wrong, and its save went on). Their next save replaces
        # the file (a save never replaces a file otherwise, so the wrong copy would stay for good).
        self.tainted: dict[int, None] = {}  # insertion-ordered, the oldest dropped past TAINTED_MAX
        self.load_rate = LoadRate()  # the workers' finished loads, recent ones weighing most

    # -- request tracking --
    def track(self, request) -> _ReqState:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request, eligible=_eligible(request))
            self.reqs[request.request_id] = st
        return st

    def finished(self, req_id: str) -> None:
        # self.loads keeps its entry: an async load's blocks stay allocated until the worker reports it
        self.reqs.pop(req_id, None)

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
        if i0 >= limit or not st.eligible or st.load_failed:
            st.plan = (i0, 0)
            return 0, False
        hs = self._hashes(st, limit)
        n = 0
        for h in hs[i0:limit]:
            if not self.present.contains(h):
                break
            n += 1
        st.plan = (i0, n)
        st.load_async = n > 0 and self.in_background(n)
        return n * B, st.load_async

    def in_background(self, n_blocks: int) -> bool:
        """Whether a load of ``n_blocks`` runs in the background (``load_async``). In the background the
        request waits for the end of a step after the load, up to a whole step; in the step every
        request of the step waits for the load. ``auto`` takes the step when the workers' measured rate
        says the load is short (``sync_load_max_s``), the background while no load was measured."""
        mode = self.cfg.load_async
        if mode != "auto":
            return bool(mode)
        expected = self.load_rate.seconds_for(n_blocks)
        return expected is None or expected > self.cfg.sync_load_max_s

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
        if st.load_async:
            self.async_reqs.add(request.request_id)
        # loaded blocks are on G4 already: never save them again
        st.saved_upto = max(st.saved_upto, i0 + n)

    # -- per step --
    def build_meta(self, so, kv_cache_manager) -> KvgateMetadata:
        meta = KvgateMetadata(loads=self.loads, async_reqs=self.async_reqs)
        self.loads, self.async_reqs = {}, set()
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
                ops.append(BlockOp(block_ids[i], h, hs[i - 1] if i else None, tk, h in self.tainted))
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
        self.load_rate.observe(wm.load_blocks, wm.load_seconds)
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
                self.tainted.pop(h, None)
        for h in wm.dropped:
            self.pending.pop(h, None)
        for h in wm.evicted:
            self.present.discard(h)
        for h in wm.lost:
            self.present.discard(h)
        lost = set(wm.lost)
        for req_id in wm.failed_loads:
            st = self.reqs.get(req_id)
            if st is not None:
                st.load_failed = True
                # vLLM recomputes from the first failed block: save the recomputed blocks again
                bad = [i for i, h in enumerate(st.hashes) if h in lost]
                if bad:
                    self._taint(st.hashes[bad[0]:st.saved_upto])
                    st.saved_upto = min(st.saved_upto, bad[0])
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
        gone = set(wm.evicted) | lost
        if gone:
            self.events.append(
                BlockRemoved(block_hashes=sorted(gone), medium=MEDIUM_STORAGE, ownership=G4_OWNERSHIP)
            )

    def _taint(self, hashes: list[int]) -> None:
        """Blocks from a request's first failed load on: the step of the failure computed them from a
        block that was not there, so a rank that saved them saved wrong KV."""
        for h in hashes:
            self.tainted.pop(h, None)
            self.tainted[h] = None
        while len(self.tainted) > self.TAINTED_MAX:
            del self.tainted[next(iter(self.tainted))]

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


