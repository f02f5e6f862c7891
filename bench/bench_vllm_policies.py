"""Routing policies side by side over two real vLLM servers on the CPU.

    python -m bench.bench_vllm_policies [--sessions 8 --turns 5 --first-tokens 1500 --turn-tokens 550]

Two vLLM servers (one per core) serve the 152M-parameter model built by ``bench.tiny_model``. For each
policy (``kv``, ``round_robin``, ``least_loaded`` by default) the script empties both servers' prefix
caches (``POST /reset_prefix_cache``), starts a kvgate gateway (``kvgate serve``, in-memory index) with
that policy in front of them, and runs the same multi-turn chat workload through it: concurrent sessions
whose context grows every turn (to ~4K tokens with the defaults). It reports mean and p90 TTFT (streamed,
seen by the client), total time, the cached share of prompt tokens that vLLM reported per request, and
vLLM's own prefix-cache hit rate from its ``/metrics`` (hits/queries deltas over the run), with ratios
against ``round_robin`` measured in the same run. Results go to ``bench/results/vllm_policies.json``.

``--capacity-bound`` (issue #11, ``bench.capacity_bound``): servers whose KV cache is a third of the working
set of a mixed workload (RAG over shared documents, agent loops, the chat sessions), and sglang-router
``cache_aware`` beside kvgate's policies; results in ``bench/results/vllm_capacity_bound.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench import capacity_bound, tiny_model
from bench.chat_workload import TurnResult, make_sessions, run_sessions
from bench.vllm_server import VllmServer, free_port, one_core_each, start_all

ROOT = Path(__file__).resolve().parent.parent
MODEL = "m152"


def scrape_prefix_cache(url: str) -> tuple[float, float, float, float]:
    """vLLM's cumulative prefix-cache (queries, hits), in tokens, finished requests and preemptions (a
    running request's KV taken back when the blocks run out: it is recomputed later)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    q = h = n = p = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:prefix_cache_queries_total":
                q += s.value
            elif s.name == "vllm:prefix_cache_hits_total":
                h += s.value
            elif s.name == "vllm:request_success_total":
                n += s.value
            elif s.name == "vllm:num_preemptions_total":
                p += s.value
    return q, h, n, p


def reset_caches(servers: list[VllmServer]) -> None:
    for s in servers:
        r = httpx.post(f"{s.url}/reset_prefix_cache", timeout=60.0)
        r.raise_for_status()
        if r.json() is False or (isinstance(r.json(), dict) and r.json().get("success") is False):
            raise RuntimeError(f"{s.name}: /reset_prefix_cache refused: {r.text}")
        # AllBlocksCleared is published with the next request that reaches the engine: send one now, so
        # the next gateway's index does not see it arrive mid-run.
        httpx.post(
            f"{s.url}/v1/completions",
            timeout=60.0,
            json={"model": s.served_model_name, "prompt": "reset", "max_tokens": 1},
        ).raise_for_status()


class Gateway:
    """``kvgate serve`` in a subprocess with one policy in front of the servers."""

    def __init__(
        self, servers: list[VllmServer], model_dir: str, policy: str, workdir: Path, routing: dict | None = None,
        model: str = MODEL,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / f"kvgate-{policy}.yaml"
        self.log_path = workdir / f"kvgate-{policy}.log"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "host": "127.0.0.1",
                    "port": self.port,
                    "log_level": "warning",
                    "workers": [s.worker_config() for s in servers],
                    "models": {model: {"tokenizer": model_dir}},
                    "index": {"backend": "memory"},
                    "routing": {"policy": policy, **(routing or {})},
                    "health_interval_s": 1.0,
                }
            )
        )
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Gateway":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate exited: {self.log_path.read_text()[-3000:]}")
            try:
                r = httpx.get(f"{self.url}/v1/models", timeout=2.0)
                if r.status_code == 200 and r.json().get("data"):
                    time.sleep(2.0)  # event subscriptions settle
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"kvgate did not come up: {self.log_path.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def p90(xs: list[float]) -> float:
    return capacity_bound.quantile(xs, 0.9) or 0.0


