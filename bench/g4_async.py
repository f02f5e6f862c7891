"""A short request that arrives while a long prompt is loading from G4: its TTFT, async vs sync loads.

``python -m bench.g4_async [--reps 3] [--long-tokens 4096] [--read-mbps 12.5] [--modes async,sync]``

One real vLLM CPU server per load mode (152M-parameter Llama built offline, 1 core, kvgate's connector
on a temp G4 directory, ``load_async`` true or false). Per repetition: a fresh long prompt is served
once (its blocks are saved to G4), ``POST /reset_prefix_cache`` empties vLLM's own cache, the same long
prompt is sent again (so the connector loads every full block from G4), and as soon as the store has
started reading, a fresh short prompt is sent; its TTFT is compared with the TTFT of fresh short prompts
on the idle server, measured in the same run (median of the idle ones before each repetition).

A G4 load of a few thousand tokens takes tens of milliseconds from this machine's page cache, too short
to overlap anything. The store's read throttle (``read_bytes_per_s`` in the connector's extra config,
here ``--read-mbps``) makes the load last seconds, as on a slow or contended shared filesystem (a
12.5 MB/s share is a 1 GbE NFS link split ten ways); the throttle paces every read thread of the
worker together, so it caps bandwidth, not concurrency.

``measure_short_during_long_load(...) -> dict`` is the entry point other benchmarks call.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence

from bench import tiny_model
from bench.bench_g4_ttft import reset, ttft
from bench.vllm_server import VllmServer


def _server(model, g4: str, mode: str, read_bytes_per_s: float | None, omp: str) -> VllmServer:
    cfg: dict = {"load_async": mode == "async"}
    if read_bytes_per_s:
        cfg["read_bytes_per_s"] = read_bytes_per_s
    return VllmServer(  # VLLM_SERVER_DEV_MODE=1 (always set) enables POST /reset_prefix_cache
        model,
        name=f"g4-async-bench-{mode}",
        served_model_name="m152",
        omp_threads_bind=omp,
        max_model_len=8192,
        kv_cache_gib=2,
        max_num_batched_tokens=8192,
        extra_args=["--dtype", "bfloat16"],
        g4_path=g4,
        g4_config=cfg,
    )


def _wait(cond, timeout: float, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())


def _one_mode(model, mode: str, long_tokens: int, short_tokens: int, read_bytes_per_s, reps: int,
              omp: str, rng: random.Random) -> dict:
    g4 = tempfile.mkdtemp(prefix=f"kvgate-g4-async-{mode}-")
    srv = _server(model, g4, mode, read_bytes_per_s, omp)
    block = srv.block_size
    n_blocks = (long_tokens - 1) // block

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(n)]

    idle, during, long_ttfts, long_cached, overlapped, load_s = [], [], [], [], [], []
    with srv:
        ttft(srv, fresh(64))  # warm-up
        for _ in range(reps):
            idle_now = [ttft(srv, fresh(short_tokens))[0] for _ in range(3)]
            idle += idle_now
            long_p = fresh(long_tokens)
            before = srv.g4_stats()
            ttft(srv, long_p)  # cold: computed, its blocks saved to G4
            if not _wait(lambda: srv.g4_stats()["saves_written"] - before["saves_written"] >= n_blocks, 120):
                raise RuntimeError(f"{mode}: the long prompt's blocks were not all saved to G4")
            reset(srv)
            ttft(srv, fresh(8))  # the next request sees the emptied cache
            before = srv.g4_stats()
            out: dict = {}

            def long_request():
                t0 = time.perf_counter()
                out["ttft"], out["cached"] = ttft(srv, long_p)
                out["first_at"] = t0 + out["ttft"]

            th = threading.Thread(target=long_request)
            th.start()
            started = _wait(lambda: srv.g4_stats()["store"]["hits"] > before["store"]["hits"], 60)
            sent_at = time.perf_counter()
            t_short, _ = ttft(srv, fresh(short_tokens))
            th.join(600)
            after = srv.g4_stats()
            during.append(t_short)
            long_ttfts.append(out["ttft"])
            long_cached.append(out["cached"])
            overlapped.append(bool(started and sent_at < out["first_at"]))
            load_s.append(after["load_seconds"] - before["load_seconds"])
            ratio_now = t_short / statistics.median(idle_now)
            print(f"  {mode}: short idle {statistics.median(idle_now):.3f} s, during the load {t_short:.3f} s "
                  f"({ratio_now:.2f}x); long TTFT {out['ttft']:.2f} s, cached {out['cached']}", flush=True)
        stats = srv.g4_stats()
    idle_med = statistics.median(idle)
    during_med = statistics.median(during)
    return {
        "short_idle_s": idle_med,
        "short_during_load_s": during_med,
        "ratio": during_med / idle_med,
        "short_during_load_all_s": during,
        "long_ttft_s": statistics.median(long_ttfts),
        "long_cached_min": min(long_cached),
        "long_blocks": n_blocks,
        "load_s": statistics.median(load_s),
        "overlapped": all(overlapped),
        "async_loads": stats["async_loads"],
        "load_failures": stats["load_failures"],
    }


def measure_short_during_long_load(
    *,
    modes: Sequence[str] = ("async", "sync"),
    long_tokens: int = 4096,
    short_tokens: int = 64,
    read_bytes_per_s: float | None = 12.5e6,
    reps: int = 3,
    model_size: str = "152m",
    omp_threads_bind: str = "auto",
    seed: int = 0,
) -> dict:
    """TTFT of a short request sent while a long prompt loads from G4, against the idle TTFT, per mode.

    Starts one vLLM server per mode in turn (never two at once). Returns ``{"config": {...}, "modes":
    {mode: {"short_idle_s", "short_during_load_s", "ratio", "long_ttft_s", "long_cached_min",
    "long_blocks", "load_s", "overlapped", ...}}}``; ``ratio`` is during/idle within the same server
    run, ``overlapped`` says every short request was sent after the load had started and before the
    long request's first token."""
    model = tiny_model.ensure(model_size)
    rng = random.Random(seed)
    res = {
        mode: _one_mode(model, mode, long_tokens, short_tokens, read_bytes_per_s, reps, omp_threads_bind, rng)
        for mode in modes
    }
    return {
        "config": {
            "model": model_size,
            "long_tokens": long_tokens,
            "short_tokens": short_tokens,
            "read_bytes_per_s": read_bytes_per_s,
            "reps": reps,
        },
        "modes": res,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="async,sync")
    ap.add_argument("--long-tokens", type=int, default=4096)
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--read-mbps", type=float, default=12.5, help="store read throttle, MB/s (0: none)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = measure_short_during_long_load(
        modes=a.modes.split(","),
        long_tokens=a.long_tokens,
        short_tokens=a.short_tokens,
        read_bytes_per_s=a.read_mbps * 1e6 or None,
        reps=a.reps,
    )
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print("| load mode | short TTFT idle | short TTFT during the load | ratio | long TTFT | long cached | "
          "overlapped |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in res["modes"].items():
        print(f"| {mode} | {r['short_idle_s']:.3f} s | {r['short_during_load_s']:.3f} s | {r['ratio']:.2f}x | "
              f"{r['long_ttft_s']:.2f} s | {r['long_cached_min']} | {r['overlapped']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
