"""The fleet's engines on a virtual clock: no HTTP, no gateway, no wall time.

``VirtualLoop`` is an asyncio event loop whose clock jumps to the next timer instead of sleeping, so the
simulated engines' step loop (``bench.sim.engine``) runs as fast as the CPU allows and its timings are exactly
the timing model's, whatever else the machine is doing. ``replay_engines`` sends a workload straight to a set
of engines (sharing a G4 store or not) with a simple cache- and load-aware placement, and returns per request
its queue time, prefill time (G4 load included) and TTFT in model seconds.

It separates the engine model from everything around it: in a full benchmark (``bench.bench_g4_sim``) the
fleet, the gateway and the replayer share the machine's cores and every wall-clock delay is multiplied by the
time scale; here only the model counts. Used by ``python -m bench.sim.virtual`` and by the tests."""
from __future__ import annotations

import argparse
import asyncio
import selectors
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.sim.cache import PrefixCache, SharedG4Store, external
from bench.sim.engine import SimEngine
from bench.sim.timing import DEFAULT_TIMING, TimingModel


class _JumpSelector(selectors.DefaultSelector):
    """Polls without blocking; when nothing is ready, the loop's clock jumps by the timeout instead."""

    loop: VirtualLoop

    def select(self, timeout=None):
        ready = super().select(0)
        if not ready and timeout:
            self.loop.now += timeout
        elif not ready and timeout is None:
            raise RuntimeError("virtual loop: nothing scheduled and nothing to wait for")
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        sel = _JumpSelector()
        super().__init__(sel)
        sel.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def run(coro):
    """``asyncio.run`` on a fresh :class:`VirtualLoop`."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@dataclass
class Outcome:
    at: float
    prompt: int
    cached: int          # local hit + G4 tokens
    g4: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    worker: int


def _place(engines: Sequence[SimEngine], tokens: list[int]) -> int:
    """Least prefill time ahead of it and of its own, on the timing model: its local hit, then G4.
    Every engine has the same chain root, so the prompt is hashed once."""
    c0 = engines[0].cache
    digests = c0.digests(tokens)
    limit = min(len(digests), (len(tokens) - 1) // c0.block_size)
    hashes = [external(d) for d in digests[:limit]]
    best, best_cost = 0, None
    for i, e in enumerate(engines):
        c, t = e.cache, e.timing
        hit = c.longest_hit(digests, len(tokens), hashes)
        g4 = 0
        if c.g4 is not None:
            while hit + g4 < limit and hashes[hit + g4] in c.g4:
                g4 += 1
        cached = (hit + g4) * c.block_size
        # model seconds of prefill ahead of it (queued and unfinished prompts), then its own
        cost = sum(t.chunk_s(len(r.tokens) - r.computed, r.computed) + t.start_s(r.computed)
                   for r in e.waiting)
        cost += sum(t.chunk_s(len(r.tokens) - r.computed, r.computed) for r in e._running if not r.n_out)
        cost += t.prefill_s(len(tokens) - cached, cached, g4 * c.block_size)
        if best_cost is None or cost < best_cost:
            best, best_cost = i, cost
    return best


async def replay_engines(items, *, workers: int, num_blocks: int, block_size: int = 16, g4: bool = False,
                         timing: TimingModel = DEFAULT_TIMING, g4_capacity_blocks: int = 100_000_000
                         ) -> list[Outcome]:
    """Run ``items`` (``WorkItem``s, arrival in model seconds) through ``workers`` engines; call on a
    :class:`VirtualLoop` (:func:`run`)."""
    store = SharedG4Store(g4_capacity_blocks) if g4 else None
    engines = [SimEngine(PrefixCache(num_blocks, block_size, g4=store), None, timing.with_(time_scale=1.0))
               for _ in range(workers)]
    for e in engines:
        e.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out: list[Outcome] = []

    async def one(item, r, w: int):
        while await r.out.get() is not None:
            pass
        a = r.alloc
        out.append(Outcome(item.at, len(r.tokens), r.cached_tokens, (a.g4_blocks if a else 0) * block_size,
                           r.scheduled_at - r.arrival, r.prefill_s, r.scheduled_at - r.arrival + r.prefill_s, w))

    tasks = []
    try:
        for item in items:
            delay = t0 + item.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tokens = [int(x) for x in item.tokens]
            w = _place(engines, tokens)  # submitted now: the next placement sees it queued
            tasks.append(asyncio.create_task(one(item, engines[w].submit(tokens, int(item.max_tokens)), w)))
        await asyncio.gather(*tasks)
    finally:
        for e in engines:
            await e.stop()
    out.sort(key=lambda o: o.at)
    return out


def summary(outs: Sequence[Outcome]) -> dict:
    f = lambda xs: float(np.mean(xs)) if len(xs) else None  # noqa: E731
    prompt = sum(o.prompt for o in outs)
    return {"requests": len(outs), "hit_rate": sum(o.cached for o in outs) / prompt if prompt else 0.0,
            "g4_share": sum(o.g4 for o in outs) / prompt if prompt else 0.0,
            "ttft_mean_s": f([o.ttft_s for o in outs]), "ttft_p50_s": float(np.median([o.ttft_s for o in outs])),
            "ttft_p90_s": float(np.percentile([o.ttft_s for o in outs], 90)),
            "queue_mean_s": f([o.queue_s for o in outs]), "prefill_mean_s": f([o.prefill_s for o in outs])}


def main(argv: list[str] | None = None) -> int:
    from bench import replay_workloads as wl

    p = argparse.ArgumentParser(prog="python -m bench.sim.virtual", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--num-blocks", type=int, default=12_500)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=128)
    args = p.parse_args(argv)
    rows = wl.load_trace()
    fit = args.num_blocks * args.block_size - args.max_tokens_cap
    items = wl.trace_items(rows, duration_s=args.duration, max_tokens_cap=args.max_tokens_cap,
                           max_prompt_tokens=fit)
    for g4 in (False, True):
        outs = run(replay_engines(items, workers=args.workers, num_blocks=args.num_blocks,
                                  block_size=args.block_size, g4=g4))
        s = summary(outs)
        print(f"G4 {'on ' if g4 else 'off'}: " + "  ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
