"""``kvgate replay``: replay the Mooncake conversation trace (or a synthetic workload) against an
OpenAI-compatible endpoint and report hit rate, TTFT percentiles, latency, throughput and the ceiling."""
from __future__ import annotations

import argparse
import asyncio
import sys

from bench import replay as rp
from bench import replay_workloads as wl


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8080", help="endpoint (gateway or router) base URL")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--workload", choices=wl.WORKLOADS, default="trace")
    p.add_argument("--trace", default=None, help=f"trace file, JSONL or .xz (default: the repository's bench/traces/{wl.TRACE_FILE})")
    p.add_argument("--start", type=float, default=0.0, help="trace slice start, trace seconds")
    p.add_argument("--duration", type=float, default=None, help="trace slice length, trace seconds")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="skip longer trace requests")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap each request's output length")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="replay this many times faster (use the simulator's --time-scale)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--text", action="store_true", help="send prompts as text instead of token ids")
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--worker", action="append", default=[],
                   help="a worker URL whose /metrics to read before and after (repeatable)")
    p.add_argument("--name", default="run")
    p.add_argument("--json", default=None, help="write raw results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--block-size", type=int, default=16, help="engine block size for the token-level ceiling")
    p.add_argument("--no-progress", action="store_true")


def build_items(args) -> tuple[list[wl.WorkItem], float]:
    if args.workload == "trace":
        rows = wl.load_trace(args.trace)
        items = wl.trace_items(rows, start_s=args.start, duration_s=args.duration, limit=args.limit,
                               max_prompt_tokens=args.max_prompt_tokens, max_tokens_cap=args.max_tokens_cap)
        sliced = wl.select_rows(rows, start_s=args.start, duration_s=args.duration, limit=args.limit,
                                max_prompt_tokens=args.max_prompt_tokens)
        return items, wl.trace_ceiling(sliced)
    gen = {"chat": wl.chat_items, "rag": wl.rag_items, "agent": wl.agent_items}[args.workload]
    items = gen()
    if args.limit:
        items = items[: args.limit]
    return items, wl.token_ceiling(items, args.block_size)


def run(args) -> int:
    try:
        items, ceiling = build_items(args)
    except OSError as e:
        print(f"kvgate replay: {e}", file=sys.stderr)
        return 1
    if not items:
        print("kvgate replay: the selection is empty", file=sys.stderr)
        return 1
    res = asyncio.run(rp.replay(items, args.url, args.model, name=args.name, time_scale=args.time_scale,
                                api=args.api, text=args.text, max_inflight=args.max_inflight,
                                timeout_s=args.timeout, worker_urls=args.worker, ceiling=ceiling,
                                progress=not args.no_progress))
    print(rp.table([res.summary()]))
    if args.json:
        rp.write_json([res], args.json, {"workload": args.workload, "url": args.url})
    if args.plot:
        rp.plot([res], args.plot, title=f"{args.workload} via {args.url}")
    return 0 if res.summary()["failed"] == 0 else 2
