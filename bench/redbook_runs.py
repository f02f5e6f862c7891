"""The measurements of ``kvgate bench redbook`` (``bench.redbook``), through a kvgate gateway in front of
real vLLM CPU servers: one streamed completion, TTFT vs context (cold, then loaded from G4), and the
concurrent workload (N requests over N/2 unique prompts from an empty cache)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx

from bench.bench_vllm_policies import reset_caches

VOCAB = (10, 8000)  # token ids drawn for random prompts (both bench models have an 8192-token vocabulary)


@dataclass
class Completion:
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    worker: str | None


async def stream_completion(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int = 1
) -> Completion:
    """One streamed ``/v1/completions`` of token ids: TTFT, vLLM's usage (cached tokens), the worker
    kvgate chose (its ``x-kvgate-worker`` header)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed with {r.status_code}: {(await r.aread())[:500]!r}")
        worker = r.headers.get("x-kvgate-worker")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices"):
                first = time.perf_counter() - t0
            usage = ev.get("usage") or usage
    total = time.perf_counter() - t0
    return Completion(
        ttft_s=total if first is None else first,
        total_s=total,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        worker=worker,
    )


def one(url: str, model: str, prompt: list[int], max_tokens: int = 1) -> Completion:
    async def go() -> Completion:
        async with httpx.AsyncClient(timeout=900.0, trust_env=False) as c:
            return await stream_completion(c, url, model, prompt, max_tokens)

    return asyncio.run(go())


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def wait_saves(servers, timeout_s: float = 120.0) -> None:
    """Until every connector has written (or dropped) each block save it planned: what G4 holds is final."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = True
        for s in servers:
            st = s.g4_stats()
            done &= st["saves_written"] + st["saves_dropped"] >= st["saves_planned"]
        if done:
            return
        time.sleep(0.2)


def ttft_curve(url: str, model: str, servers, sizes: list[int], reps: int, seed: int, bar=None) -> list[dict]:
    """For each size and repetition, a fresh random prompt through the gateway: cold (nothing of it cached
    anywhere: full prefill, its blocks saved to G4), then, after both servers' prefix caches were emptied,
    the same prompt again: every full block is loaded from G4. Medians per size."""
    rng = random.Random(seed)
    out = []
    for n in sizes:
        cold, g4 = [], []
        for _ in range(reps):
            p = random_prompt(rng, n)
            cold.append(one(url, model, p))
            wait_saves(servers)
            reset_caches(servers)
            g4.append(one(url, model, p))
            if bar is not None:
                bar.update(1)
        out.append(
            {
                "tokens": n,
                "cold_s": statistics.median(c.ttft_s for c in cold),
                "g4_s": statistics.median(c.ttft_s for c in g4),
                "cold_cached": min(c.cached_tokens for c in cold),
                "g4_cached": min(c.cached_tokens for c in g4),
            }
        )
    return out


def growth(curve: list[dict], key: str) -> float:
    """TTFT growth from the smallest to the largest context."""
    return curve[-1][key] - curve[0][key]


def workload(n_requests: int, min_tokens: int, max_tokens: int, seed: int, variant: int = 0) -> list[list[int]]:
    """``n_requests`` prompts over ``n_requests // 2`` unique ones: every unique prompt once (shuffled),
    then every one again (shuffled), so a prompt's second use comes after the others have been through
    the small GPU caches. Lengths and order depend on ``seed`` only, token ids on ``variant`` too: another
    variant is the same work with nothing in common with the first."""
    rng, tokens = random.Random(seed), random.Random(f"{seed}/{variant}")
    uniques = [random_prompt(tokens, rng.randint(min_tokens, max_tokens)) for _ in range(n_requests // 2)]
    first, second = list(range(len(uniques))), list(range(len(uniques)))
    rng.shuffle(first)
    rng.shuffle(second)
    return [uniques[i] for i in first + second]


def concurrent(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
               bar=None) -> dict:
    """All prompts through the gateway, at most ``concurrency`` in flight, in order. Throughput and the
    cached share vLLM reported."""

    async def go() -> tuple[list[Completion], float]:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=1800.0, limits=limits, trust_env=False) as client:

            async def req(p: list[int]) -> Completion:
                async with sem:
                    c = await stream_completion(client, url, model, p, max_tokens)
                if bar is not None:
                    bar.update(1)
                return c

            t0 = time.perf_counter()
            res = await asyncio.gather(*(req(p) for p in prompts))
            return res, time.perf_counter() - t0

    res, total = asyncio.run(go())
    prompt_tokens = sum(c.prompt_tokens for c in res)
    ttfts = sorted(c.ttft_s for c in res)
    return {
        "requests": len(res),
        "total_s": total,
        "requests_per_s": len(res) / total,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": prompt_tokens / total,
        "cached_tokens": sum(c.cached_tokens for c in res),
        "cached_share": sum(c.cached_tokens for c in res) / max(1, prompt_tokens),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "per_worker": dict(sorted(Counter(str(c.worker) for c in res).items())),
        "completions": [asdict(c) for c in res],
    }


def scrape(url: str, names: tuple[str, ...] = ("vllm:num_preemptions_total",)) -> dict[str, float]:
    """Sums of some of vLLM's counters (e.g. preemptions) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30.0).text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out
