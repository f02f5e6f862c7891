"""Does heavy work stall the gateway's event loop? Small-request latency while it works.

    python -m bench.bench_loop_stall [--quick]

One gateway process (`kvgate serve`, kv policy, the 32K BPE tokenizer) in front of 4 mock workers; worker
w0's KV events come from a vLLM-format publisher in this process. A c=1 client sends ~300 B chats and
records latency (p50/p99) in three phases, each against the idle figures of the same run:
- idle;
- while two other clients keep sending ~100 KB chats never seen before (new text to tokenize: it runs on
  the tokenizer pool through ``encode_batch``, which releases the GIL);
- while the publisher sends a burst of 10,000 BlockStored events (100 batches of 100) every second.
Prints a table and writes bench/results/loop_stall.json.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from bench.bench_gateway import (
    ROOT, Conn, chat_of, conversation, free_port, latency, pct, save_and_print, small_chat, stop, wait_http,
)
from bench.tokenizer import build as build_tokenizer
from bench.sim.vllm_format import EventPublisher, stored

BLOCK = 16


async def small_latencies(port: int, n: int, start: int) -> list[float]:
    return await latency(port, [small_chat(start + i) for i in range(n)])


async def flood_prompts(port: int, stop_at: list[bool], conc: int = 2) -> int:
    sent = 0

    async def one(k: int) -> None:
        nonlocal sent
        c = await Conn(port).open()
        i = 0
        try:
            while not stop_at[0]:
                await c.post("/v1/chat/completions", chat_of(conversation(f"flood{k}-{i}")))
                i += 1
                sent += 1
        finally:
            c.close()

    await asyncio.gather(*(one(k) for k in range(conc)))
    return sent


def flood_events(pub: EventPublisher, stop_at: list[bool], counter: list[int]) -> None:
    """Bursts of 10,000 events (the size of a replay), one a second; the events are encoded up front so
    the publishing thread does not compete with the gateway for the CPU while a burst is applied."""
    rng = random.Random(1)
    bursts = []
    parent = None
    for _ in range(3):
        burst = []
        for _ in range(100):
            events = []
            for _ in range(100):
                h = rng.getrandbits(63)
                events.append(stored([h], [rng.randrange(1, 30000) for _ in range(BLOCK)], BLOCK, parent))
                parent = h
            burst.append(events)
        bursts.append(burst)
    i = 0
    while not stop_at[0]:
        for events in bursts[i % len(bursts)]:
            pub.publish(events)
        counter[0] += 10_000
        i += 1
        time.sleep(1.0)


async def run(args) -> dict:
    tok_dir = build_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-stall-"))
    wports = [free_port() for _ in range(4)]
    mock = subprocess.Popen([sys.executable, "-m", "bench.mock_worker", "--ports", ",".join(map(str, wports))],
                            cwd=ROOT, start_new_session=True)
    ev_port, rp_port = free_port(), free_port()
    pub = EventPublisher(f"tcp://*:{ev_port}", f"tcp://*:{rp_port}")
    gport = free_port()
    workers = [{"url": f"http://127.0.0.1:{p}", "name": f"w{i}"} for i, p in enumerate(wports)]
    workers[0].update(events_endpoint=f"tcp://127.0.0.1:{ev_port}", replay_endpoint=f"tcp://127.0.0.1:{rp_port}")
    cfg = tmp / "kvgate.yaml"
    cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": gport, "log_level": "warning", "workers": workers,
                                   "models": {"bench": {"tokenizer": str(tok_dir), "block_size": BLOCK}},
                                   "routing": {"parity_check": False}, "health_interval_s": 2.0}))
    gw = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)], cwd=ROOT,
                          start_new_session=True)
    n = 300 if args.quick else 1500
    out: dict = {"loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    try:
        for p in wports:
            wait_http(p, "/health")
        wait_http(gport, "/ready")
        pub.wait_subscribed(30)
        await small_latencies(gport, 200, 0)
        idle = await small_latencies(gport, n, 1000)
        out["idle"] = {"p50_ms": pct(idle, .5), "p99_ms": pct(idle, .99)}

        flag = [False]
        flood = asyncio.create_task(flood_prompts(gport, flag))
        await asyncio.sleep(0.5)
        busy = await small_latencies(gport, n, 10_000)
        flag[0] = True
        sent = await flood
        out["tokenizing_100kb"] = {"p50_ms": pct(busy, .5), "p99_ms": pct(busy, .99), "big_prompts": sent}

        flag = [False]
        count = [0]
        th = threading.Thread(target=flood_events, args=(pub, flag, count), daemon=True)
        th.start()
        await asyncio.sleep(0.5)
        busy = await small_latencies(gport, n, 20_000)
        flag[0] = True
        th.join(10)
        out["applying_events"] = {"p50_ms": pct(busy, .5), "p99_ms": pct(busy, .99), "events": count[0]}
        for k in ("tokenizing_100kb", "applying_events"):
            out[k]["p99_vs_idle"] = out[k]["p99_ms"] / max(1e-6, out["idle"]["p99_ms"])
        return out
    finally:
        stop(gw)
        stop(mock)
        pub.close()


def report(r: dict) -> str:
    lines = [f"Load average at start: {r['loadavg']}.", "",
             "| small chat, c=1 | p50 | p99 | p99 / idle p99 | meanwhile |", "|---|---|---|---|---|",
             f"| idle | {r['idle']['p50_ms']:.2f} ms | {r['idle']['p99_ms']:.2f} ms | 1.00 | |"]
    t, e = r["tokenizing_100kb"], r["applying_events"]
    lines.append(f"| while 100 KB prompts are tokenized | {t['p50_ms']:.2f} ms | {t['p99_ms']:.2f} ms | "
                 f"{t['p99_vs_idle']:.2f} | {t['big_prompts']} unseen 100 KB chats |")
    lines.append(f"| while KV events are applied | {e['p50_ms']:.2f} ms | {e['p99_ms']:.2f} ms | "
                 f"{e['p99_vs_idle']:.2f} | {e['events']} BlockStored events |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    save_and_print("loop_stall.json", asyncio.run(run(args)), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
