"""A worker's free KV room, the one model every "does the demand fit?" question reads.

vLLM's ``vllm:kv_cache_usage_perc`` is the share of KV blocks running requests hold; the rest hold cached
prefixes nobody uses (the free queue, least recently used first) or nothing. Three parts of the gateway
ask how a demand compares with that room: the eviction model (router/eviction.py: will the queue ahead
evict this prefix?), the KV-capacity wait (router/cost.py: must this request wait for running ones to
end?) and the footprint scorer (router/policies/scorers.py: how recently used is what a placement here
evicts?). They read the room from :func:`kv_room` and compare with :func:`demand_share`.
"""
from __future__ import annotations

import math

# the longest KV-capacity wait priced (the cost model's own clamp, router/cost.py MAX_TTFT_MS)
MAX_WAIT_S = 3600.0
# vLLM's block pool sets one block aside (the null block; vllm:kv_cache_usage_perc is over the others)
NULL_BLOCKS = 1


def capacity_tokens(load, block_size: int) -> int:
    """The KV tokens a worker's requests can hold: ``num_gpu_blocks`` less the null block (0: unknown)."""
    blocks = load.num_gpu_blocks
    if not (blocks and block_size > 0):
        return 0
    return max(1, blocks - NULL_BLOCKS) * block_size


def kv_room(load, block_size: int, since_tokens: float = 0.0,
            running_tokens: float = 0.0) -> tuple[float | None, float | None]:
    """The share of KV blocks no running request holds, and those blocks in tokens (with ``num_gpu_blocks``).
    None unless the last scrape gave a usage in [0, 1] (a worker never scraped, or a page without a valid
    usage, reads 0, which is no evidence of free room); the tokens are None too when the capacity is unknown.
    ``since_tokens``: KV the gateway's requests freed less what they took since that scrape (router/load.py
    ``kv_since_scrape``), which moves the room (within the capacity) when the capacity is known.
    ``running_tokens``: KV the gateway's requests that vLLM runs hold (router/load.py ``running_tokens``): the
    room is at most the capacity less that. The corrected usage alone can read a busy worker as empty: the
    frees since the scrape are counted at once, while a request vLLM admitted since is taken only at its first
    token (capacity-bound real vLLM, session 20: 6,538 of 6,560 tokens read free with two requests running and
    three sent)."""
    u = load.kv_usage
    if not load.updated_at or not load.usage_known or not isinstance(u, (int, float)) \
            or not 0.0 <= u <= 1.0:  # NaN included
        return None, None
    cap = capacity_tokens(load, block_size)
    if not cap:
        return 1.0 - u, None
    free = (1.0 - u) * cap
    if not math.isnan(since_tokens):
        free = min(cap, max(0.0, free + since_tokens))
    if running_tokens > 0:
        free = max(0.0, min(free, cap - running_tokens))
    return free / cap, free


def demand_share(demand_tokens: float, free_tokens: float | None) -> float:
    """``demand_tokens`` over the free room: 0 with no demand or an unknown room (nothing to price),
    infinite when no room is free."""
    if free_tokens is None or not demand_tokens > 0:
        return 0.0
    if free_tokens <= 0:
        return math.inf
    return demand_tokens / free_tokens


def kv_wait_s(decoding: list, free_tokens: float, demand_tokens: float, step_s: float, now: float) -> float:
    """Seconds until running requests free the KV that the queue ahead and this request need beyond the free
    room (vLLM schedules a request only once its blocks fit; evicting free cached blocks is already in the
    room): the gateway's decoding requests (router/load.py ``Sequence``) end at their first token plus
    ``max_tokens`` steps, earliest first, each freeing its prompt and output. 0 when the demand fits or
    nothing known frees it."""
    excess = demand_tokens - free_tokens
    if excess <= 0:
        return 0.0
    freed = 0.0
    end = now
    for end, held in sorted(seq.kv_release(step_s) for seq in decoding):
        freed += held
        if freed >= excess:
            break
    return min(max(0.0, end - now), MAX_WAIT_S)
