"""G4 on and off in the fleet simulator: ``python -m bench.bench_g4_sim``.

One command, one run: the same simulated fleet size, the same slice of the Mooncake conversation trace and a
per-worker GPU KV cache too small to keep the slice's working set, replayed through kvgate ``kv`` (in-memory
index) with the fleet's shared G4 store off, then on (capacity large enough to never evict), and through
``round_robin`` with G4 on for reference. Reports hit rate (the workers' own ``cached_tokens`` over prompt
tokens; G4 loads count as cached, as vLLM reports external hits), the slice's ceiling (an unlimited single
cache, ``trace_ceiling``), hit rate as a share of that ceiling, TTFT p50/p90 and mean latency, and what the
gateway saw of G4 (index G4 blocks learnt from the workers' STORAGE events; decisions that counted G4 blocks).
Each target runs on a fresh fleet and gateway (empty caches) through ``bench.sim.harness.run_target``."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import replay as rp
from bench import replay_workloads as wl
from bench.sim.harness import Target, run_target
from bench.sim.timing import DEFAULT_TIMING
from bench.sim.tokenizer import save_model_dir

GOAL_SHARE = 0.9  # the goal: hit rate >= 90% of the ceiling with G4


def targets(text: bool = False) -> list[Target]:
    return [
        Target("kvgate kv, G4 off", "kvgate", "kv", "memory", text),
        Target("kvgate kv, G4 on", "kvgate", "kv", "memory", text, g4=True),
        Target("kvgate round_robin, G4 on", "kvgate", "round_robin", "memory", text, g4=True),
    ]


def gateway_routing(block_size: int, decisions: int) -> dict:
    """Price G4 loads as the simulator does (its KV bytes per block and G4 read bandwidth) and keep every
    decision of the run for the G4 check."""
    t = DEFAULT_TIMING
    return {"g4_bytes_per_block": t.kv_bytes_per_token * block_size, "g4_bytes_per_s": t.g4_read_bytes_per_s,
            "decisions_kept": max(1000, decisions)}


def compare(items: Sequence[wl.WorkItem], *, ceiling: float, workers: int, num_blocks: int, block_size: int,
            time_scale: float, out: Path, tlist: Sequence[Target] | None = None,
            g4_capacity_blocks: int = 100_000_000, progress: bool = True, log=print) -> list[rp.RunResult]:
    """Run every target on a fresh fleet over the same ``items``; results in target order."""
    tok_dir = str(save_model_dir(out / "sim-model"))
    results = []
    for t in tlist or targets():
        log(f"{t.name} ...")
        t0 = time.monotonic()
        res = run_target(t, items, log_dir=out / "logs", workers=workers, num_blocks=num_blocks,
                         block_size=block_size, time_scale=time_scale, tokenizer_dir=tok_dir, ceiling=ceiling,
                         progress=progress, g4_capacity_blocks=g4_capacity_blocks,
                         routing=gateway_routing(block_size, len(items)))
        s = res.summary()
        log(f"  hit {100 * s['hit_rate']:.1f}% (ceiling {100 * ceiling:.1f}%)  TTFT p50 {s['ttft_p50_s'] or 0:.2f}s"
            f"  failed {s['failed']}  gateway G4: {s.get('gateway_g4', '-')}  ({time.monotonic() - t0:.0f}s)")
        results.append(res)
    return results


def table(sums: Sequence[dict]) -> str:
    head = ["target", "hit rate", "ceiling", "share of ceiling", "TTFT p50 s", "TTFT p90 s", "mean TTFT s",
            "mean latency s", "G4 blocks in index", "decisions with G4", "failed"]
    rows = []
    for s in sums:
        c = s.get("ceiling") or 0.0
        g = s.get("gateway_g4") or {}
        rows.append([s["name"], rp._fmt(s["hit_rate"], True), rp._fmt(c, True),
                     rp._fmt(s["hit_rate"] / c if c else None, True), rp._fmt(s["ttft_p50_s"]),
                     rp._fmt(s["ttft_p90_s"]), rp._fmt(s["ttft_mean_s"]), rp._fmt(s["e2e_mean_s"]),
                     str(g["index_g4_blocks"]) if "index_g4_blocks" in g else "-",
                     f"{g['decisions_with_g4']}/{g['decisions']}" if "decisions" in g else "-",
                     f"{s['failed']}/{s['requests']}"])
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *["| " + " | ".join(r) + " |" for r in rows]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_g4_sim", description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=900.0, help="trace slice length (trace seconds)")
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--num-blocks", type=int, default=12_500,
                   help="GPU KV capacity per worker (blocks): 200K tokens, far below the slice's working set")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--g4-capacity-blocks", type=int, default=100_000_000, help="never evicts in these slices")
    p.add_argument("--max-tokens-cap", type=int, default=128)
    p.add_argument("--text", action="store_true", help="send text prompts (default: token ids, cheaper)")
    p.add_argument("--out", default="bench-results/g4-sim")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = wl.load_trace()
    fit = args.num_blocks * args.block_size - args.max_tokens_cap
    items = wl.trace_items(rows, start_s=args.start, duration_s=args.duration, max_tokens_cap=args.max_tokens_cap,
                           max_prompt_tokens=fit)
    ceiling = wl.trace_ceiling(wl.select_rows(rows, start_s=args.start, duration_s=args.duration,
                                              max_prompt_tokens=fit))
    t0 = time.monotonic()
    results = compare(items, ceiling=ceiling, workers=args.workers, num_blocks=args.num_blocks,
                      block_size=args.block_size, time_scale=args.time_scale, out=out,
                      tlist=targets(args.text), g4_capacity_blocks=args.g4_capacity_blocks,
                      progress=not args.no_progress)
    sums = [r.summary() for r in results]
    tab = table(sums)
    on = next(s for s in sums if s["name"] == "kvgate kv, G4 on")
    share = on["hit_rate"] / ceiling if ceiling else 0.0
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    report = [f"Command: `python -m bench.bench_g4_sim{(' ' + cmd) if cmd else ''}` ({time.monotonic() - t0:.0f} s)",
              f"Trace slice {args.start:.0f}-{args.start + args.duration:.0f} s ({len(items)} requests), replayed "
              f"{args.time_scale:g}x faster; {args.workers} workers x {args.num_blocks} blocks x {args.block_size} "
              f"tokens of GPU KV; G4 capacity {args.g4_capacity_blocks} blocks; ceiling of the slice "
              f"{100 * ceiling:.1f}% (37.4% on the full trace). TTFT and latency in trace seconds.", "", tab, "",
              f"kv with G4: {100 * share:.0f}% of the ceiling (goal >= {100 * GOAL_SHARE:.0f}%: "
              f"{'met' if share >= GOAL_SHARE else 'not met'})."]
    print("\n".join(report))
    (out / "report.md").write_text("\n".join(report) + "\n")
    rp.write_json(results, out / "results.json", {"args": vars(args), "ceiling": ceiling})
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
