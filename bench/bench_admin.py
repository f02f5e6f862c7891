"""What the admin API and /metrics cost the gateway: latency of each admin read, of ``explain`` and of a
Prometheus scrape, against ``GET /health`` on the same gateway in the same run (the HTTP floor), and
``explain`` against routing the same request for real.

Run: ``python -m bench.bench_admin`` (about a minute; ``--quick`` for a smoke run). Starts mock vLLM
workers (bench.mock_worker) in a subprocess and the gateway in this process on the in-memory index,
seeded with one long cached prefix per worker so ``explain`` does a full lookup.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from bench.bench_gateway import free_port, pct, stop, wait_http
from bench.mock_worker import MODEL
from indexer.hashing import sequence_hashes
from indexer.index.base import Tier
from indexer.index.memory import MemoryIndex
from router.app import create_app
from router.config import IndexConfig, Settings, WorkerConfig


def _serve(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           access_log=False, lifespan="on"))
    threading.Thread(target=server.run, daemon=True, name="bench-gateway").start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("the gateway did not start")
        time.sleep(0.02)
    return server


def _time(client: httpx.Client, method: str, path: str, n: int, body: dict | None = None) -> list[float]:
    out = []
    for _ in range(3):  # warm-up
        client.request(method, path, json=body).raise_for_status()
    for _ in range(n):
        t = time.perf_counter()
        r = client.request(method, path, json=body)
        out.append(time.perf_counter() - t)
        r.raise_for_status()
    return out


def run(workers: int, n: int, prompt_tokens: int) -> dict:
    ports = [free_port() for _ in range(workers)]
    mock = subprocess.Popen([sys.executable, "-m", "bench.mock_worker", "--ports", ",".join(map(str, ports))],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for p in ports:
            wait_http(p, "/health")
        index = MemoryIndex()
        settings = Settings(workers=[WorkerConfig(url=f"http://127.0.0.1:{p}", name=f"w{i}")
                                     for i, p in enumerate(ports)],
                            index=IndexConfig(backend="memory"), health_interval_s=5.0)
        app = create_app(settings, index=index, with_events=False)
        gw_port = free_port()
        server = _serve(app, gw_port)
        with httpx.Client(base_url=f"http://127.0.0.1:{gw_port}", timeout=60, trust_env=False) as c:
            deadline = time.monotonic() + 60
            while sum(w["healthy"] for w in c.get("/admin/workers").json()["workers"]) < workers:
                if time.monotonic() > deadline:
                    raise TimeoutError("workers did not become healthy")
                time.sleep(0.1)
            tokens = [(i * 37) % 30000 + 1 for i in range(prompt_tokens)]
            hashes = sequence_hashes(tokens, 16)
            async def seed() -> None:  # the memory index is plain Python state: any loop may fill it
                for i in range(workers):  # worker i holds a prefix of (i + 1) / workers of the prompt
                    await index.store(MODEL, f"w{i}", Tier.GPU, hashes[: len(hashes) * (i + 1) // workers])

            asyncio.run(seed())
            body = {"model": MODEL, "prompt": tokens, "max_tokens": 1}
            rows = {
                "GET /health (baseline)": _time(c, "GET", "/health", n),
                "GET /admin/workers": _time(c, "GET", "/admin/workers", n),
                "GET /admin/index": _time(c, "GET", "/admin/index", n),
                "GET /admin/decisions?limit=100": _time(c, "GET", "/admin/decisions?limit=100", n),
                "GET /metrics": _time(c, "GET", "/metrics", n),
                f"POST /admin/explain ({prompt_tokens} tokens)": _time(c, "POST", "/admin/explain", n,
                                                                     {"body": body}),
                f"POST /v1/completions ({prompt_tokens} tokens, routed)": _time(c, "POST", "/v1/completions",
                                                                              n, body),
            }
            chosen = c.post("/admin/explain", json={"body": body}).json()["chosen"]
        server.should_exit = True
    finally:
        stop(mock)
    base = pct(rows["GET /health (baseline)"], 0.5)
    return {"workers": workers, "requests": n, "prompt_tokens": prompt_tokens, "explain_chose": chosen,
            "rows": {k: {"p50_ms": pct(v, 0.5) * 1e3, "p90_ms": pct(v, 0.9) * 1e3,
                         "x_health": pct(v, 0.5) / base} for k, v in rows.items()}}


def report(r: dict) -> str:
    lines = [f"{r['workers']} workers, {r['requests']} sequential requests each, prompt {r['prompt_tokens']} "
             f"tokens (explain chose {r['explain_chose']}, the worker with the longest prefix)",
             f"{'call':<48} {'p50 ms':>8} {'p90 ms':>8} {'x /health':>10}"]
    for k, v in r["rows"].items():
        lines.append(f"{k:<48} {v['p50_ms']:>8.2f} {v['p90_ms']:>8.2f} {v['x_health']:>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.n, a.workers = 20, 4
    r = run(a.workers, a.n, a.prompt_tokens)
    print(json.dumps(r, indent=2) if a.json else report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
