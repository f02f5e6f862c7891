"""Policies and peers side by side: ``python -m bench.side_by_side``.

One command, the same simulated fleet (fresh for every run) and the same slice of the Mooncake conversation
trace, sent as the same text prompts to: kvgate ``kv`` with the Redis index and with the in-memory index,
``round_robin``, ``least_loaded``, ``session``, and the peer routers ``sglang-router`` and ``vllm-router``
(policy ``cache_aware``; installed by name from PyPI into their own virtualenvs under
~/.cache/kvgate/peers). Fleet sizes 4 and 16 by default. Writes a Markdown table per fleet size, a PNG and
raw JSON per fleet size under --out. Every request carries its conversation's id (``x-session-id``,
derived from the trace: ``replay_workloads.conversation_ids``), which only ``session`` reads; before
session 37 none was sent and ``session`` was the ``kv`` policy run a second time.

``--rounds N`` runs every target N times per fleet size, the targets' positions balanced
(``bench.sim.harness.order_of``: pairs of rounds, an order and its reverse), and reports
each kvgate target's per-round mean TTFT ratio and hit-rate difference against sglang-router (taken only
between targets of one round) with their median. Why: the targets run one after the other, ~75 s each,
and the host's speed drifts between them: the simulator's CPU seconds for the same work varied 26-39 s
between targets of one session, and both routers' mean TTFT followed them (docs/BENCHMARKS.md, session
33), more than the changes measured."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench import replay as rp
from bench import replay_workloads as wl
from bench.capacity_bound import median_interval
from bench.sim import procs
from bench.sim.harness import PEER_PINS, Target, order_of, overrides, peer_version, run_target
from bench.sim.tokenizer import save_model_dir


# ``--kv-before``: the kv policy without the scorers that look past the request (hysteresis, footprint)
BEFORE = "kvgate kv (memory, no continuity or footprint)"
ROUTING = {BEFORE: {"future_turns": 0.0, "stay_margin": 0.0, "stay_margin_ms": 0.0, "footprint_weight": 0.0}}


def variant(spec: str) -> tuple[str, dict]:
    """``--kv-variant future_turns=3,stay_margin=0.3``: a kvgate kv (memory) target with those routing
    settings, named after them; ``tokenizer.defer_tail_bytes=4096`` sets another section's."""
    return f"kvgate kv (memory, {spec})", overrides(spec)


PEER = "sglang-router cache_aware"
RR = "kvgate round_robin"  # the baseline of the table


def vs_peer(rounds: list[dict[str, dict]], peer: str = PEER) -> list[str]:
    """Per target but the peer, over the rounds (target name -> its run's summary, per round): the median of
    its per-round mean TTFT ratios and hit-rate differences against the peer's run in the same round, the
    interval for each median (bench.capacity_bound.median_interval), the rounds it was faster in and those
    it led on both."""
    out = []
    for name in dict.fromkeys(k for r in rounds for k in r):
        if name == peer:
            continue
        pairs = [(r[name], r[peer]) for r in rounds
                 if name in r and peer in r and r[name].get("ttft_mean_s") and r[peer].get("ttft_mean_s")]
        if not pairs:
            continue
        ratios = [a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in pairs]
        points = [100.0 * (a["hit_rate"] - b["hit_rate"]) for a, b in pairs]
        line = f"{name} vs {peer} over {len(pairs)} rounds: mean TTFT {statistics.median(ratios):.2f}x"
        if iv := median_interval(ratios):
            line += f" ({iv[0]:.2f}-{iv[1]:.2f}x, a {iv[2]:.0%} interval for the median)"
        line += f", hit rate {statistics.median(points):+.1f} points"
        if iv := median_interval(points):
            line += f" ({iv[0]:+.1f} to {iv[1]:+.1f})"
        both = sum(1 for x, y in zip(ratios, points) if x < 1.0 and y > 0.0)
        line += f"; faster in {sum(1 for x in ratios if x < 1.0)}, ahead on both in {both}"
        out.append(line)
    return out


