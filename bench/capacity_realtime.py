"""The capacity-bound run through the real gateway against simulated vLLM servers, in real time:
``python -m bench.capacity_realtime``.

The workload of ``bench.capacity_virtual`` (the capacity-bound real-vLLM run's ``MixSpec`` and seeds, as
token ids, each client's turns in a closed loop, clients ``--stagger`` s apart), sent as streamed
``/v1/completions`` to ``kvgate serve`` (one per target, a fresh gateway, the in-memory index) in front of
two simulated vLLM servers (``bench.sim``: vLLM 0.32's block pool and scheduler, its HTTP, metrics and KV
events, at the CPU timing ``--prefill-tps`` / ``--step-ms`` / ``--batched-tokens``), whose prefix caches are
emptied before every target. Each round is one workload seed; the targets run in a balanced order.

Why: the virtual clock's "gateway's predictions" mode (``bench.capacity_virtual --gateway``) prices with
the gateway's cost model but not through the gateway (first tokens and ends seen the instant the engine
has them, no HTTP; until session 42 an index that was always current, which made two eviction-model
changes look 2-4 points better that were 0-5 points worse on real vLLM: docs/BENCHMARKS.md). Here the
gateway is the real one, and the same change scored as on real vLLM (80.2% against main's 85.8%; real
vLLM 80.5% against 85.9%), at about a minute per target and round, without vLLM.

Targets: ``kv`` (the gateway's defaults), ``kv[key=value,...]`` (routing settings), ``round_robin``,
``least_loaded``, ``session``. Reported per target and round: prompt tokens from cache (vLLM's
``cached_tokens`` as the gateway recorded them), mean TTFT, and the prediction (``bench.prediction``:
observed / predicted TTFT, predicted cached == delivered), with the latter split by the eviction model that
priced the chosen worker; then pooled over the rounds.
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
from collections import Counter
from pathlib import Path

import httpx

from bench import mixed_workload as mw
from bench import prediction
from bench.bench_vllm_policies import ROOT, Gateway
from bench.capacity_bound import variant_of
from bench.capacity_virtual import add_workload_arguments, prompts_of, render_clients, workload_spec
from bench.sim.harness import order_of

MODEL = "capacity-sim"
BS = 32  # the capacity-bound run's block size
VOCAB = 200_000  # the simulator's word tokenizer; the tiny model's token ids are all below it
# the fleet process: the simulated servers at ``bench.capacity_virtual.cpu_timing``, streaming every token
# (vLLM's default stream interval)
FLEET = """
import asyncio, sys
from bench.capacity_virtual import cpu_timing
from bench.sim.cli import serve
from bench.sim.fleet import FleetConfig
blocks, path, tps, step, batched, model, vocab, max_len, bs = sys.argv[1:]
cfg = FleetConfig(workers=2, model=model, block_size=int(bs), num_blocks=int(blocks),
                  max_model_len=int(max_len), vocab_size=int(vocab),
                  timing=cpu_timing(float(tps), float(step), int(batched)), stream_interval=1)
