"""``kvgate demo`` (``make demo``): a simulated fleet of 4 vLLM workers behind the kvgate gateway (in-memory
index, no Redis, no GPU), a slice of the Mooncake conversation trace replayed through ``kv`` and through
``round_robin``, the comparison table, and a plot. About two minutes of replay."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import replay as rp
from bench import replay_workloads as wl


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--start", type=float, default=0.0, help="trace slice start (trace seconds)")
    p.add_argument("--duration", type=float, default=300.0, help="trace slice length (trace seconds)")
    p.add_argument("--time-scale", type=float, default=5.0, help="replay this many times faster")
    p.add_argument("--num-blocks", type=int, default=62_500, help="KV capacity per worker (blocks): 1M tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=128, help="cap on each request's output tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=32_000,
                   help="leave out longer trace requests (the few 100K-token prompts would saturate 4 workers)")
    p.add_argument("--policies", default="kv,round_robin")
    p.add_argument("--out", default="kvgate-demo", help="directory for the plot, JSON and logs")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from bench.sim.harness import Target, run_target
    from bench.sim.tokenizer import save_model_dir

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = str(save_model_dir(out / "sim-model"))
    rows = wl.load_trace()
    # requests that cannot fit in one worker's KV cache are left out (a real server would refuse them too)
    fit = min(args.num_blocks * args.block_size - args.max_tokens_cap, args.max_prompt_tokens)
    items = wl.trace_items(rows, start_s=args.start, duration_s=args.duration, max_tokens_cap=args.max_tokens_cap,
                           max_prompt_tokens=fit)
    sliced = wl.select_rows(rows, start_s=args.start, duration_s=args.duration, max_prompt_tokens=fit)
    ceiling = wl.trace_ceiling(sliced)
    print(f"kvgate demo: {args.workers} simulated workers ({args.num_blocks} blocks x {args.block_size} tokens "
          f"each), {len(items)} trace requests from {args.start:.0f}s to {args.start + args.duration:.0f}s, "
          f"replayed {args.time_scale:g}x faster; ceiling {100 * ceiling:.1f}%", flush=True)
    results = []
    t0 = time.monotonic()
    for pol in [p.strip() for p in args.policies.split(",") if p.strip()]:
        print(f"- policy {pol} ...", flush=True)
        res = run_target(Target(pol, "kvgate", pol), items, log_dir=out / "logs", workers=args.workers,
                         num_blocks=args.num_blocks, block_size=args.block_size, time_scale=args.time_scale,
                         tokenizer_dir=tok_dir, ceiling=ceiling, progress=not args.no_progress)
        results.append(res)
    sums = [r.summary() for r in results]
    print()
    print(rp.table(sums, baseline="round_robin" if any(s["name"] == "round_robin" for s in sums) else None))
    png = rp.plot(results, out / "demo.png", title=f"kvgate demo: {args.workers} simulated workers, Mooncake trace")
    js = rp.write_json(results, out / "demo.json", {"args": vars(args)})
    print(f"\nplot: {png}\nraw results: {js}\n(total {time.monotonic() - t0:.0f} s; TTFT in trace seconds)")
    return 0 if all(s["failed"] == 0 for s in sums) else 2
