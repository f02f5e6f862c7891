"""In-memory index: the embedded default for a single gateway process.

Two maps per model: block -> {worker: tier bits} (bit 1 GPU, bit 2 CPU) answers lookups;
(worker, tier) -> {block} lets a worker be dropped without scanning every block. G4 is a set of blocks.
Everything runs on the event loop thread (no awaits inside a mutation), so no lock is needed.
``lookup`` walks the prompt once and only looks at the workers whose local run is still growing, so its
cost is the sum of the runs, not blocks x workers.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from indexer.index.base import BlockIndex, BlockLocation, LookupResult, Tier, WorkerMatch

_LOCAL = (Tier.GPU, Tier.CPU)
_BIT = {Tier.GPU: 1, Tier.CPU: 2}


class _ModelIndex:
    __slots__ = ("g4", "holders", "owned")

    def __init__(self) -> None:
        self.holders: dict[int, dict[str, int]] = {}
        self.owned: dict[tuple[str, Tier], set[int]] = defaultdict(set)
        self.g4: set[int] = set()


class MemoryIndex(BlockIndex):
    name = "memory"

    def __init__(self) -> None:
        self._models: dict[str, _ModelIndex] = defaultdict(_ModelIndex)

    async def store(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        m = self._models[model]
        tier = Tier(tier)
        bit = _BIT[tier]
        owned = m.owned[(worker, tier)]
        holders = m.holders
        for h in hashes:
            bw = holders.get(h)
            if bw is None:
                holders[h] = {worker: bit}
            else:
                bw[worker] = bw.get(worker, 0) | bit
        owned.update(hashes)

    async def remove(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        m = self._models.get(model)
        if m is None:
            return
        tier = Tier(tier)
        owned = m.owned.get((worker, tier))
        if owned is None:
            return
        bit = _BIT[tier]
        for h in hashes:
            if h in owned:
                owned.discard(h)
                self._drop(m, h, worker, bit)

    @staticmethod
    def _drop(m: _ModelIndex, h: int, worker: str, bit: int) -> bool:
        bw = m.holders.get(h)
        if not bw:
            return False
        bits = bw.get(worker, 0)
        if not bits & bit:
            return False
        bits &= ~bit
        if bits:
            bw[worker] = bits
        else:
            del bw[worker]
            if not bw:
                del m.holders[h]
        return True

    async def store_g4(self, model: str, hashes: Sequence[int]) -> None:
        self._models[model].g4.update(hashes)

    async def remove_g4(self, model: str, hashes: Sequence[int]) -> None:
        m = self._models.get(model)
        if m is not None:
            m.g4.difference_update(hashes)

    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None) -> int:
        if tier is None:
            await self._drop_handles(model, worker)
        m = self._models.get(model)
        if m is None:
            return 0
        removed = 0
        for t in (Tier(tier),) if tier is not None else _LOCAL:
            bit = _BIT[t]
            for h in m.owned.pop((worker, t), ()):
                removed += self._drop(m, h, worker, bit)
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
        first = holders.get(hashes[0], {})
        allowed = set(workers) if workers is not None else None
        # per worker whose local run is alive: [gpu run, cpu run, local run, gpu alive, cpu alive]
        runs = {w: [0, 0, 0, True, True] for w in first if allowed is None or w in allowed}
        alive = list(runs)
        g4set = m.g4
        g4 = 0
        g4_alive = True
        empty: dict[str, int] = {}
        for h in hashes:
            if alive:
                bw = holders.get(h, empty)
                nxt = []
                for w in alive:
                    bits = bw.get(w, 0)
                    if not bits:
                        continue
                    r = runs[w]
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
                    nxt.append(w)
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
        bw = m.holders.get(block_hash, {})
        return BlockLocation(
            workers={w: frozenset(t for t in _LOCAL if bits & _BIT[t]) for w, bits in bw.items()},
            g4=block_hash in m.g4,
        )

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
