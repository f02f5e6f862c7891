"""Will a worker's cached prefix survive until the request is scheduled? The model, calibrated online.

vLLM keeps cached blocks no request holds in its free queue and reuses the least recently used first (a
request's blocks are freed tail first, so a prefix is cut from its end). The requests queued ahead
allocate about their uncached prompt's blocks (only those vLLM was not yet running at the last scrape: the
others' KV is in the usage already; and the cached prefixes of theirs that this demand evicts first, which
they recompute: router/load.py ``queue_losses``); the *pressure* is that demand over the worker's free
blocks (``(1 - kv_usage) * num_gpu_blocks``). The leading blocks a request in flight has in its prompt are
held, not free: only the tail past them is priced. At pressure ``p`` (scaled, below) the model keeps the whole prefix up
to 0.5 (a prefix the index shows was used recently, so it sits near the recent end of the free queue),
none from 1.0, and a linearly shrinking share in between. Unknown capacity or no queue: nothing is
discounted.

Where the worker's recent releases say where the prefix sits in that queue (router/load.py
``prefix_age``), the *LRU model* replaces the pressure: the prefix survives while the queue's demand fits
in the free blocks released before it (free less the prefix less what was released after it), and loses
its tail by the excess (vLLM frees a request's blocks tail first). A prefix a request in flight holds is
kept. In a closed loop of sessions sharing a worker, the prefix that comes back is the one used least
recently: the pressure model kept it below half the free room, and vLLM delivered 0 of it in 10 of 58
requests of a capacity-bound run.

The raw pressure under-states what happens when the queue ahead was itself over-predicted (its own
prefixes evicted: a cascade), when the KV usage gauge lags, or when running requests grow. So each worker
learns a *pressure scale* from what vLLM delivered: after a request whose local prefix was priced at
pressure ``p``, the share of it vLLM reported cached says which scale would have predicted it (a shortfall
raises the scale; a whole prefix delivered at a pressure the model discounted lowers it). Log-space EWMA,
clamped, so one sample never drives it to 0 or to infinity; with no samples the scale is 1 (the prior).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from router.kv_room import demand_share

SCALE_RANGE = (0.25, 8.0)
ALPHA = 0.25  # weight of one observation (in log space)
KEEP_BELOW = 0.5  # scaled pressure under which the whole prefix is kept


def pressure(queue_tokens: float, free_tokens: float | None) -> float:
    """Demand of the queue ahead over the free room (router/kv_room.py): 0 when unknown (no discount),
    inf when none is free."""
    return demand_share(queue_tokens, free_tokens)


def kept_share(scaled_pressure: float) -> float:
    if scaled_pressure <= KEEP_BELOW:
        return 1.0
    return max(0.0, (1.0 - scaled_pressure) / (1.0 - KEEP_BELOW))


def surviving(local: int, p: float, scale: float = 1.0) -> int:
    """Blocks of a ``local``-block prefix expected to survive at raw pressure ``p``."""
    if local <= 0 or p <= 0:
        return local
    if math.isinf(p):
        return 0
    return max(0, min(local, int(local * kept_share(p * scale) + 0.5)))


def lru_surviving(indexed: int, block_size: int, demand_tokens: float, free_tokens: float, age_tokens: float,
                  scale: float = 1.0) -> tuple[int, float]:
    """Blocks of an ``indexed``-block prefix expected to survive ``demand_tokens`` of new allocations
    (scaled), when ``age_tokens`` were released after it and ``free_tokens`` are free; and the free tokens
    older than it (the allocations it absorbs first)."""
    if indexed <= 0 or block_size <= 0:
        return indexed, 0.0
    older = max(0.0, free_tokens - indexed * block_size - max(0.0, age_tokens))
    excess = demand_tokens * scale - older
    if not excess > 0:
        return indexed, older
    return max(0, indexed - math.ceil(excess / block_size)), older


@dataclass
class EvictionCalibration:
    """One worker's pressure scale, learnt from delivered cached tokens."""

    scale: float = 1.0
    samples: int = 0
    shortfalls: int = 0  # requests that got less of their local prefix than the index showed

    def observe(self, p: float, indexed: int, delivered: int) -> None:
        """``indexed``: local prefix blocks the index showed (before the discount); ``delivered``: of those,
        the blocks vLLM reported cached. Only requests that waited behind a queue (``p`` > 0) say anything
        about the scale."""
        if indexed <= 0 or not p > 0 or math.isinf(p):
            return
        s = min(1.0, max(0.0, delivered / indexed))
        if s < 1.0:
            self.shortfalls += 1
            target = (1.0 - s * (1.0 - KEEP_BELOW)) / p  # the scale at which kept_share(p * scale) == s
        elif p * self.scale > KEEP_BELOW:
            target = 0.9 * KEEP_BELOW / p  # all of it survived: just inside the scales that predict that
        else:
            return  # consistent with the current scale
        self._towards(target)

    def observe_lru(self, demand_tokens: float, older_tokens: float, indexed: int, delivered: int,
                    block_size: int) -> None:
        """The same scale, learnt from a request the LRU model priced: the demand that would have evicted
        what vLLM did evict (``indexed - delivered`` blocks) past the ``older_tokens`` it absorbs first."""
        if indexed <= 0 or block_size <= 0 or not demand_tokens > 0:
            return
        evicted = indexed - min(indexed, max(0, delivered))
        if 0 < evicted < indexed:
            target = (older_tokens + evicted * block_size) / demand_tokens
        elif evicted == indexed:  # all of it: at least the demand that reaches its first block
            target = max(self.scale, (older_tokens + indexed * block_size) / demand_tokens)
        elif demand_tokens * self.scale > older_tokens:  # none, where the model expected some
            target = 0.9 * older_tokens / demand_tokens
        else:
            return
        if evicted:
            self.shortfalls += 1
        self._towards(target)

    def _towards(self, target: float) -> None:
        """One sample's move of the scale (log-space EWMA), target and result clamped to the range."""
        lo, hi = SCALE_RANGE
        target = min(hi, max(lo, target))
        self.scale = min(hi, max(lo, math.exp((1 - ALPHA) * math.log(self.scale) + ALPHA * math.log(target))))
        self.samples += 1

    def to_dict(self) -> dict:
        return {"pressure_scale": round(self.scale, 3), "samples": self.samples, "shortfalls": self.shortfalls}


