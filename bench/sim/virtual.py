"""The fleet's engines on a virtual clock: no HTTP, no gateway, no wall time.

``VirtualLoop`` is an asyncio event loop whose clock jumps to the next timer instead of sleeping, so the
simulated engines' step loop (``bench.sim.engine``) runs as fast as the CPU allows and its timings are exactly
the timing model's, whatever else the machine is doing. ``replay_engines`` sends a workload straight to a set
of engines (sharing a G4 store or not) with a simple cache- and load-aware placement, and returns per request
its queue time, prefill time (G4 load included) and TTFT in model seconds.

It separates the engine model from everything around it: in a full benchmark (``bench.bench_g4_sim``) the
fleet, the gateway and the replayer share the machine's cores and every wall-clock delay is multiplied by the
time scale; here only the model counts. Used by ``python -m bench.sim.virtual`` and by the tests.

``python -m bench.sim.virtual --workers 8,6,5,4`` sweeps the fleet size (the load: the trace's own arrivals on
fewer engines; ``--rate`` compresses the arrivals instead) and prints, per point and G4 off/on, the hit rate
against the trace's ceiling, TTFT, the engines' utilisation (model seconds of steps over the virtual time)
and the mean TTFT per window of arrivals, which shows whether the queue grows without bound."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
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
        g4 = c.g4_run(hashes, hit)
        cached = (hit + g4) * c.block_size
        # model seconds of prefill ahead of it (queued, loading from G4 and unfinished prompts), then its own
        cost = sum(t.chunk_s(len(r.tokens) - r.computed, r.computed) + t.start_s(r.computed)
                   for q in (e.waiting, e._loading) for r in q)
        cost += sum(t.chunk_s(len(r.tokens) - r.computed, r.computed) for r in e._running if not r.n_out)
        cost += t.prefill_s(len(tokens) - cached, cached, g4 * c.block_size)
        if best_cost is None or cost < best_cost:
            best, best_cost = i, cost
    return best


class Replay(list):
    """The outcomes by arrival, plus what the engines did: ``busy_s`` (model seconds of steps run, per
    engine, decode-only steps included; async G4 loads run beside the steps and are not in it),
    ``prefill_work_s`` (model seconds of prefill compute of all requests, the timing model's start and
    chunk costs, without step overheads) and ``span_s`` (first arrival to the last request's end, virtual
    seconds)."""

    busy_s: list[float]
    prefill_work_s: float
    span_s: float

    @property
    def utilisation(self) -> list[float]:
        return [b / self.span_s if self.span_s > 0 else 0.0 for b in self.busy_s]

    @property
    def prefill_utilisation(self) -> float:
        """The fleet's share of time spent computing prefills: the load that queues a request's TTFT."""
        return self.prefill_work_s / (len(self.busy_s) * self.span_s) if self.span_s > 0 else 0.0


async def replay_engines(items, *, workers: int, num_blocks: int, block_size: int = 16, g4: bool = False,
                         timing: TimingModel = DEFAULT_TIMING, g4_capacity_blocks: int = 100_000_000,
                         place=None) -> Replay:
    """Run ``items`` (``WorkItem``s, arrival in model seconds) through ``workers`` engines; call on a
    :class:`VirtualLoop` (:func:`run`). ``place(engines, tokens) -> index``: the placement (default: the
    least prefill time ahead, :func:`_place`)."""
    place = place or _place
    store = SharedG4Store(g4_capacity_blocks) if g4 else None
    engines = [SimEngine(PrefixCache(num_blocks, block_size, g4=store), None, timing.with_(time_scale=1.0))
               for _ in range(workers)]
    for e in engines:
        e.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out = Replay()

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
            w = place(engines, tokens)  # submitted now: the next placement sees it queued
            tasks.append(asyncio.create_task(one(item, engines[w].submit(tokens, int(item.max_tokens)), w)))
        await asyncio.gather(*tasks)
        out.span_s = loop.time() - t0
    finally:
        for e in engines:
            await e.stop()
    out.sort(key=lambda o: o.at)
    out.busy_s = [e.clock for e in engines]
    out.prefill_work_s = sum(timing.prefill_s(o.prompt - o.cached, o.cached) for o in out)
    return out


def _mean(xs) -> float | None:
    return float(np.mean(xs)) if len(xs) else None


def summary(outs: Sequence[Outcome]) -> dict:
    prompt = sum(o.prompt for o in outs)
    ttft = [o.ttft_s for o in outs]
    s = {"requests": len(outs), "hit_rate": sum(o.cached for o in outs) / prompt if prompt else 0.0,
         "g4_share": sum(o.g4 for o in outs) / prompt if prompt else 0.0,
         "ttft_mean_s": _mean(ttft), "ttft_p50_s": float(np.median(ttft)),
         "ttft_p90_s": float(np.percentile(ttft, 90)),
         "queue_mean_s": _mean([o.queue_s for o in outs]), "prefill_mean_s": _mean([o.prefill_s for o in outs])}
    if isinstance(outs, Replay):
        u = outs.utilisation
        # drain_s: from the last arrival to the last request's end; a backlog left at the end (a fleet that
        # cannot keep up) makes it long, and makes the utilisations (over span_s) understate the load offered
        s.update(util_mean=float(np.mean(u)), util_max=float(np.max(u)),
                 prefill_util=outs.prefill_utilisation, span_s=outs.span_s,
                 drain_s=outs.span_s - max((o.at for o in outs), default=0.0))
    return s


def windows(outs: Sequence[Outcome], width_s: float) -> list[dict]:
    """Mean TTFT and queue of the requests arriving in each ``width_s`` window: a queue that grows window
    after window (without bound over the trace) marks a fleet that cannot keep up."""
    by: dict[int, list[Outcome]] = {}
    for o in outs:
        by.setdefault(int(o.at // width_s), []).append(o)
    return [{"start_s": k * width_s, "requests": len(v), "ttft_mean_s": _mean([o.ttft_s for o in v]),
             "queue_mean_s": _mean([o.queue_s for o in v])} for k, v in sorted(by.items())]


def _floats(text: str, cast=float) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(points: list[dict]) -> str:
    """The sweep as a Markdown table: one row per fleet size and rate, G4 off and on side by side."""
    head = ("| engines | rate | busy off / on | prefill util off / on | hit off | hit on | ceiling "
            "| G4 share | mean TTFT off / on s "
            "| p50 off / on s | p90 off / on s | queue off / on s | prefill off / on s | on/off mean |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        off, on = p["off"], p["on"]
        pair = lambda k: f"{off[k]:.2f} / {on[k]:.2f}"  # noqa: E731
        rows.append(f"| {p['workers']} | {p['rate']:g} | {_pct(off['util_mean'])} / {_pct(on['util_mean'])} "
                    f"| {_pct(off['prefill_util'])} / {_pct(on['prefill_util'])} "
                    f"| {_pct(off['hit_rate'])} | {_pct(on['hit_rate'])} | {_pct(p['ceiling'])} "
                    f"| {_pct(on['g4_share'])} | {pair('ttft_mean_s')} | {pair('ttft_p50_s')} "
                    f"| {pair('ttft_p90_s')} "
                    f"| {pair('queue_mean_s')} | {pair('prefill_mean_s')} "
                    f"| {on['ttft_mean_s'] / off['ttft_mean_s']:.2f}x |")
    return "\n".join(rows)


def window_table(points: list[dict]) -> str:
    """Mean TTFT per window of arrivals, G4 off / on, one row per point; the windows are stretches of the
    trace (``--window`` trace seconds, so ``--window / rate`` virtual seconds at a rate)."""
    n = max(len(p["off_windows"]) for p in points)
    w = points[0]["window_s"]
    head = "| engines | rate | " + " | ".join(f"trace {int(i * w)}-{int((i + 1) * w)} s" for i in range(n))
    head += " |"
    rows = [head, "|" + "---|" * (n + 2)]
    for p in points:
        cells = [f"{a['ttft_mean_s']:.2f} / {b['ttft_mean_s']:.2f}"
                 for a, b in zip(p["off_windows"], p["on_windows"])]
        rows.append(f"| {p['workers']} | {p['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from bench import replay_workloads as wl

    p = argparse.ArgumentParser(prog="python -m bench.sim.virtual", description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="8", help="engines, or a comma-separated list to sweep (8,6,5,4)")
    p.add_argument("--rate", default="1", help="arrival-rate factor(s): arrivals at the trace's time / rate")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--num-blocks", type=int, default=12_500)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=128)
    p.add_argument("--window", type=float, default=600.0,
                   help="trace seconds per window of the per-window means (virtual: this / rate)")
    p.add_argument("--json", help="write every point (summaries, windows, utilisation per engine) here")
    args = p.parse_args(argv)
    rows = wl.load_trace()
    fit = args.num_blocks * args.block_size - args.max_tokens_cap
    base = wl.trace_items(rows, duration_s=args.duration, max_tokens_cap=args.max_tokens_cap,
                          max_prompt_tokens=fit)
    ceiling = wl.token_ceiling(base, args.block_size)
    print(f"{len(base)} requests, hit-rate ceiling {_pct(ceiling)}", flush=True)
    points = []
    for rate in _floats(args.rate):
        items = [dataclasses.replace(it, at=it.at / rate) for it in base] if rate != 1 else base
        for workers in _floats(args.workers, int):
            point = {"workers": workers, "rate": rate, "ceiling": ceiling, "window_s": args.window}
            for g4 in (False, True):
                outs = run(replay_engines(items, workers=workers, num_blocks=args.num_blocks,
                                          block_size=args.block_size, g4=g4))
                key = "on" if g4 else "off"
                point[key], point[f"{key}_windows"] = summary(outs), windows(outs, args.window / rate)
                point[f"{key}_util"] = outs.utilisation
                print(f"{workers} engines, rate {rate:g}, G4 {key:3}: " + "  ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in point[key].items()))
                per = point[f"{key}_windows"]
                print("  mean TTFT / queue per window: "
                      + " ".join(f"{w['ttft_mean_s']:.2f}/{w['queue_mean_s']:.2f}" for w in per), flush=True)
            points.append(point)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(points, f, indent=1)
    print(table(points))
    print(window_table(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
