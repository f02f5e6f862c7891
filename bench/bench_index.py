"""Index and hashing benchmarks: ``python -m bench.bench_index`` (``--quick`` for a smoke run).

Starts a private redis-server on a free loopback port and reports, with a baseline measured in the same
run for each figure:
- hashing a 128K-token prompt vs a naive per-block Python loop (struct.pack per block);
- event ingest (decode + hash mapping + index writes) in blocks/s per backend, per Python CPU second,
  and the Redis server's CPU seconds;
- lookup latency for 1K/8K/32K/128K-token prompts with 8 and 64 workers, per backend, with the Python
  CPU per block and a bare Redis PING round trip as the baseline;
- Redis memory per (block, worker) entry.
Prints a Markdown table (paste it in docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import struct
import subprocess
import tempfile
import time

import numpy as np
import xxhash

from bench.sim import vllm_format as vf
from indexer.events.ingestor import EventIngestor, EventSource
from indexer.hashing import SEED, sequence_hashes
from indexer.index import Tier
from indexer.index.memory import MemoryIndex
from indexer.index.redis import RedisIndex
from tests.support.procs import free_port, stop, wait_port

BS = 16
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def start_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (tests/support/install-redis.sh)")
    port = free_port()
    wd = tempfile.mkdtemp(prefix="kvgate-bench-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", wd],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    wait_port(port, 20, proc)
    return proc, wd, f"redis://127.0.0.1:{port}/0"


def naive_sequence_hashes(tokens: list[int], bs: int) -> list[int]:
    """Baseline: what a straightforward implementation does, one struct.pack per block."""
    out, prev = [], None
    for i in range(0, len(tokens) - bs + 1, bs):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i:i + bs]), SEED)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), SEED)
        out.append(prev)
    return out


def best_of(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_hashing(rows, quick):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 150_000, 128 * 1024, dtype=np.uint32)
    as_list = toks.tolist()
    assert sequence_hashes(toks, BS) == naive_sequence_hashes(as_list, BS)
    n = 3 if quick else 10
    fast_arr = best_of(lambda: sequence_hashes(toks, BS), n)
    fast_list = best_of(lambda: sequence_hashes(as_list, BS), n)
    naive = best_of(lambda: naive_sequence_hashes(as_list, BS), n)
    blocks = len(toks) // BS
    rows.append(("hash 128K tokens (numpy array in)", f"{fast_arr * 1e3:.2f} ms",
                 f"{fast_arr / blocks * 1e9:.0f} ns/block",
                 f"naive loop {naive * 1e3:.2f} ms: {naive / fast_arr:.1f}x"))
    rows.append(("hash 128K tokens (list in)", f"{fast_list * 1e3:.2f} ms",
                 f"{fast_list / blocks * 1e9:.0f} ns/block", f"{naive / fast_list:.1f}x"))


def make_payloads(n_batches: int, blocks_per_batch: int) -> tuple[list[bytes], list[bytes], int]:
    """vLLM-encoded batches: each a new request's prompt (one BlockStored, parent None), then the
    evictions as vLLM sends them (one BlockRemoved per hash, many per batch)."""
    rng = np.random.default_rng(2)
    stores, removes = [], []
    eh = 1
    for b in range(n_batches):
        toks = rng.integers(0, 150_000, blocks_per_batch * BS, dtype=np.uint32).tolist()
        hashes = list(range(eh, eh + blocks_per_batch))
        eh += blocks_per_batch
        stores.append(vf.encode_batch(vf.KVEventBatch(ts=float(b), events=[
            vf.stored(hashes, toks, BS, None)], data_parallel_rank=0)))
        removes.append(vf.encode_batch(vf.KVEventBatch(ts=float(b), events=[
            vf.BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in hashes],
            data_parallel_rank=0)))
    return stores, removes, n_batches * blocks_per_batch


async def bench_ingest(rows, index, label, redis_client, quick):
    n_batches, per = (100, 64) if quick else (1500, 64)
    stores, removes, nblocks = make_payloads(n_batches, per)
    ing = EventIngestor(index)
    await ing.start()
    await ing.add_source(EventSource("w0", MODEL, f"tcp://127.0.0.1:{free_port()}", block_size=BS))

    async def redis_cpu():
        if redis_client is None:
            return 0.0
        info = await redis_client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    for phase, payloads in (("store", stores), ("remove", removes)):
        r0 = await redis_cpu()
        c0, t0 = time.process_time(), time.perf_counter()
        for seq, p in enumerate(payloads, start=0 if phase == "store" else n_batches):
            await ing.feed("w0", [b"", seq.to_bytes(8, "big"), p])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rcpu = await redis_cpu() - r0
        st = ing.status("w0")
        assert st["dropped"] == 0 and st["gaps"] == 0, st
        rows.append((f"ingest {phase} -> {label}", f"{nblocks / wall / 1e3:.0f}k blocks/s",
                     f"{nblocks / cpu / 1e3:.0f}k blocks/s per Python CPU-s",
                     f"redis CPU {rcpu:.2f} s for {nblocks} blocks" if redis_client else "-"))
    assert (await index.stats(MODEL)).get(MODEL) is None
    await ing.stop()


async def bench_lookup(rows, index, label, ping_us, quick):
    """Two placements per size: 'typical' -- every worker holds 4 other prompts (background entries)
    and 4 workers hold prefixes of this one (one whole, three random lengths) --, and 'all' -- every
    worker holds a random prefix of it, one the whole (cost grows with the sum of the runs)."""
    rng = np.random.default_rng(3)
    for tokens in (1024, 8 * 1024, 32 * 1024, 128 * 1024):
        prompt = rng.integers(0, 150_000, tokens, dtype=np.uint32)
        hashes = sequence_hashes(prompt, BS)
        nb = len(hashes)
        for workers in (8, 64):
            for scenario in ("typical", "all"):
                await index.clear_model(MODEL)
                for w in range(workers):
                    if scenario == "typical":
                        for k in range(4):
                            other = rng.integers(0, 150_000, min(tokens, 8192), dtype=np.uint32)
                            await index.store(MODEL, f"w{w}", Tier.GPU, sequence_hashes(other, BS))
                    holds = w < 4 if scenario == "typical" else True
                    if holds:
                        n = nb if w == 0 else int(rng.integers(0, nb))
                        await index.store(MODEL, f"w{w}", Tier.GPU if w % 3 else Tier.CPU, hashes[:n])
                await index.store_g4(MODEL, hashes[: nb // 2])
                res = await index.lookup(MODEL, hashes)
                assert res.match("w0").local == nb
                run_blocks = sum(m.local for m in res.workers.values())
                reps = 3 if quick else (100 if tokens <= 8192 else 20)
                walls, cpus = [], []
                if ping_us:
                    await index._r.config_resetstat()
                for _ in range(reps):
                    c0, t0 = time.process_time(), time.perf_counter()
                    await index.lookup(MODEL, hashes)
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                wall = statistics.median(walls) * 1e6
                cpu = min(cpus) * 1e6
                if ping_us:
                    stats = await index._r.info("commandstats")
                    server = stats["cmdstat_evalsha"]["usec_per_call"]
                    note = (f"PING {ping_us:.0f} µs; script in Redis {server:.0f} µs = "
                            f"{server / nb:.2f} µs/block, "
                            f"{server * 1e3 / run_blocks:.0f} ns/run-block")
                else:
                    note = f"{wall * 1e3 / run_blocks:.0f} ns/run-block"
                name = f"lookup {tokens // 1024}K tok ({nb} blocks), {workers} workers, {scenario}, {label}"
                rows.append((name,
                             f"{wall:.0f} µs (median wall)", f"Python CPU {cpu / nb:.2f} µs/block", note))
    await index.clear_model(MODEL)


async def bench_memory(rows, index: RedisIndex, quick):
    r = index._r
    n = 20_000 if quick else 200_000
    hashes = sequence_hashes(np.arange(n * BS, dtype=np.uint32) % 150_000 + 7, BS)
    await r.flushall()
    await asyncio.sleep(0.2)
    m0 = int((await r.info("memory"))["used_memory"])
    for i in range(0, n, 10_000):
        await index.store(MODEL, "w0", Tier.GPU, hashes[i:i + 10_000])
    m1 = int((await r.info("memory"))["used_memory"])
    for w in range(1, 8):
        for i in range(0, n, 10_000):
            await index.store(MODEL, f"w{w}", Tier.GPU, hashes[i:i + 10_000])
    m8 = int((await r.info("memory"))["used_memory"])
    usage = await r.memory_usage(index.blocks_key(MODEL), samples=0)
    rows.append((f"redis memory, {n} blocks x 1 worker", f"{(m1 - m0) / n:.0f} B/entry",
                 f"block hash alone (8 holders): {usage / n:.0f} B/block",
                 f"model name of {len(MODEL)} chars"))
    rows.append((f"redis memory, {n} blocks x 8 workers", f"{(m8 - m0) / (8 * n):.0f} B/entry",
                 f"each extra worker: {(m8 - m1) / (7 * n):.0f} B/entry", "goal <= 150 B"))
    c0 = time.perf_counter()
    removed = await index.clear_worker(MODEL, "w3")
    rows.append((f"clear_worker ({removed} entries)", f"{(time.perf_counter() - c0) * 1e3:.0f} ms",
                 "walks the worker's 2048 reverse buckets", "no SCAN"))
    await r.flushall()


async def main_async(quick: bool) -> list[tuple]:
    rows: list[tuple] = []
    bench_hashing(rows, quick)
    proc, wd, url = start_redis()
    try:
        mem = MemoryIndex()
        rix = RedisIndex(url, timeout_s=30.0)
        await bench_ingest(rows, mem, "memory", None, quick)
        await bench_ingest(rows, rix, "redis", rix._r, quick)
        pings, ping_cpu = [], []
        for _ in range(200):
            c0 = time.process_time()
            pings.append(await rix.ping())
            ping_cpu.append(time.process_time() - c0)
        ping_us = statistics.median(pings) * 1e6
        rows.append(("baseline: bare Redis PING (redis-py asyncio)", f"{ping_us:.0f} µs (median wall)",
                     f"Python CPU {statistics.median(ping_cpu) * 1e6:.0f} µs per call", "the per-call floor"))
        await bench_lookup(rows, mem, "memory", 0.0, quick)
        await bench_lookup(rows, rix, "redis", ping_us, quick)
        await bench_memory(rows, rix, quick)
        await rix.close()
    finally:
        stop(proc)
        shutil.rmtree(wd, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_index", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run, figures not meaningful)")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args.quick))
    print("| benchmark | result | per unit | baseline / notes |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