asyncio.run(serve(cfg, path))
"""


class SimServer:
    """One simulated server as ``bench.bench_vllm_policies.Gateway`` lists it."""

    def __init__(self, desc: dict, batched_tokens: int) -> None:
        self.desc, self.batched_tokens = desc, batched_tokens

    def worker_config(self) -> dict:
        d = self.desc
        return {"name": d["name"], "url": d["url"], "events_endpoint": d["events_endpoint"],
                "replay_endpoint": d["replay_endpoint"], "max_num_batched_tokens": self.batched_tokens}


class Fleet:
    """The two simulated servers in their own process (their steps never wait on the gateway's CPU)."""

    def __init__(self, blocks: int, workdir: Path, args, max_model_len: int) -> None:
        self.path = workdir / f"workers-{time.monotonic_ns()}.json"
        self.log = workdir / "fleet.log"
        self.argv = [str(blocks), str(self.path), str(args.prefill_tps), str(args.step_ms),
                     str(args.batched_tokens), MODEL, str(VOCAB), str(max_model_len), str(BS)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> list[dict]:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", FLEET, *self.argv], cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 60
        while not self.path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the simulated fleet did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        return json.loads(self.path.read_text())["workers"]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def drive(url: str, clients, max_tokens: int, stagger_s: float) -> list[float | None]:
    """Every client's turns, one after another, clients concurrently: each turn's TTFT (None: no token)."""
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as http:
        async def one(i: int, sessions) -> list[float | None]:
            await asyncio.sleep(i * stagger_s)
            out = []
            for turns in sessions:
                for ids in turns:
                    t0, ttft = time.perf_counter(), None
                    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
                    async with http.stream("POST", url + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if ttft is None and line.startswith("data:") and '"text"' in line:
                                ttft = time.perf_counter() - t0
                    out.append(ttft)
            return out

        per = await asyncio.gather(*(one(i, sessions) for i, (_, sessions) in enumerate(clients)))
    return [t for ts in per for t in ts]


def by_model(decisions: list[dict]) -> dict[str, dict[str, int]]:
    """Predicted cached == delivered (exact), over, under, per eviction model of the chosen candidate."""
    out: dict[str, Counter] = {}
    for d in decisions:
        got = d.get("delivered_cached_tokens")
        if got is None or d.get("outcome") != "ok":
            continue
        p = d.get("predicted_cached_tokens") or 0
        chosen = next((c for c in d.get("candidates") or () if c.get("worker") == d.get("chosen")), {})
        model = chosen.get("eviction_model") or "none"
        out.setdefault(model, Counter())["exact" if p == got else "over" if p > got else "under"] += 1
    return {m: dict(c) for m, c in sorted(out.items())}


def summary(decisions: list[dict], ttfts: list[float | None]) -> dict:
    ok = [d for d in decisions if d.get("outcome") == "ok" and d.get("prompt_tokens")
          and d.get("delivered_cached_tokens") is not None]
    prompt = sum(d["prompt_tokens"] for d in ok)
    cached = sum(d["delivered_cached_tokens"] for d in ok)
    seen = [t for t in ttfts if t is not None]
    acc = prediction.accuracy(decisions)
    return {"requests": len(ttfts), "no_token": len(ttfts) - len(seen),
            "hit_rate": cached / prompt if prompt else None,
            "predicted_cached_tokens": sum(d.get("predicted_cached_tokens") or 0 for d in ok),
            "ttft_mean_s": statistics.fmean(seen) if seen else None,
            "exact": acc.get("cached_exact_share"), "ttft_ratio_p50": acc.get("ttft_ratio_p50"),
            "ttft_ratio_p90": acc.get("ttft_ratio_p90"), "by_model": by_model(decisions)}


def pooled(rows: list[dict]) -> dict:
    models: dict[str, Counter] = {}
    for r in rows:
        for m, c in r["by_model"].items():
            models.setdefault(m, Counter()).update(c)
    n = sum(sum(c.values()) for c in models.values())
    exact = sum(c["exact"] for c in models.values())
    return {"rounds": len(rows), "exact": exact / n if n else None, "decisions": n,
            "hit_rate_median": statistics.median(r["hit_rate"] for r in rows if r["hit_rate"] is not None),
            "ttft_mean_s_median": statistics.median(r["ttft_mean_s"] for r in rows if r["ttft_mean_s"]),
            "by_model": {m: dict(c) for m, c in sorted(models.items())}}


def run(args) -> dict:
    from bench.sim.tokenizer import save_model_dir
    from bench.tiny_model import build_tokenizer

    spec = workload_spec(args)
    targets = [t.strip() for t in args.targets.split(";") if t.strip()]
    work = Path(tempfile.mkdtemp(prefix="kvgate-capacity-rt-"))
    build_tokenizer(work / "tiny")
    simtok = str(save_model_dir(work / "simtok", VOCAB, MODEL))  # the gateway's parity probes match the sims'
    results: dict[str, list[dict]] = {t: [] for t in targets}
    for rnd in range(args.rounds):
        seed = args.seed + rnd
        clients = render_clients(str(work / "tiny"), spec, seed, args.max_tokens)
        prompts = prompts_of(clients)
        longest = max(map(len, prompts)) + args.max_tokens
        blocks = mw.kv_blocks_for(mw.distinct_blocks(prompts, BS), args.kv_ratio, BS, longest)
        with Fleet(blocks, work, args, -(-(longest + 64) // BS) * BS) as desc:
            for target in order_of(targets, rnd):
                for d in desc:
                    httpx.post(d["url"] + "/reset_prefix_cache", timeout=10.0).raise_for_status()
                policy, routing = variant_of(target)
                routing["decisions_kept"] = 10 * len(prompts)
                wd = work / f"round{rnd + 1}-target{targets.index(target) + 1}-{policy}"
                wd.mkdir()
                with Gateway([SimServer(d, args.batched_tokens) for d in desc], simtok, policy, wd,
                             routing=routing, model=MODEL) as gw:
                    ttfts = asyncio.run(drive(gw.url, clients, args.max_tokens, args.stagger))
                    decisions = httpx.get(f"{gw.url}/admin/decisions",
                                          params={"limit": prediction.MAX_DECISIONS}, timeout=60.0).json()
                (wd / "decisions.json").write_text(json.dumps(decisions))  # for a look at the misses
                s = summary(decisions["decisions"], ttfts)
                s["seed"] = seed
                results[target].append(s)
                print(f"seed {seed}, {target}: hit {100 * (s['hit_rate'] or 0):.1f}%  mean TTFT "
                      f"{s['ttft_mean_s'] or 0:.3f} s  cached == delivered {100 * (s['exact'] or 0):.1f}%  "
                      f"obs/pred {s['ttft_ratio_p50'] or 0:.2f} / p90 {s['ttft_ratio_p90'] or 0:.2f}  "
                      f"{s['by_model']}", flush=True)
    return {"targets": {t: {"rounds": rows, "pooled": pooled(rows)} for t, rows in results.items() if rows},
            "workdir": str(work)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capacity_realtime", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="kv", help="';'-separated: kv, kv[key=value,...], round_robin, ...")
    p.add_argument("--rounds", type=int, default=4, help="rounds (workload seeds --seed, --seed + 1, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-ratio", type=float, default=3.0, help="working set / one server's KV cache")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stagger", type=float, default=0.5)
    p.add_argument("--prefill-tps", type=float, default=1440.0, help="prefill tokens per second per server")
    p.add_argument("--step-ms", type=float, default=35.0, help="a decode step's base time")
    p.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--json", help="write every round's summary here")
    add_workload_arguments(p)
    args = p.parse_args(argv)
    out = run(args)
    print()
    for t, r in out["targets"].items():
        q = r["pooled"]
        print(f"{t}: over {q['rounds']} rounds, cached == delivered {100 * (q['exact'] or 0):.1f}% of "
              f"{q['decisions']} (pooled), hit rate {100 * q['hit_rate_median']:.1f}% and mean TTFT "
              f"{q['ttft_mean_s_median']:.3f} s (medians); by eviction model {q['by_model']}")
    print(f"decision records and logs: {out['workdir']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