def observe_delivery(cal: EvictionCalibration, cand, delivered_tokens: int, block_size: int) -> None:
    """What vLLM delivered (``usage.prompt_tokens_details.cached_tokens``) of the local prefix the index
    showed for the chosen candidate (router/cost.py ``Candidate``) calibrates the worker's eviction model,
    whichever model priced it."""
    if block_size <= 0:
        return
    indexed = cand.local_blocks + cand.evicted_blocks
    if cand.g4_blocks and delivered_tokens // block_size < indexed + cand.g4_blocks:
        # short of the local prefix and the G4 blocks: a local eviction, or a G4 load that did not happen
        # (a failed prefetch), which cached_tokens cannot tell apart (six failed loads of a whole local
        # prefix drove the scale from 1.0 to 2.1, found by a review): no evidence either way
        return
    delivered_local = min(indexed, max(0, delivered_tokens // block_size - cand.g4_blocks))
    if cand.eviction_model == "lru":
        cal.observe_lru(cand.kv_demand_tokens, cand.lru_older_tokens, indexed, delivered_local, block_size)
    elif cand.eviction_model == "pressure":  # it priced the tail past the held blocks: the scale is for that
        held = min(indexed, max(0, cand.eviction_held_blocks))
        cal.observe(cand.eviction_pressure, indexed - held, max(0, delivered_local - held))
