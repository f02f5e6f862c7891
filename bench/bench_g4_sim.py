"""G4 on and off in the fleet simulator: ``python -m bench.bench_g4_sim``.

One command, one run: the same simulated fleet size, the same slice of the Mooncake conversation trace and a
per-worker GPU KV cache too small to keep the slice's working set, replayed through kvgate ``kv`` (in-memory
index) with the fleet's shared G4 store off, then on (capacity large enough to never evict), and through
``round_robin`` with G4 on for reference. Reports hit rate (the workers' own ``cached_tokens`` over prompt
tokens; G4 loads count as cached, as vLLM reports external hits), the slice's ceiling (an unlimited single
cache, ``trace_ceiling``), hit rate as a share of that ceiling, TTFT p50/p90 and mean latency, and what the
gateway saw of G4 (index G4 blocks learnt from the workers' STORAGE events; decisions that counted G4 blocks),
and where TTFT went (``breakdown``: the engines' own queue and prefill time, the time outside them, CPU seconds
per process). ``python -m bench.sim.virtual`` runs the same engines on a virtual clock, without the gateway.
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


TARGET_KEYS = ("off", "on", "rr")


def targets(text: bool = False, keys: Sequence[str] = TARGET_KEYS) -> list[Target]:
    """``keys``: which of kv G4 off (``off``), kv G4 on (``on``), round_robin G4 on (``rr``), in that order."""
    all_ = {
        "off": Target("kvgate kv, G4 off", "kvgate", "kv", "memory", text),
        "on": Target("kvgate kv, G4 on", "kvgate", "kv", "memory", text, g4=True),
        "rr": Target("kvgate round_robin, G4 on", "kvgate", "round_robin", "memory", text, g4=True),
    }
    return [all_[k] for k in TARGET_KEYS if k in keys]


def gateway_routing(block_size: int, decisions: int, time_scale: float = 1.0) -> dict:
    """Price G4 loads as the simulator runs them (its KV bytes per block and G4 read bandwidth) and keep
    every decision of the run for the G4 check.

    The gateway lives on the wall clock: it calibrates prefill speed from the TTFTs it observes, which a
    fleet replayed ``time_scale`` times faster delivers that much faster, and the fleet loads G4 blocks that
    much faster too. So the bandwidth it is told is the simulator's times ``time_scale``; unscaled, a G4
    block looked 10x dearer than it is at the default 10x, dearer than recomputing it, and kv piled
    requests onto the workers holding a local prefix rather than send them to an idle one to load."""
    t = DEFAULT_TIMING
    return {"g4_bytes_per_block": t.kv_bytes_per_token * block_size,
            "g4_bytes_per_s": t.g4_read_bytes_per_s * time_scale,
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
                         routing=gateway_routing(block_size, len(items), time_scale))
        s = res.summary()
        log(f"  hit {100 * s['hit_rate']:.1f}% (ceiling {100 * ceiling:.1f}%)  TTFT p50 {s['ttft_p50_s'] or 0:.2f}s"
            f"  failed {s['failed']}  gateway G4: {s.get('gateway_g4', '-')}  ({time.monotonic() - t0:.0f}s)")
        results.append(res)
    return results


def breakdown(sums: Sequence[dict]) -> str:
    """Where each target's TTFT went: the engines' own means (queue: arrival -> scheduled; prefill:
    scheduled -> first token, G4 loads included), what the gateway and the loopback added on top (the
    replayer's mean TTFT minus the engines'), and the CPU seconds each process used during the replay (on a
    machine short of cores every wall-clock delay counts time-scale times in trace seconds)."""
    head = ["target", "mean TTFT s", "engine TTFT s", "engine queue s", "engine prefill s", "outside engine s",
            "G4 tokens / request", "computed tokens / request", "CPU s gateway", "CPU s fleet", "CPU s replayer", "load avg"]
    rows = []
    for s in sums:
        e = s.get("engine") or {}
        cpu = s.get("cpu_s") or {}
        out = (s["ttft_mean_s"] - e["ttft_mean_s"]) if s.get("ttft_mean_s") is not None and e.get(
            "ttft_mean_s") is not None else None
        la = s.get("loadavg")
        rows.append([s["name"], rp._fmt(s["ttft_mean_s"]), rp._fmt(e.get("ttft_mean_s")),
                     rp._fmt(e.get("queue_mean_s")), rp._fmt(e.get("prefill_mean_s")), rp._fmt(out),
                     rp._fmt(e.get("g4_tokens_mean"), digits=0), rp._fmt(e.get("computed_tokens_mean"), digits=0),
                     rp._fmt(cpu.get("router"), digits=0), rp._fmt(cpu.get("fleet"), digits=0),
                     rp._fmt(cpu.get("replayer"), digits=0),
                     f"{la[0]:.1f}-{la[1]:.1f}" if la else "-"])
    return _md(head, rows)


def _md(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *["| " + " | ".join(r) + " |" for r in rows]])


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
    return _md(head, rows)


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
    p.add_argument("--targets", default=",".join(TARGET_KEYS),
                   help="comma-separated: off (kv, G4 off), on (kv, G4 on), rr (round_robin, G4 on)")
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
                      tlist=targets(args.text, args.targets.split(",")), g4_capacity_blocks=args.g4_capacity_blocks,
                      progress=not args.no_progress)
    sums = [r.summary() for r in results]
    tab = table(sums)
    on = next((s for s in sums if s["name"] == "kvgate kv, G4 on"), None)
    off = next((s for s in sums if s["name"] == "kvgate kv, G4 off"), None)
    share = on["hit_rate"] / ceiling if on and ceiling else 0.0
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    report = [f"Command: `python -m bench.bench_g4_sim{(' ' + cmd) if cmd else ''}` ({time.monotonic() - t0:.0f} s)",
              f"Trace slice {args.start:.0f}-{args.start + args.duration:.0f} s ({len(items)} requests), replayed "
              f"{args.time_scale:g}x faster; {args.workers} workers x {args.num_blocks} blocks x {args.block_size} "
              f"tokens of GPU KV; G4 capacity {args.g4_capacity_blocks} blocks; ceiling of the slice "
              f"{100 * ceiling:.1f}% (37.4% on the full trace). TTFT and latency in trace seconds.", "", tab, "",
              breakdown(sums), ""]
    if on:
        report.append(f"kv with G4: {100 * share:.0f}% of the ceiling (goal >= {100 * GOAL_SHARE:.0f}%: "
                      f"{'met' if share >= GOAL_SHARE else 'not met'}).")
    if on and off and on["ttft_mean_s"] and off["ttft_mean_s"]:
        report.append(f"kv mean TTFT, G4 on / G4 off: {on['ttft_mean_s'] / off['ttft_mean_s']:.2f}x.")
    print("\n".join(report))
    (out / "report.md").write_text("\n".join(report) + "\n")
    rp.write_json(results, out / "results.json", {"args": vars(args), "ceiling": ceiling})
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