def summarize(results: list[TurnResult], total_s: float, before: list, after: list) -> dict:
    """Client-side figures of one run: TTFT, vLLM's usage-reported cached share, and vLLM's own
    prefix-cache hit rate from the /metrics deltas (``before``/``after`` per server)."""
    dq = sum(a[0] - b[0] for a, b in zip(after, before))
    dh = sum(a[1] - b[1] for a, b in zip(after, before))
    ttfts = [r.ttft_s for r in results]
    later = [r.ttft_s for r in results if r.turn > 0]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    workers: dict[str, int] = {}
    for r in results:
        workers[r.worker or "?"] = workers.get(r.worker or "?", 0) + 1
    return {
        "turns": len(results),
        "total_s": total_s,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else 0.0,
        "ttft_p90_s": p90(ttfts),
        "ttft_mean_later_turns_s": statistics.fmean(later) if later else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / max(1, prompt),
        "vllm_prefix_cache_hit_rate": dh / dq if dq else 0.0,
        "max_prompt_tokens": max((r.prompt_tokens for r in results), default=0),
        "requests_per_worker": workers,
        # from each server's vllm:request_success_total (every target, peers included)
        "requests_per_server": [round(a[2] - b[2]) for a, b in zip(after, before)],
        # vllm:num_preemptions_total per server: preempted requests stall for their recompute
        "preemptions_per_server": [round(a[3] - b[3]) for a, b in zip(after, before)],
    }


def run_policy(policy: str, servers: list[VllmServer], model_dir: str, args, workdir: Path) -> dict:
    reset_caches(servers)
    sessions = make_sessions(
        model_dir, args.sessions, args.turns, args.first_tokens, args.turn_tokens, seed=args.seed
    )
    with Gateway(servers, model_dir, policy, workdir) as gw:
        before = [scrape_prefix_cache(s.url) for s in servers]
        t0 = time.perf_counter()
        results = asyncio.run(
            run_sessions(gw.url, MODEL, sessions, max_tokens=args.max_tokens, stagger_s=args.stagger)
        )
        total = time.perf_counter() - t0
        after = [scrape_prefix_cache(s.url) for s in servers]
    return {"policy": policy, **summarize(results, total, before, after)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_vllm_policies", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--policies", default=None,
                    help="kvgate policies (default kv,round_robin,least_loaded); with --capacity-bound also "
                    "'sglang-router' (the default there: kv,round_robin,least_loaded,sglang-router), or another "
                    "of its policies as e.g. 'sglang-router[round_robin]'")
    ap.add_argument("--sessions", type=int, default=8, help="chat sessions")
    ap.add_argument("--turns", type=int, default=5, help="turns per chat session")
    ap.add_argument("--first-tokens", type=int, default=1500)
    ap.add_argument("--turn-tokens", type=int, default=550)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stagger", type=float, default=0.5, help="seconds between session (client) starts")
    ap.add_argument("--size", default="152m", choices=sorted(tiny_model.SIZES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/vllm_policies.json, "
                    "with --capacity-bound bench/results/vllm_capacity_bound.json)")
    capacity_bound.add_arguments(ap)
    args = ap.parse_args(argv)
    results_dir = ROOT / "bench" / "results"
    if args.capacity_bound:
        args.out = args.out or str(results_dir / ("vllm_capacity_bound_g4.json" if args.g4 else "vllm_capacity_bound.json"))
        return capacity_bound.run(args, str(tiny_model.ensure(args.size)))
    args.policies = args.policies or "kv,round_robin,least_loaded"
    args.out = args.out or str(results_dir / "vllm_policies.json")

    model_dir = str(tiny_model.ensure(args.size))
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-vllm-"))
    servers = [
        VllmServer(
            model_dir, name=f"vllm-{i}", served_model_name=MODEL, omp_threads_bind=bind, max_model_len=8192
        )
        for i, bind in enumerate(one_core_each(2))
    ]
    logs = [str(s.workdir) for s in servers]
    print(f"starting two vLLM servers ({args.size}); logs under {workdir} and {logs}")
    rows = []
    try:
        start_all(servers)
        for policy in args.policies.split(","):
            print(f"policy {policy}: {args.sessions} sessions x {args.turns} turns ...", flush=True)
            rows.append(run_policy(policy, servers, model_dir, args, workdir))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in servers:
            s.close()
    base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    print()
    print("| policy | mean TTFT | p90 TTFT | mean TTFT turns 2+ | total | cached share (usage) "
          "| vLLM prefix-cache hit rate |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['ttft_mean_s']:.3f} s ({r['ttft_mean_s'] / base['ttft_mean_s']:.2f}x) "
            f"| {r['ttft_p90_s']:.3f} s ({r['ttft_p90_s'] / base['ttft_p90_s']:.2f}x) "
            f"| {r['ttft_mean_later_turns_s']:.3f} s "
            f"({r['ttft_mean_later_turns_s'] / base['ttft_mean_later_turns_s']:.2f}x) "
            f"| {r['total_s']:.1f} s ({r['total_s'] / base['total_s']:.2f}x) "
            f"| {r['cached_share']:.1%} | {r['vllm_prefix_cache_hit_rate']:.1%} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": rows}, indent=2) + "\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
