"""TTFT vs context with the G4 tier: cold recompute, loaded from G4, and local prefix hit.

``python -m bench.bench_g4_ttft [--sizes 1024,2048,4096,8160] [--reps 3]``

One real vLLM CPU server (152M-parameter Llama built offline, 1 core) runs kvgate's connector on a temp
G4 directory. For each prompt size and repetition, a fresh random prompt is sent three times (streamed,
max_tokens=1): cold (nothing cached anywhere: full prefill, its blocks are saved to G4), local (vLLM's
own prefix cache hits), then, after ``POST /reset_prefix_cache`` empties vLLM's cache, from G4 (the
connector loads every full block before prefill). Medians are reported, with the ratios to cold
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import httpx

from bench import tiny_model
from bench.vllm_server import VllmServer


def ttft(srv: VllmServer, prompt: list[int]) -> tuple[float, int]:
    body = {
        "model": srv.served_model_name,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    cached = -1
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices"):
                first = time.perf_counter() - t0
            u = ev.get("usage")
            if u:
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return first if first is not None else time.perf_counter() - t0, cached


def reset(srv: VllmServer) -> None:
    r = httpx.post(srv.url + "/reset_prefix_cache", timeout=60)
    r.raise_for_status()


def run(sizes: list[int], reps: int) -> list[dict]:
    model = tiny_model.ensure("152m")
    g4 = tempfile.mkdtemp(prefix="kvgate-g4-ttft-")
    srv = VllmServer(  # VLLM_SERVER_DEV_MODE=1 (always set) enables POST /reset_prefix_cache
        model,
        name="g4-ttft",
        served_model_name="m152",
        omp_threads_bind="auto",
        max_model_len=8192,
        kv_cache_gib=4,
        max_num_batched_tokens=8192,
        extra_args=["--dtype", "bfloat16"],
        g4_path=g4,
    )
    rng = random.Random(0)
    out = []
    with srv:
        ttft(srv, [rng.randrange(10, 8000) for _ in range(64)])  # warm-up
        for n in sizes:
            rows = {"cold": [], "g4": [], "local": []}
            cached = {"cold": [], "g4": [], "local": []}
            for _ in range(reps):
                p = [rng.randrange(10, 8000) for _ in range(n)]
                for kind in ("cold", "local"):
                    t, c = ttft(srv, p)
                    rows[kind].append(t)
                    cached[kind].append(c)
                time.sleep(0.5)  # let the background writer finish the saves
                reset(srv)
                ttft(srv, [rng.randrange(10, 8000) for _ in range(8)])  # publishes the reset
                t, c = ttft(srv, p)
                rows["g4"].append(t)
                cached["g4"].append(c)
            med = {k: statistics.median(v) for k, v in rows.items()}
            out.append(
                {
                    "tokens": n,
                    **{f"{k}_s": v for k, v in med.items()},
                    **{f"{k}_cached": min(v) for k, v in cached.items()},
                    "g4_speedup": med["cold"] / med["g4"],
                    "local_speedup": med["cold"] / med["local"],
                }
            )
        stats = srv.g4_stats()
    for r in out:
        r["g4_load_MBps"] = stats["load_bytes_per_s"] / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048,4096,8160")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run([int(x) for x in a.sizes.split(",")], a.reps)
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print(
        "| prompt tokens | TTFT cold | TTFT from G4 | TTFT local hit | G4 speedup | local speedup | cached (G4/local) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(
            f"| {r['tokens']} | {r['cold_s']:.3f} s | {r['g4_s']:.3f} s | {r['local_s']:.3f} s | "
            f"{r['g4_speedup']:.1f}x | {r['local_speedup']:.1f}x | {r['g4_cached']}/{r['local_cached']} |"
        )
    print(f"connector's measured G4 load bandwidth: {res[-1]['g4_load_MBps']:.0f} MB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
