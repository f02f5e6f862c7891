"""In-memory index: the embedded default for a single gateway process.

Two maps per model: block -> {(worker, tier)} answers lookups; (worker, tier) -> {block} lets a worker be
dropped without scanning every block. Everything runs on the event loop thread (no awaits inside a
mutation), so no lock is needed.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from indexer.index.base import BlockIndex, BlockLocation, LookupResult, Tier, WorkerMatch

_LOCAL = (Tier.GPU, Tier.CPU)


class _ModelIndex:
    __slots__ = ("holders", "owned", "g4")

    def __init__(self) -> None:
        self.holders: dict[int, dict[str, set[Tier]]] = {}
        self.owned: dict[tuple[str, Tier], set[int]] = defaultdict(set)
        self.g4: set[int] = set()


class MemoryIndex(BlockIndex):
    name = "memory"

    def __init__(self) -> None:
        self._models: dict[str, _ModelIndex] = defaultdict(_ModelIndex)

    async def store(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        m = self._models[model]
        owned = m.owned[(worker, tier)]
        for h in hashes:
            m.holders.setdefault(h, {}).setdefault(worker, set()).add(tier)
            owned.add(h)

    async def remove(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        m = self._models.get(model)
        if m is None:
            return
        owned = m.owned.get((worker, tier))
        for h in hashes:
            self._drop(m, h, worker, tier)
            if owned is not None:
                owned.discard(h)

    @staticmethod
    def _drop(m: _ModelIndex, h: int, worker: str, tier: Tier) -> bool:
        by_worker = m.holders.get(h)
        if not by_worker:
            return False
        tiers = by_worker.get(worker)
        if not tiers or tier not in tiers:
            return False
        tiers.discard(tier)
        if not tiers:
            del by_worker[worker]
            if not by_worker:
                del m.holders[h]
        return True

    async def store_g4(self, model: str, hashes: Sequence[int]) -> None:
        self._models[model].g4.update(hashes)

    async def remove_g4(self, model: str, hashes: Sequence[int]) -> None:
        m = self._models.get(model)
        if m is not None:
            m.g4.difference_update(hashes)

    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None) -> int:
        m = self._models.get(model)
        if m is None:
            return 0
        removed = 0
        for t in (tier,) if tier is not None else _LOCAL:
            for h in m.owned.pop((worker, t), ()):
                removed += self._drop(m, h, worker, t)
        return removed

    async def clear_model(self, model: str) -> int:
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
        allowed = set(workers) if workers is not None else None
        runs: dict[str, list[int]] = {}  # worker -> [gpu, cpu, local]
        alive: dict[str, list[bool]] = {}
        g4 = 0
        g4_alive = True
        for i, h in enumerate(hashes):
            by_worker = m.holders.get(h, {})
            if i == 0:
                for w, tiers in by_worker.items():
                    if allowed is None or w in allowed:
                        runs[w] = [0, 0, 0]
                        alive[w] = [True, True, True]
            any_alive = False
            for w, flags in alive.items():
                if not (flags[0] or flags[1] or flags[2]):
                    continue
                tiers = by_worker.get(w, ())
                r = runs[w]
                for k, ok in enumerate((Tier.GPU in tiers, Tier.CPU in tiers, bool(tiers))):
                    if flags[k] and ok:
                        r[k] += 1
                        any_alive = True
                    else:
                        flags[k] = False
            if g4_alive and h in m.g4:
                g4 += 1
            else:
                g4_alive = False
            if not any_alive and not g4_alive:
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
        by_worker = m.holders.get(block_hash, {})
        return BlockLocation(
            workers={w: frozenset(t) for w, t in by_worker.items()}, g4=block_hash in m.g4
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
        return sorted(self._models)