def targets(text: bool, redis: bool, include: set[str] | None, with_ids: bool = False,
            before: bool = False, variants: list[str] = ()) -> list[Target]:
    ts = []
    if redis:
        ts.append(Target("kvgate kv (redis)", "kvgate", "kv", "redis", text))
    ts.append(Target("kvgate kv (memory)", "kvgate", "kv", "memory", text))
    if before:  # the same run, the same fleet: the kv policy before and after its forward-looking terms
        ts.append(Target(BEFORE, "kvgate", "kv", "memory", text))
    for spec in variants:
        name, routing = variant(spec)
        ROUTING[name] = routing
        ts.append(Target(name, "kvgate", "kv", "memory", text))
    if with_ids and text:  # the same routing without the gateway's text path, in the same run
        ts.append(Target("kvgate kv (memory, token ids)", "kvgate", "kv", "memory", False))
    ts += [
        Target(RR, "kvgate", "round_robin", "memory", text),
        Target("kvgate least_loaded", "kvgate", "least_loaded", "memory", text),
        Target("kvgate session", "kvgate", "session", "memory", text),
        Target("sglang-router cache_aware", "sglang-router", "cache_aware", text=True),
        Target("vllm-router cache_aware", "vllm-router", "cache_aware", text=True),
    ]
    if not text:  # name what kvgate is sent: its text path is not in these rows (peers always get text)
        for t in ts:
            if t.kind == "kvgate":
                if t.name in ROUTING:
                    ROUTING[ids_name(t.name)] = ROUTING[t.name]
                t.name = ids_name(t.name)
    if include:
        ts = [t for t in ts if any(k in t.name for k in include)]
    return ts


