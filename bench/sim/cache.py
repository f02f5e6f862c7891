"""A prefix cache with vLLM's block-pool semantics (v1/core/block_pool.py), emitting vLLM's KV events.

- Only full blocks are hashed; a block's hash chains its parent's digest (opaque uint64 handles in events:
  the low 64 bits of a sha256 digest over (parent digest, token ids[, cache salt on block 0])).
- A lookup hits at most ``(num_tokens - 1) // block_size`` blocks: the last prompt token is always computed.
- Freed blocks keep their hashes and stay hittable in an LRU free queue; a request's blocks are freed tail
  first, so its tail is evicted first. Taking a hashed free block evicts it: one ``BlockRemoved`` per block,
  queued in the same batch just before the ``BlockStored`` that needed the room.
- No de-duplication: re-caching a hash that is already cached stores (and announces) a second copy.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from bench.sim.events import BlockRemoved, BlockStored

MEDIUM_GPU = "GPU"
MEDIUM_STORAGE = "STORAGE"
_MASK = (1 << 64) - 1


def none_hash(seed: str = "vllm-none-hash") -> bytes:
    return hashlib.sha256(seed.encode()).digest()


def block_digests(tokens: Sequence[int] | np.ndarray, block_size: int, root: bytes,
                  cache_salt: str | None = None) -> list[bytes]:
    """Chained sha256 digests of the full blocks of ``tokens`` (anything sliceable), the first chained to
    ``root`` (the chain's root, or the digest of the block before them) and salted with ``cache_salt``."""
    total = len(tokens) // block_size
    raw = np.asarray(tokens[: total * block_size], dtype="<u4").tobytes()
    step = 4 * block_size
    prev = root
    out = []
    for i in range(total):
        h = hashlib.sha256(prev)
        h.update(raw[i * step:(i + 1) * step])
        if i == 0 and cache_salt:
            h.update(b"\x00salt\x00" + cache_salt.encode())
        prev = h.digest()
        out.append(prev)
    return out


def external(digest: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash``: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def _stored(hashes: list[int], parent: int | None, tokens, block_size: int, medium: str,
            salt: str | None) -> BlockStored:
    """A BlockStored as vLLM 0.32 fills it for a dense model: per-block extra keys (the cache salt on
    block 0 only, else nil), group 0, spec kind full_attention."""
    extra: list = [None] * len(hashes)
    if salt is not None and extra:
        extra[0] = (salt,)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=_ints(tokens),
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None, extra_keys=extra,
                       group_idx=0, kv_cache_spec_kind="full_attention")


def _ints(tokens) -> list[int]:
    return tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)


class _Block:
    __slots__ = ("bid", "hash", "ref")

    def __init__(self, bid: int):
        self.bid, self.hash, self.ref = bid, None, 0


@dataclass
class Allocation:
    """What admitting a request got from the cache; ``blocks`` are held until ``free``."""

    blocks: list[int]
    digests: list[bytes]          # chained digests of the prompt's full blocks, then of the blocks its
                                  # generated tokens fill, as they are cached
    hashes: list[int]             # their external (event) hashes
    hit_blocks: int               # local prefix hit, in blocks
    prompt_len: int
    g4_blocks: int = 0            # blocks loaded from the shared G4 store after the local hit
    cached_upto: int = 0          # full blocks cached (announced) so far
    loading: bool = False         # its G4 blocks are loading (asynchronously), not cached until the load ends
    extra: dict = field(default_factory=dict)


