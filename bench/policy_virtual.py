"""The kv policy's order on the virtual clock: ``python -m bench.policy_virtual``.

The simulated engines of ``bench.sim.virtual`` (no HTTP, no gateway, no wall time: results do not depend on
the machine's load), each request placed by the kv policy's scorers (router/policies/kv.py) over candidates
priced with the engines' true state: their real prefix hit, the timing model's prefill time of the queue
ahead and of the request, their KV usage. So it compares policy settings alone, with a perfect cost model
(the gateway's own predictions are measured by ``bench.side_by_side``). The last row emulates
sglang-router's ``cache_aware`` placement on the same engines: the peer baseline, policy against policy."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from itertools import count

from bench.sim import virtual as vt
from bench.sim.cache import external
from bench.sim.engine import SimEngine
from router.config import RoutingConfig
from router.cost import Candidate
from router.policies.kv import kv_order, scorers_of

MS = 1000.0  # prefill work is counted in model ms: a candidate's speed is 1,000 "tokens" a second


def candidate(i: int, e: SimEngine, digests, hashes, tokens: list[int], free: float | None = None) -> Candidate:
    """``free``: the share of KV no running request holds, as the gateway last saw it (default: now)."""
    c, t = e.cache, e.timing
    hit = c.longest_hit(digests, len(tokens), hashes)
    g4 = c.g4_run(hashes, hit)
    cached = (hit + g4) * c.block_size
    queue_s = sum(t.chunk_s(len(r.tokens) - r.computed, r.computed) + t.start_s(r.computed) for r in e.waiting)
    queue_s += sum(t.chunk_s(len(r.tokens) - r.computed, r.computed) for r in e._running if not r.n_out)
    own_s = t.prefill_s(len(tokens) - cached, cached, g4 * c.block_size)
    queued = sum(len(r.tokens) - r.computed for r in e.waiting)
    free = 1.0 - c.usage() if free is None else free
    return Candidate(worker=str(i), local_blocks=hit, gpu_blocks=hit, g4_blocks=g4, cached_tokens=cached,
                     uncached_tokens=len(tokens) - cached, prefill_work=own_s * MS, prefill_tokens_per_s=MS,
                     queue_ms=queue_s * MS, prefill_ms=own_s * MS, predicted_ttft_ms=(queue_s + own_s) * MS,
                     load=len(e.waiting) + len(e._running), queue_tokens=queued, kv_demand_tokens=queued,
                     kv_free=free,
                     kv_free_tokens=free * c.num_blocks * c.block_size)


def placer(cfg: RoutingConfig, free_of=None):
    """The kv policy's placement; ``free_of(i, engine)``: the KV room a candidate is priced with (default:
    the engine's own, now)."""
    scorers, turn = scorers_of(cfg), count(1)

    def place(engines: Sequence[SimEngine], tokens: list[int]) -> int:
        c0 = engines[0].cache
        digests = c0.digests(tokens)
        limit = min(len(digests), (len(tokens) - 1) // c0.block_size)
        hashes = [external(d) for d in digests[:limit]]
        cands = [candidate(i, e, digests, hashes, tokens, free_of(i, e) if free_of else None)
                 for i, e in enumerate(engines)]
        return int(kv_order(cands, next(turn) % len(engines), scorers, cfg.overlap_share)[0].worker)

    return place


def sglang_cache_aware(threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5):
    """A placement that follows sglang-router's ``cache_aware`` policy with its defaults, for a peer
    baseline on the same clock: per worker, the blocks it was sent (its approximate tree; block keys are
    chained, so a set holds the tree). Past a load imbalance of ``balance_abs`` requests and
    ``balance_rel`` times, the least loaded; else the longest match when it covers more than ``threshold``
    of the prompt; else the worker sent the least (the smallest tree). No tree eviction (sglang-router's
    default bound is far above these slices)."""
    sent: list[set] = []

    def place(engines: Sequence[SimEngine], tokens: list[int]) -> int:
        while len(sent) < len(engines):
            sent.append(set())
        c0 = engines[0].cache
        hashes = [external(d) for d in c0.digests(tokens)[: len(tokens) // c0.block_size]]
        loads = [len(e.waiting) + len(e._running) for e in engines]
        if max(loads) - min(loads) > balance_abs and max(loads) > balance_rel * min(loads):
            w = loads.index(min(loads))
        else:
            runs = [next((i for i, h in enumerate(hashes) if h not in s), len(hashes)) for s in sent]
            best = max(range(len(engines)), key=lambda i: runs[i])
            covered = runs[best] * c0.block_size / max(1, len(tokens))
            w = best if covered > threshold else min(range(len(engines)), key=lambda i: len(sent[i]))
        sent[w].update(hashes)
        return w

    return place


VARIANTS = {
    "session 4 (recompute + affinity)": dict(future_turns=0.0, stay_margin=0.0),
    "future_turns=1, stay_margin=0.1": dict(future_turns=1.0, stay_margin=0.1),
    "defaults (future_turns=3, stay_margin=0.3)": {},
    "defaults + footprint_weight=1": dict(footprint_weight=1.0),
    "future_turns=5, stay_margin=0.5": dict(future_turns=5.0, stay_margin=0.5),
}


def main(argv: list[str] | None = None) -> int:
    from bench import replay_workloads as wl

    p = argparse.ArgumentParser(prog="python -m bench.policy_virtual", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--num-blocks", type=int, default=62_500)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=128)
    args = p.parse_args(argv)
    rows = wl.load_trace()
    fit = args.num_blocks * args.block_size - args.max_tokens_cap
    items = wl.trace_items(rows, start_s=args.start, duration_s=args.duration,
                           max_tokens_cap=args.max_tokens_cap, max_prompt_tokens=fit)
    print(f"{len(items)} requests, {args.workers} workers, {args.num_blocks} blocks x {args.block_size}")
    print("| kv policy | hit rate | mean TTFT s | p50 s | p90 s | mean queue s |\n|---|---|---|---|---|---|")
    runs = {name: placer(RoutingConfig(**routing)) for name, routing in VARIANTS.items()}
    runs["bench.sim.virtual's own (least prefill time ahead)"] = None
    runs["sglang-router cache_aware (emulated, its defaults)"] = sglang_cache_aware()
    for name, place in runs.items():
        outs = vt.run(vt.replay_engines(items, place=place, workers=args.workers, num_blocks=args.num_blocks,
                                        block_size=args.block_size))
        s = vt.summary(outs)
        print(f"| {name} | {100 * s['hit_rate']:.1f}% | {s['ttft_mean_s']:.3f} | {s['ttft_p50_s']:.3f} | "
              f"{s['ttft_p90_s']:.3f} | {s['queue_mean_s']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