def ids_name(name: str) -> str:
    """A kvgate target's name when it is sent token ids: ``kvgate kv (memory, token ids)``, ``kvgate
    round_robin (token ids)``."""
    return f"{name[:-1]}, token ids)" if name.endswith(")") else f"{name} (token ids)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.side_by_side", description=__doc__.split("\n")[0])
    p.add_argument("--fleets", default="4,16", help="fleet sizes")
    p.add_argument("--start", type=float, default=0.0)
    p.add_argument("--duration", type=float, default=300.0, help="trace slice length (trace seconds)")
    p.add_argument("--time-scale", type=float, default=5.0)
    p.add_argument("--num-blocks", type=int, default=62_500,
                   help="KV capacity per worker (blocks): 1M tokens, a tenth of the slice's working set")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens-cap", type=int, default=128)
    p.add_argument("--only", default="", help="comma-separated substrings of target names to run")
    p.add_argument("--token-ids", action="store_true",
                   help="send token ids to kvgate targets (peers always get text)")
    p.add_argument("--with-token-ids", action="store_true",
                   help="also run kvgate kv (memory) with token-id prompts, beside the text targets")
    p.add_argument("--kv-before", action="store_true",
                   help="also run kvgate kv (memory) with the continuity and footprint terms off")
    p.add_argument("--kv-variant", action="append", default=[], metavar="KEY=VALUE,...",
                   help="also run kvgate kv (memory) with these routing settings (repeatable)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every target this many times per fleet size, the positions balanced (order_of); "
                        "report per-round ratios against sglang-router and their median")
    p.add_argument("--out", default="bench-results/side-by-side")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = str(save_model_dir(out / "sim-model"))
    rows = wl.load_trace()
    # requests that cannot fit in one worker's KV cache are left out (a real server would refuse them too)
    fit = args.num_blocks * args.block_size - args.max_tokens_cap
    items = wl.trace_items(rows, start_s=args.start, duration_s=args.duration, max_tokens_cap=args.max_tokens_cap,
                           max_prompt_tokens=fit)
    sliced = wl.select_rows(rows, start_s=args.start, duration_s=args.duration, max_prompt_tokens=fit)
    ceiling = wl.trace_ceiling(sliced)
    redis = procs.start_redis(out)
    if redis is None:
        print("redis-server not found: skipping kvgate kv (redis)", file=sys.stderr)
    include = {s.strip() for s in args.only.split(",") if s.strip()} or None
    tlist = targets(not args.token_ids, redis is not None, include, args.with_token_ids, args.kv_before,
                    args.kv_variant)
    report = [f"Command: `python -m bench.side_by_side {' '.join(argv if argv is not None else sys.argv[1:])}`",
              f"Trace slice {args.start:.0f}-{args.start + args.duration:.0f} s ({len(items)} requests), replayed "
              f"{args.time_scale:g}x faster; {args.num_blocks} blocks x {args.block_size} tokens per worker; "
              f"ceiling {100 * ceiling:.1f}%. TTFT in trace seconds.", ""]
    try:
        for n in [int(x) for x in args.fleets.split(",") if x.strip()]:
            results = []
            rounds: list[dict[str, dict]] = []
            for r in range(max(1, args.rounds)):
                rounds.append({})
                for t in order_of(tlist, r) if tlist else []:
                    label = t.name if args.rounds <= 1 else f"{t.name} #{r + 1}"
                    logs = out / f"fleet{n}" / ("logs" if args.rounds <= 1 else f"round{r + 1}/logs")
                    print(f"fleet {n}: {label} ...", flush=True)
                    t0 = time.monotonic()
                    try:
                        res = run_target(t, items, log_dir=logs, workers=n, label=label,
                                         num_blocks=args.num_blocks, block_size=args.block_size,
                                         time_scale=args.time_scale, tokenizer_dir=tok_dir, ceiling=ceiling,
                                         redis_url=redis[1] if redis and t.index == "redis" else None,
                                         progress=not args.no_progress, routing=ROUTING.get(t.name))
                    except Exception as e:  # noqa: BLE001 - one failed target must not lose the others
                        print(f"  {label} failed: {e}", file=sys.stderr)
                        report.append(f"- fleet {n}, {label}: could not run: {str(e).splitlines()[0]}")
                        continue
                    results.append(res)
                    s = res.summary()
                    rounds[-1][t.name] = s
                    iv = res.extra.get("index_view") or {}
                    drift = (f"  index {iv['index_gpu']} / engines {iv['engine_blocks']} GPU blocks"
                             if "index_gpu" in iv else "")
                    print(f"  hit {100 * s['hit_rate']:.1f}%  mean TTFT {s['ttft_mean_s'] or 0:.2f}s  "
                          f"failed {s['failed']}{drift}  ({time.monotonic() - t0:.0f}s)", flush=True)
            if not results:
                continue
            sums = [r.summary() for r in results]
            tab = rp.table(sums, baseline=ids_name(RR) if args.token_ids else RR)
            ref = wl.trace_ceiling(sliced, n * (args.num_blocks - 1) * args.block_size)  # less the null block
            note = (f"LRU reference {100 * ref:.1f}%: one least-recently-used cache of the fleet's whole KV "
                    f"({n} x {args.num_blocks} blocks) over the slice; cache-aware routers in front of LRU "
                    f"engines get about this much (ceiling {100 * ceiling:.1f}%).")
            print(f"\nfleet of {n}:\n{tab}\n{note}\n")
            report += [f"### {n} workers", "", tab, "", note, ""]
            if args.rounds > 1:
                lines = vs_peer(rounds)
                print("\n".join(lines) + "\n")
                report += [f"- {x}" for x in lines] + [""]
            rp.plot(results, out / f"fleet{n}.png", title=f"{n} simulated workers, Mooncake conversation trace")
            rp.write_json(results, out / f"fleet{n}.json",
                          {"args": vars(args), "fleet": n, "lru_reference": ref, "ceiling": ceiling,
                           "peer_versions": {k: peer_version(k) for k in PEER_PINS}})
    finally:
        if redis is not None:
            redis[0].stop()
    (out / "report.md").write_text("\n".join(report) + "\n")
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
