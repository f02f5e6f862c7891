"""What one Redis Cluster shard holds and serves for one model: ``python -m bench.bench_cluster``.

A model's keys share one hash slot ({M}), so one model lives on one primary. This starts a real
3-primary cluster (plus replicas) and, as the baseline in the same run, a single redis-server; fills
both with the same entries (W workers x B blocks, chains sharing a common prefix); then reports the
memory of the primary that holds the model, and lookups/s of prompts of 1024 blocks from C concurrent
callers on one gateway process, cluster vs single node. Prints a Markdown table for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import time

from indexer.hashing import sequence_hashes
from indexer.index import Tier
from indexer.index.redis import RedisIndex
from tests.support.redis_cluster import RedisCluster
from tests.support.redis_proc import RedisProc

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BS = 16


def chains(workers: int, blocks: int) -> list[list[int]]:
    shared = list(range(512 * BS))  # a common system prompt of 512 blocks
    out = []
    for w in range(workers):
        toks = shared + [100_000 + w * 10_000_000 + i for i in range((blocks - 512) * BS)]
        out.append([int(h) for h in sequence_hashes(toks, BS)])
    return out


async def fill(idx: RedisIndex, hashes: list[list[int]]) -> None:
    for w, hs in enumerate(hashes):
        for i in range(0, len(hs), 20_000):
            await idx.store(MODEL, f"w{w}", Tier.GPU, hs[i:i + 20_000])


async def used_memory(idx: RedisIndex) -> int:
    if idx.cluster:
        await idx._r.initialize()
        node = idx._r.get_node_from_key(idx.blocks_key(MODEL))
        return int((await idx._r.info("memory", target_nodes=node))["used_memory"])
    return int((await idx._r.info("memory"))["used_memory"])


async def lookups_per_s(idx: RedisIndex, prompts: list[list[int]], callers: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def caller(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop:
            await idx.lookup(MODEL, prompts[i % len(prompts)])
            done += 1
            i += callers

    t = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return done / (time.perf_counter() - t)


async def run(workers: int, blocks: int, callers: int, seconds: float) -> None:
    hashes = chains(workers, blocks)
    prompts = [hs[:1024] for hs in hashes]  # each hits 1024 blocks on its worker, 512 on every other
    entries = workers * blocks
    cluster, single = RedisCluster().start(), RedisProc().start()
    rows = []
    try:
        for label, idx in (("single redis-server", RedisIndex(single.url, max_connections=callers)),
                           ("cluster primary of the model", RedisIndex(cluster.url, cluster=True,
                                                                       max_connections=callers))):
            before = await used_memory(idx)
            t = time.perf_counter()
            await fill(idx, hashes)
            fill_s = time.perf_counter() - t
            mem = await used_memory(idx) - before
            rate = await lookups_per_s(idx, prompts, callers, seconds)
            rows.append((label, mem, fill_s, rate))
            await idx.close()
    finally:
        cluster.close()
        single.close()
    base = rows[0][3]
    print(f"\n{workers} workers x {blocks} blocks = {entries} entries; lookups of 1024-block prompts, "
          f"{callers} concurrent callers, {seconds:g} s\n")
    print("| where | memory for the model | bytes/entry | fill (entries/s) | lookups/s | vs single |")
    print("|---|---|---|---|---|---|")
    for label, mem, fill_s, rate in rows:
        print(f"| {label} | {mem / 2**20:.0f} MiB | {mem / entries:.0f} | {entries / fill_s:,.0f} | "
              f"{rate:,.0f} | {rate / base:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--quick", action="store_true", help="a smoke run (2 workers x 5000 blocks, 1 s)")
    a = p.parse_args()
    if a.quick:
        a.workers, a.blocks, a.seconds = 2, 5000, 1.0
    asyncio.run(run(a.workers, a.blocks, a.callers, a.seconds))


if __name__ == "__main__":
    main()
