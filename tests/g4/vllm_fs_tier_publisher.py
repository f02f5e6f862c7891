"""Run with vLLM's interpreter: KV events as vLLM's offloading connector with a file-system secondary tier
publishes them, produced by vLLM's own classes and sent by vLLM's own ``ZmqEventPublisher``.

That connector does not run on vLLM's CPU build, so this script drives the pieces that make its events:
a real ``Request`` with vLLM's block hasher (sha256_cbor), the GPU ``BlockPool`` (``cache_full_blocks``
emits BlockStored(medium=GPU), ``evict_blocks`` BlockRemoved), and the connector's
``OffloadingEventsTracker`` (vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py) turning
``OffloadingEvent(medium=STORAGE, locality=...)`` -- what ``FileSystemTierManager.get_finished_jobs``
appends for a finished store -- into self-describing BlockStored events (and placeholders when not
self-describing).

Usage: python vllm_fs_tier_publisher.py SPEC_JSON. SPEC: {"block_size": B, "workers": [{"port", "replay_port",
"locality": "REMOTE"|"LOCAL"|null, "requests": [{"tokens": [...], "cache_salt": str|null}],
"self_describing": bool, "evict_gpu": bool, "extra": [raw BlockStored kwargs]}]}. It prints "ready", then
for every line "go" on stdin publishes the next phase of every worker and prints "published <n>":
phase 0 the GPU blocks; phase 1 the STORAGE blocks (then the GPU evictions) and the extra events.
"""
from __future__ import annotations

import json
import sys
import time

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec, OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import (
    Locality, Medium, OffloadingEvent, OffloadingKVEventsConfig, make_offload_key,
)
from vllm.v1.request import Request

CHUNK_BLOCKS = 2  # blocks per offloaded chunk (kv_connector_extra_config "blocks_per_chunk")


class Worker:
    def __init__(self, spec: dict, block_size: int, n: int) -> None:
        self.spec = spec
        self.bs = block_size
        self.pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{spec['port']}",
                                     replay_endpoint=f"tcp://*:{spec['replay_port']}", topic="kv")
        self.pool = BlockPool(num_gpu_blocks=256, enable_caching=True, hash_block_size=block_size,
                              enable_kv_cache_events=True)
        self.tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=spec.get("self_describing", True)))
        self.group = GroupOffloadConfig(
            group_idx=0, tokens_per_block=block_size, tokens_per_chunk=block_size * CHUNK_BLOCKS,
            hashes_per_chunk=CHUNK_BLOCKS,
            kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
            sliding_window_size_in_chunks=None, kv_cache_spec=None, manager_cls=None)
        hasher = get_request_block_hasher(block_size, sha256_cbor)
        self.requests = [Request(f"r{n}-{i}", r["tokens"], SamplingParams(max_tokens=1), None,
                                 block_hasher=hasher, cache_salt=r.get("cache_salt"))
                         for i, r in enumerate(spec["requests"])]
        self.blocks: list = []

    def publish(self, events) -> None:
        if events:
            self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def gpu_phase(self) -> int:
        events = []
        for req in self.requests:
            full = len(req.all_token_ids) // self.bs
            blocks = self.pool.get_new_blocks(full)
            self.pool.cache_full_blocks(req, blocks, 0, full, self.bs, 0)  # what the scheduler does
            self.blocks.append(blocks)
            events += self.pool.take_events()
        self.publish(events)
        return len(events)

    def storage_phase(self) -> int:
        loc = self.spec.get("locality")
        locality = Locality(loc) if loc is not None else None
        keys = []
        for req in self.requests:
            chunks = len(req.block_hashes) // CHUNK_BLOCKS
            for c in range(chunks):  # the scheduler's _build_store_jobs: one OffloadKey per chunk
                key = make_offload_key(req.block_hashes[(c + 1) * CHUNK_BLOCKS - 1], 0)
                self.tracker.record_store(req, self.group, c, key)
                keys.append(key)
        # the fs tier's finished store job (FileSystemTierManager.get_finished_jobs)
        raw = [OffloadingEvent(keys=keys, medium=Medium.STORAGE, removed=False, locality=locality)]
        events = list(self.tracker.take_events(raw))
        if self.spec.get("evict_gpu"):  # the GPU copies go (BlockPool eviction): only G4 holds them now
            self.pool.evict_blocks({b.block_id for blocks in self.blocks for b in blocks})
            events += self.pool.take_events()
        events += [BlockStored(**kw) for kw in self.spec.get("extra", [])]
        self.publish(events)
        return len(events)


def main() -> None:
    spec = json.loads(sys.argv[1])
    init_none_hash(sha256_cbor)
    workers = [Worker(w, spec["block_size"], i) for i, w in enumerate(spec["workers"])]
    print("ready", flush=True)
    phases = [Worker.gpu_phase, Worker.storage_phase]
    for line in sys.stdin:
        if line.strip() != "go" or not phases:
            break
        phase = phases.pop(0)
        print("published", sum(phase(w) for w in workers), flush=True)
    time.sleep(0.5)
    for w in workers:
        w.pub.shutdown()


if __name__ == "__main__":
    main()