class SharedG4Store:
    """A model-wide store of KV blocks shared by every simulated worker of one process (off by default).

    Keyed by the engine's block hash (deterministic across workers: fixed chain root), bounded LRU."""

    def __init__(self, capacity_blocks: int = 1_000_000):
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.reads = 0
        self.writes = 0

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def touch(self, h: int) -> None:
        self._blocks.move_to_end(h)

    def put(self, h: int) -> bool:
        """Store ``h``; True if it was new (the writer announces it)."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return False
        self._blocks[h] = None
        self.writes += 1
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return True


class PrefixCache:
    """One engine's GPU block pool. Not thread-safe: one event loop drives it."""

    def __init__(self, num_blocks: int, block_size: int = 16, hash_seed: str = "vllm-none-hash",
                 g4: SharedG4Store | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        # vLLM's block pool sets block 0 aside (the null block) and reports its usage over the others
        self.usable = num_blocks - 1 if num_blocks > 1 else num_blocks
        self.root = none_hash(hash_seed)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks - self.usable,
                                                                                  num_blocks))
        self._cached: dict[int, list[int]] = {}
        self.g4 = g4
        self.events: list = []          # pending events, taken by the engine once per step
        self.queries = 0                # vllm:prefix_cache_queries (tokens)
        self.hits = 0                   # vllm:prefix_cache_hits (tokens)
        self.external_queries = 0
        self.external_hits = 0
        self.evictions = 0

    # -- introspection -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: the fraction of blocks held by running requests (cached free blocks
        count as free, as in vLLM)."""
        return 1.0 - len(self._free) / self.usable

    def cached_hashes(self) -> set[int]:
        return {h for h, ids in self._cached.items() if ids}

    def take_events(self) -> list:
        ev, self.events = self.events, []
        return ev

    # -- lookups -------------------------------------------------------------------------------------------
    def digests(self, tokens, cache_salt: str | None = None) -> list[bytes]:
        return block_digests(tokens, self.block_size, self.root, cache_salt)

    def longest_hit(self, digests: list[bytes], num_tokens: int, hashes: list[int] | None = None) -> int:
        """Blocks of the prompt's prefix that are cached locally, never reaching the last token."""
        limit = min(len(digests), (num_tokens - 1) // self.block_size)
        cached = self._cached
        n = 0
        # without ``hashes``, only the hit's and the first miss's are computed (lazily)
        for h in islice(map(external, digests) if hashes is None else hashes, limit):
            if not cached.get(h):
                break
            n += 1
        return n

    def g4_run(self, hashes: list[int], start: int = 0, end: int | None = None) -> int:
        """Blocks of ``hashes[start:end]`` that the shared G4 store holds, consecutively from ``start`` (0
        without G4): what an admission at ``start`` local blocks would load. Touches nothing."""
        if self.g4 is None:
            return 0
        end = len(hashes) if end is None else min(end, len(hashes))
        n = start
        while n < end and hashes[n] in self.g4:
            n += 1
        return n - start

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ----------------------------------------------------------------------------------------
    def allocate(self, tokens, reserve_tokens: int, cache_salt: str | None = None,
                 digests: list[bytes] | None = None, hold_tokens: int | None = None,
                 preempted: bool = False,
                 load_async: Callable[[int], bool] | None = None) -> Allocation | None:
        """Admit a prompt if the pool has room for ``reserve_tokens`` (vLLM 0.32's admission gate: the whole
        prompt must fit, its free prefix hit counted as taken). It holds blocks for all of them, or, with
        ``hold_tokens``, only for the prefix hit and that many tokens past it (the first chunk: vLLM
        allocates chunk by chunk; ``grow`` takes the rest). None when the gate fails (the request waits).
        Queues BlockRemoved/BlockStored events. ``preempted``: a preempted request readmitted, whose lookup
        vLLM leaves out of its prefix cache counters (``PrefixCacheStats.record``). ``load_async(g4
        tokens)``: whether the G4 blocks found load outside the step (vLLM's ``load_kv_async``); then the
        allocation (``loading``) holds the blocks of the prefix hit only, and caches none of the loaded ones
        (``delay_cache_blocks``): the engine caches them when the load has ended."""
        n_tok = len(tokens)
        digests = self.digests(tokens, cache_salt) if digests is None else digests
        hit = self.longest_hit(digests, n_tok)
        need_total = self.blocks_needed(reserve_tokens)
        if need_total > self.usable:
            raise ValueError(f"request needs {need_total} blocks, the pool has {self.usable}")
        hashes = [external(d) for d in digests[:hit]]
        hit_ids = [self._cached[h][0] for h in hashes]
        # Hit blocks that are free stop being free once touched.
        free_hits = sum(1 for b in hit_ids if self._blocks[b].ref == 0)
        if len(self._free) - free_hits < need_total - hit:
            return None  # before hashing the rest: a head that waits for room tries again every step
        hashes += [external(d) for d in digests[hit:]]
        if not preempted:
            self.queries += n_tok
            self.hits += hit * self.block_size
        for b in hit_ids:
            blk = self._blocks[b]
            if blk.ref == 0:
                del self._free[b]
            blk.ref += 1
        # G4: extend the local hit with consecutive blocks found on the shared store.
        g4_hit = 0
        if self.g4 is not None:
            limit = min(len(digests), (n_tok - 1) // self.block_size)
            g4_hit = self.g4_run(hashes, hit, limit)
            for h in hashes[hit:hit + g4_hit]:
                self.g4.touch(h)
            if not preempted:
                self.external_queries += n_tok - hit * self.block_size
                self.external_hits += g4_hit * self.block_size
            self.g4.reads += g4_hit
        loading = bool(g4_hit) and load_async is not None and load_async(g4_hit * self.block_size)
        held = reserve_tokens
        if hold_tokens is not None:
            held = min(reserve_tokens, (hit + g4_hit) * self.block_size + (0 if loading else hold_tokens))
            need_total = self.blocks_needed(held)
        new_ids = self._get_new_blocks(need_total - hit)
        alloc = Allocation(blocks=hit_ids + new_ids, digests=digests, hashes=hashes, hit_blocks=hit, prompt_len=n_tok,
                           g4_blocks=g4_hit, cached_upto=hit, loading=loading,
                           extra={"salt": cache_salt} if cache_salt else {})
        # the blocks the scheduled tokens fill (vLLM's allocate_slots caches min(computed + new, num_tokens)
        # tokens' full blocks), not a chunk's last, partly scheduled block
        if not loading:
            self.cache_full_blocks(alloc, tokens, held // self.block_size)
        return alloc

    def grow(self, alloc: Allocation, tokens, num_tokens: int) -> bool:
        """Hold blocks for the first ``num_tokens`` of a running request's sequence ``tokens`` (its next
        chunk, or a decode step); the blocks these tokens fill are cached at once, as vLLM's allocate_slots
        caches the full blocks of what it schedules: a chunk's, and in a decode step the block whose last
        token the step computes, generated tokens included (a block filled only in part waits for the step
        that completes it). False, holding nothing more, when the pool is short."""
        need = self.blocks_needed(num_tokens) - len(alloc.blocks)
        if need > 0:
            if need > len(self._free):
                return False
            alloc.blocks.extend(self._get_new_blocks(need))
        self.cache_full_blocks(alloc, tokens, num_tokens // self.block_size)
        return True

    def _get_new_blocks(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self._blocks[bid]
            if blk.hash is not None:
                copies = self._cached.get(blk.hash)
                if copies is not None:
                    copies.remove(bid)
                    if not copies:
                        del self._cached[blk.hash]
                self.events.append(BlockRemoved(block_hashes=[blk.hash], medium=MEDIUM_GPU, group_idx=0))
                self.evictions += 1
                blk.hash = None
            blk.ref = 1
            out.append(bid)
        return out

    def cache_full_blocks(self, alloc: Allocation, all_tokens, num_full: int) -> None:
        """Hash and announce blocks ``alloc.cached_upto..num_full`` of the sequence ``all_tokens`` (anything
        sliceable; one BlockStored for the run), never past its last full block (vLLM caps what it caches at
        the request's tokens); blocks past the prompt's continue its chain."""
        B = self.block_size
        num_full = min(num_full, len(all_tokens) // B)
        start = alloc.cached_upto
        if num_full <= start:
            return
        known = len(alloc.digests)
        if num_full > known:
            parent, salt = (alloc.digests[-1], None) if known else (self.root, alloc.extra.get("salt"))
            more = block_digests(all_tokens[known * B:num_full * B], B, parent, salt)
            alloc.digests = alloc.digests + more
            alloc.hashes = alloc.hashes + [external(d) for d in more]
        hashes = alloc.hashes[start:num_full]
        blocks, cached = self._blocks, self._cached
        for h, bid in zip(hashes, alloc.blocks[start:num_full]):
            blocks[bid].hash = h
            lst = cached.get(h)
            if lst is None:
                cached[h] = [bid]
            else:
                lst.append(bid)
        parent = alloc.hashes[start - 1] if start > 0 else None
        self.events.append(_stored(hashes, parent, all_tokens[start * B:num_full * B], B, MEDIUM_GPU,
                                   alloc.extra.get("salt") if start == 0 else None))
        alloc.cached_upto = num_full

    def write_g4(self, alloc: Allocation, all_tokens) -> None:
        """After prefill: write the prompt's full blocks to the shared store; announce the new ones."""
        if self.g4 is None:
            return
        run: list[int] = []
        run_start = None
        for i in range(alloc.cached_upto):
            h = alloc.hashes[i]
            if self.g4.put(h):
                if run_start is None:
                    run_start = i
                run.append(h)
            elif run:
                self._announce_g4(alloc, all_tokens, run_start, run)
                run, run_start = [], None
        if run:
            self._announce_g4(alloc, all_tokens, run_start, run)

    def _announce_g4(self, alloc, all_tokens, start: int, hashes: list[int]) -> None:
        B = self.block_size
        parent = alloc.hashes[start - 1] if start > 0 else None
        self.events.append(_stored(hashes, parent, all_tokens[start * B:(start + len(hashes)) * B], B,
                                   MEDIUM_STORAGE, alloc.extra.get("salt") if start == 0 else None))

    def free(self, alloc: Allocation) -> None:
        """Release a finished request's blocks, tail first, so its tail is evicted before its head. As
        vLLM's ``BlockPool.free_blocks``: hashed blocks go to the end of the free queue (LRU), blocks without
        a hash (a partial tail, nothing to hit) to its front, in the same order, to be reused first, before
        any cached block is evicted."""
        unhashed = []
        for bid in reversed(alloc.blocks):
            blk = self._blocks[bid]
            blk.ref -= 1
            if blk.ref == 0:
                if blk.hash is None:
                    unhashed.append(bid)
                else:
                    self._free[bid] = None
        for bid in reversed(unhashed):
            self._free[bid] = None
            self._free.move_to_end(bid, last=False)
        alloc.blocks = []

    def reset(self) -> bool:
        """``/reset_prefix_cache``: drop every hash when nothing is running; one AllBlocksCleared."""
        if len(self._free) != self.usable:
            return False
        from bench.sim.events import AllBlocksCleared

        for blk in self._blocks:
            blk.hash = None
        self._cached.clear()
        self.events.append(AllBlocksCleared())
        return True
