"""``kvgate calc``: KV-cache sizing from a model's config.json (arithmetic in sizing.calc).

Exit codes: 0 when it ran (and, with ``--gpu``, also when the cache does not fit: that is an answer),
2 for a bad configuration or argument, with the reason on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from sizing import calc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "KV bytes per token, per request and in total for a model's config.json; whether it fits a GPU "
        "after the weights; and G4 load time versus recomputing the prompt."
    )
    p.add_argument("config", help="a Hugging Face config.json, or a directory holding one")
    p.add_argument("--context", "-c", required=True, help="tokens per request, e.g. 131072 or 128K")
    p.add_argument("--concurrency", "-n", type=int, default=1, help="requests held at once (default 1)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype if not the model's (e.g. fp8)")
    p.add_argument("--name", default=None, help="label for the model in the output")
    g = p.add_argument_group("GPU fit")
    g.add_argument("--gpu", default=None,
                   help=f"{', '.join(calc.GPUS)} or a memory size per GPU such as 80GiB")
    g.add_argument("--gpus", type=int, default=1, help="GPUs the model is sharded over (default 1)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory vLLM may use (default 0.9)")
    g.add_argument("--overhead", default="0", help="memory per GPU for activations/CUDA graphs (e.g. 2GiB)")
    g.add_argument("--params", default=None,
                   help="parameter count (e.g. 70B); default: estimated from config")
    g.add_argument("--bytes-per-param", type=float, default=None,
                   help="with --params: bytes per parameter (default: the config dtype's)")
    g.add_argument("--weights", default=None, help="weight bytes directly (e.g. 65GB); overrides --params")
    t = p.add_argument_group("G4 load versus prefill")
    t.add_argument("--g4-bandwidth", default=None, help="G4 read bandwidth per worker, e.g. 10GB/s")
    t.add_argument("--prefill-rate", default=None, type=float, help="prefill tokens per second, e.g. 4000")
    t.add_argument("--prompt-tokens", default=None, help="prompt length to load (default: --context)")
    p.add_argument("--json", action="store_true", help="print a JSON document instead of the table")


def run(args: argparse.Namespace) -> int:
    try:
        result = calc.calculate(
            calc.load_config(args.config),
            context=calc.parse_tokens(args.context, "--context"),
            concurrency=args.concurrency,
            block_size=args.block_size,
            kv_dtype=args.kv_dtype,
            name=args.name,
            gpu=args.gpu,
            gpus=args.gpus,
            utilization=args.gpu_memory_utilization,
            overhead_bytes=_size_or_zero(args.overhead, "--overhead"),
            params=calc.parse_count(args.params, "--params") if args.params else None,
            bytes_per_param=args.bytes_per_param,
            weights_bytes=calc.parse_size(args.weights, "--weights") if args.weights else None,
            g4_bandwidth=calc.parse_size(args.g4_bandwidth, "--g4-bandwidth") if args.g4_bandwidth else None,
            prefill_rate=args.prefill_rate,
            prompt_tokens=(calc.parse_tokens(args.prompt_tokens, "--prompt-tokens")
                           if args.prompt_tokens else None),
        )
    except calc.CalcError as exc:
        print(f"kvgate calc: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(calc.format_table(result))
    return 0


def _size_or_zero(text: str, what: str) -> float:
    return 0.0 if str(text).strip() in ("", "0") else calc.parse_size(text, what)
