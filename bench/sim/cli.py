"""``kvgate sim``: run a simulated vLLM fleet in this process until interrupted.

Prints one line per worker (name, URL, events and replay endpoints) and, with ``--workers-file``, writes
the same as JSON so a gateway config or a benchmark can pick them up."""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from bench.sim.fleet import FleetConfig, SimFleet
from bench.sim.timing import DEFAULT_TIMING, TimingModel
from bench.sim.tokenizer import save_model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4, help="number of simulated vLLM servers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, default=8100, help="worker i listens on base-port + i (0: ephemeral)")
    p.add_argument("--event-base-port", type=int, default=0,
                   help="PUB on event-base-port + 2i, replay on + 2i + 1 (0: ephemeral)")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=21_000, help="KV cache capacity per worker, in blocks")
    p.add_argument("--max-model-len", type=int, default=262_144)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--time-scale", type=float, default=1.0, help="run this many times faster than real time")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_TIMING.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"per-step token budget, chunked prefill (default {DEFAULT_TIMING.max_num_batched_tokens})")
    p.add_argument("--stream-interval", type=int, default=16, help="tokens per streamed chunk")
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--g4", action="store_true", help="share a simulated G4 store between the workers")
    p.add_argument("--g4-capacity-blocks", type=int, default=1_000_000)
    for name in ("overhead_s", "a_s_per_token", "b_s_per_token2", "d_s_per_cached_token", "decode_s",
                 "decode_s_per_seq", "g4_read_bytes_per_s", "g4_sync_load_max_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None,
                       help=f"timing model (default {getattr(DEFAULT_TIMING, name):.4g})")
    p.add_argument("--kv-bytes-per-token", type=int, default=None)
    p.add_argument("--tokenizer-dir", default=None, help="also write the simulator's tokenizer model dir here")
    p.add_argument("--workers-file", default=None, help="write the workers (url, endpoints) as JSON here")


def timing_from_args(args) -> TimingModel:
    kw = {n: getattr(args, n, None) for n in TimingModel.names()
          if n not in ("time_scale", "max_num_seqs")}
    return DEFAULT_TIMING.with_(time_scale=args.time_scale, max_num_seqs=args.max_num_seqs, **kw)


def fleet_config_from_args(args) -> FleetConfig:
    return FleetConfig(workers=args.workers, host=args.host, base_port=args.base_port,
                       event_base_port=args.event_base_port, model=args.model, block_size=args.block_size,
                       num_blocks=args.num_blocks, max_model_len=args.max_model_len, vocab_size=args.vocab_size,
                       timing=timing_from_args(args), g4=args.g4, g4_capacity_blocks=args.g4_capacity_blocks,
                       stream_interval=args.stream_interval, default_max_tokens=args.default_max_tokens)


async def serve(cfg: FleetConfig, workers_file: str | None = None, ready=None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    async with SimFleet(cfg) as fleet:
        desc = fleet.describe()
        for d in desc:
            print(f"{d['name']}  {d['url']}  events={d['events_endpoint']}  replay={d['replay_endpoint']}",
                  flush=True)
        if workers_file:
            with open(workers_file + ".tmp", "w") as f:
                json.dump({"model": cfg.model, "block_size": cfg.block_size, "workers": desc}, f, indent=1)
            import os

            os.replace(workers_file + ".tmp", workers_file)
        print(f"simulated fleet ready: {len(desc)} workers, {cfg.num_blocks} blocks x {cfg.block_size} tokens "
              f"each, time scale {cfg.timing.time_scale}", flush=True)
        if ready is not None:
            ready(fleet)
        await stop.wait()


def run(args) -> int:
    if args.tokenizer_dir:
        save_model_dir(args.tokenizer_dir, args.vocab_size, args.model)
    try:
        asyncio.run(serve(fleet_config_from_args(args), args.workers_file))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 1
    return 0
