"""In-memory index: the embedded default for a single gateway process.

Two maps per model: block -> holder bits (bit ``2 * id`` GPU, ``2 * id + 1`` CPU of the worker with that
small id) answers lookups; (worker, tier) -> {block} lets a worker be dropped without scanning every
block. G4 is a set of blocks. Why bits, not a dict of workers per block: at 16 workers of 62,500 blocks
that was a million small dicts, 7.6% of the gateway's CPU samples on the line creating them during a
simulator replay (py-spy) and ~200 bytes each; an int is a fraction of both. A worker's id is freed for
reuse once it holds nothing, so the ints stay as wide as the fleet is large, however many workers came
and went. Everything runs on the event loop thread (no awaits inside a mutation), so no lock is needed.
``lookup`` walks the prompt once and only looks at the workers whose local run is still growing, so its
cost is the sum of the runs, not blocks x workers.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Collection, Sequence

from indexer.index.base import BlockIndex, BlockLocation, LookupResult, Tier, WorkerMatch

_LOCAL = (Tier.GPU, Tier.CPU)
_SHIFT = {Tier.GPU: 0, Tier.CPU: 1}


class _ModelIndex:
    __slots__ = ("free", "g4", "holders", "ids", "names", "owned")

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.owned: dict[tuple[str, Tier], set[int]] = defaultdict(set)
        self.g4: set[int] = set()
        self.ids: dict[str, int] = {}  # worker -> small id (its two bits in ``holders``)
        self.names: dict[int, str] = {}
        self.free: list[int] = []  # ids of workers that hold nothing any more (a heap: lowest first)

    def bit(self, worker: str, tier: Tier) -> int:
        i = self.ids.get(worker)
        if i is None:
            i = heapq.heappop(self.free) if self.free else len(self.ids)
            self.ids[worker] = i
            self.names[i] = worker
        return 1 << (2 * i + _SHIFT[tier])

    def release_if_empty(self, worker: str) -> None:
        """Free ``worker``'s id once it holds nothing on either tier (no block carries its bits then)."""
        i = self.ids.get(worker)
        if i is None or any(self.owned.get((worker, t)) for t in _LOCAL):
            return
        for t in _LOCAL:
            self.owned.pop((worker, t), None)
        del self.ids[worker], self.names[i]
        heapq.heappush(self.free, i)


class MemoryIndex(BlockIndex):
    name = "memory"

    def __init__(self) -> None:
        self._models: dict[str, _ModelIndex] = defaultdict(_ModelIndex)

    async def store(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        if len(hashes) == 0:  # nothing to hold: no model entry, no holder bits set aside for the worker
            return
        m = self._models[model]
        tier = Tier(tier)
        bit = m.bit(worker, tier)
        holders = m.holders
        get = holders.get
        for h in hashes:
            holders[h] = get(h, 0) | bit
        m.owned[(worker, tier)].update(hashes)

    async def remove(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        m = self._models.get(model)
        if m is None:
            return
        tier = Tier(tier)
        owned = m.owned.get((worker, tier))
        if not owned:
            return
        bit = m.bit(worker, tier)
        for h in hashes:
            if h in owned:
                owned.discard(h)
                self._drop(m, h, bit)
        if not owned:
            m.release_if_empty(worker)

    @staticmethod
    def _drop(m: _ModelIndex, h: int, bit: int) -> bool:
        v = m.holders.get(h, 0)
        if not v & bit:
            return False
        v &= ~bit
        if v:
            m.holders[h] = v
        else:
            del m.holders[h]
        return True

    async def store_g4(self, model: str, hashes: Sequence[int]) -> None:
        if len(hashes):
            self._models[model].g4.update(hashes)

    async def remove_g4(self, model: str, hashes: Sequence[int]) -> None:
        m = self._models.get(model)
        if m is not None:
            m.g4.difference_update(hashes)

    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None) -> int:
        if tier is None:
            await self._drop_handles(model, worker)
        m = self._models.get(model)
        if m is None or worker not in m.ids:
            return 0
        removed = 0
        for t in (Tier(tier),) if tier is not None else _LOCAL:
            bit = m.bit(worker, t)
            for h in m.owned.pop((worker, t), ()):
                removed += self._drop(m, h, bit)
        m.release_if_empty(worker)
        return removed

    async def clear_model(self, model: str) -> int:
        for key in [k for k in self._handles if k[0] == model]:
            del self._handles[key]
        m = self._models.pop(model, None)
        if m is None:
            return 0
        return sum(len(s) for s in m.owned.values()) + len(m.g4)

    async def lookup(
        self, model: str, hashes: Sequence[int], workers: Collection[str] | None = None
    ) -> LookupResult:
        m = self._models.get(model)
        n = len(hashes)
        if m is None or n == 0:
            return LookupResult(num_blocks=n)
        holders = m.holders
        first = holders.get(hashes[0], 0)
        allowed = set(workers) if workers is not None else None
        # per worker whose local run is alive: [gpu run, cpu run, local run, gpu alive, cpu alive, shift]
        runs = {w: [0, 0, 0, True, True, 2 * i] for i, w in m.names.items()
                if (first >> (2 * i)) & 3 and (allowed is None or w in allowed)}
        alive = list(runs.values())
        g4set = m.g4
        g4 = 0
        g4_alive = True
        for h in hashes:
            if alive:
                v = holders.get(h, 0)
                nxt = []
                for r in alive:
                    bits = (v >> r[5]) & 3
                    if not bits:
                        continue
                    r[2] += 1
                    if r[3]:
                        if bits & 1:
                            r[0] += 1
                        else:
                            r[3] = False
                    if r[4]:
                        if bits & 2:
                            r[1] += 1
                        else:
                            r[4] = False
                    nxt.append(r)
                alive = nxt
            if g4_alive:
                if h in g4set:
                    g4 += 1
                else:
                    g4_alive = False
            if not alive and not g4_alive:
                break
        return LookupResult(
            num_blocks=n,
            workers={w: WorkerMatch(gpu=r[0], cpu=r[1], local=r[2]) for w, r in runs.items() if r[2]},
            g4=g4,
        )

    async def locate(self, model: str, block_hash: int) -> BlockLocation:
        m = self._models.get(model)
        if m is None:
            return BlockLocation(workers={}, g4=False)
        v = m.holders.get(block_hash, 0)
        workers = {}
        for i, w in m.names.items():
            bits = (v >> (2 * i)) & 3
            if bits:
                workers[w] = frozenset(t for t in _LOCAL if bits >> _SHIFT[t] & 1)
        return BlockLocation(workers=workers, g4=block_hash in m.g4)

    async def stats(self, model: str | None = None) -> dict:
        out = {}
        for name, m in self._models.items():
            if model is not None and name != model:
                continue
            if not m.holders and not m.g4:
                continue
            per_worker: dict[str, dict[str, int]] = defaultdict(dict)
            per_tier = {t.value: 0 for t in _LOCAL}
            for (w, t), blocks in m.owned.items():
                if blocks:
                    per_worker[w][t.value] = len(blocks)
                    per_tier[t.value] += len(blocks)
            out[name] = {
                "blocks": len(m.holders) + sum(1 for h in m.g4 if h not in m.holders),
                "entries_per_tier": per_tier,
                "g4_blocks": len(m.g4),
                "workers": dict(per_worker),
            }
        return out

    async def models(self) -> list[str]:
        return sorted(name for name, m in self._models.items() if m.holders or m.g4)
