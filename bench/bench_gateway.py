"""Gateway overhead against fast mock workers, with a direct-to-worker baseline in the same run.

    python -m bench.bench_gateway [--quick] [--index memory|redis]

Starts 4 mock workers (bench/mock_worker.py, one process) and one gateway process (`kvgate serve`, kv
policy, a 32K-vocab BPE tokenizer loaded locally), then measures with a raw keep-alive HTTP/1.1 client:
- added latency p50/p99 at concurrency 1 (gateway minus direct) for a ~300 B chat, a ~100 KB chat never
  seen before, and a new turn of a seen ~100 KB conversation;
- throughput at concurrency 32, direct (client-side round robin over the 4 workers) vs through the gateway;
- routing stages measured separately in-process (tokenize, hash, lookup, decide) via Router.plan.
Prints a Markdown table and writes bench/results/gateway.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.tokenizer import build as build_tokenizer
from bench.tokenizer import corpus_text

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"


# ---- a raw HTTP/1.1 keep-alive client (low overhead, so the measurement is the servers') -------------
class Conn:
    def __init__(self, port: int) -> None:
        self.port = port
        self.reader = self.writer = None

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % (path.encode(), len(body)) + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length, chunked = None, False
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        if length is not None:
            return status, await self.reader.readexactly(length)
        out = b""
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                data = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                out += data[:-2]
        return status, out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def latency(port: int, bodies: list[bytes], path="/v1/chat/completions") -> list[float]:
    c = await Conn(port).open()
    out = []
    try:
        for b in bodies:
            t = time.perf_counter()
            status, _ = await c.post(path, b)
            out.append((time.perf_counter() - t) * 1e3)
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
    finally:
        c.close()
    return out


async def throughput(ports: list[int], bodies: list[bytes], conc: int, seconds: float) -> tuple[float, int]:
    done = 0
    stop = time.perf_counter() + seconds
    idx = 0

    async def one(i: int) -> None:
        nonlocal done, idx
        c = await Conn(ports[i % len(ports)]).open()
        try:
            while time.perf_counter() < stop:
                b = bodies[idx % len(bodies)]
                idx += 1
                status, _ = await c.post("/v1/chat/completions", b)
                if status != 200:
                    raise RuntimeError(f"HTTP {status}")
                done += 1
        finally:
            c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(conc)))
    return done / (time.perf_counter() - t0), done


# ---- payloads -------------------------------------------------------------------------------------
def small_chat(i: int) -> bytes:
    body = {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"Request {i}: summarise the benefits of KV cache aware routing please."}]}
    return json.dumps(body).encode()


def conversation(tag: str, total_bytes: int = 100_000, turns: int = 40) -> list[dict]:
    per = total_bytes // turns
    msgs = []
    for t in range(turns):
        role = "user" if t % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": f"[{tag}:{t}] " + corpus_text(per, offset=t * per + hash(tag) % 9973)})
    return msgs


def chat_of(msgs: list[dict]) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 8, "messages": msgs}).encode()


# ---- processes ------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, path: str, timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"port {port}{path} not ready")


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


async def stages(worker_ports: list[int], tok_dir: Path, payloads: dict[str, list[bytes]], index_cfg: dict):
    """Router.plan in-process (same code as the request path), stage by stage."""
    from router.config import Settings
    from router.state import GatewayState

    settings = Settings(workers=[{"url": f"http://127.0.0.1:{p}"} for p in worker_ports],
                        models={MODEL: {"tokenizer": str(tok_dir)}}, index=index_cfg)
    st = GatewayState(settings, with_events=False)
    await st.start()
    out = {}
    try:
        for name, bodies in payloads.items():
            rows = []
            for b in bodies:
                body = json.loads(b)
                d = await st.router.plan(MODEL, body, {}, "/v1/chat/completions", size=len(b))
                rows.append(d.timings_ms | {"tokens": d.num_tokens})
            rows = rows[len(rows) // 5:]  # drop warm-up
            out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    finally:
        await st.stop()
    return out


async def run(args) -> dict:
    tok_dir = build_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    procs = []
    redis_proc = None
    try:
        index_cfg = {"backend": "memory"}
        if args.index == "redis":
            rport = free_port()
            redis_proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(rport), "--save", "",
                                           "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                                          start_new_session=True)
            time.sleep(0.5)
            index_cfg = {"backend": "redis", "redis_url": f"redis://127.0.0.1:{rport}/0"}
        wports = [free_port() for _ in range(4)]
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.mock_worker", "--ports",
                                       ",".join(map(str, wports))], cwd=ROOT, start_new_session=True))
        for p in wports:
            wait_http(p, "/health")
        gport = free_port()
        cfg = tmp / "kvgate.yaml"
        import yaml

        cfg.write_text(yaml.safe_dump({
            "host": "127.0.0.1", "port": gport, "log_level": "warning",
            "workers": [{"url": f"http://127.0.0.1:{p}", "name": f"w{i}"} for i, p in enumerate(wports)],
            "models": {MODEL: {"tokenizer": str(tok_dir)}}, "index": index_cfg,
            # the mock workers publish no KV events: a parity probe would only mark them cache-blind
            "routing": {"parity_check": False},
            "health_interval_s": 2.0}))
        gw_proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
                                   cwd=ROOT, start_new_session=True)
        procs.append(gw_proc)
        wait_http(gport, "/ready")
        q = args.quick
        n_small = 300 if q else 2000
        n_big = 40 if q else 200
        secs = 2.0 if q else 6.0
        results: dict = {"machine": f"{os.cpu_count()} cores", "index": args.index,
                         "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3])}

        small = [small_chat(i) for i in range(n_small)]
        big_cold = [chat_of(conversation(f"cold{i}")) for i in range(n_big + 20)]
        base_conv = conversation("seen")
        turns = [chat_of(base_conv + [{"role": "assistant", "content": f"answer {i} " * 20},
                                      {"role": "user", "content": f"follow-up question {i} " * 10}])
                 for i in range(n_big + 20)]
        results["sizes"] = {"small_bytes": len(small[0]), "big_bytes": len(big_cold[0]),
                            "turn_bytes": len(turns[0])}

        async def pair(bodies, warm=20):
            await latency(gport, bodies[:warm])
            await latency(wports[0], bodies[:warm])
            c0 = cpu_s(gw_proc.pid)
            g = await latency(gport, bodies[warm:])
            cpu = (cpu_s(gw_proc.pid) - c0) / len(g) * 1e3
            d = await latency(wports[0], bodies[warm:])
            return {"direct_p50_ms": pct(d, .5), "direct_p99_ms": pct(d, .99), "gateway_p50_ms": pct(g, .5),
                    "gateway_p99_ms": pct(g, .99), "added_p50_ms": pct(g, .5) - pct(d, .5),
                    "added_p99_ms": pct(g, .99) - pct(d, .99), "gateway_cpu_ms_per_req": cpu, "n": len(g)}

        results["c1_small"] = await pair(small)
        results["c1_big_unseen"] = await pair(big_cold)
        await latency(gport, [chat_of(base_conv)])  # the gateway has seen the conversation
        results["c1_big_new_turn"] = await pair(turns)

        big_seen = [chat_of(base_conv)] * 50
        for name, bodies in (("small", small), ("big_seen", big_seen), ("big_unseen", big_cold)):
            direct, _ = await throughput(wports, bodies, 32, secs)
            c0 = cpu_s(gw_proc.pid)
            via, n = await throughput([gport], bodies, 32, secs)
            cpu = (cpu_s(gw_proc.pid) - c0) / max(1, n) * 1e3
            results[f"c32_{name}"] = {"direct_rps": direct, "gateway_rps": via, "ratio": via / direct,
                                      "gateway_cpu_ms_per_req": cpu}
        results["stages_ms"] = await stages(wports, tok_dir, {
            "small": small[:200], "big_unseen": big_cold[: min(60, len(big_cold))],
            "big_new_turn": [chat_of(base_conv)] + turns[:60]}, index_cfg)
        return results
    finally:
        for p in procs:
            stop(p)
        if redis_proc is not None:
            stop(redis_proc)
        shutil.rmtree(tmp, ignore_errors=True)


def report(r: dict) -> str:
    lines = [f"Load average at start: {r.get('loadavg', '?')}. Index: {r['index']}; bodies: small {r['sizes']['small_bytes']} B, 100 KB chat "
             f"{r['sizes']['big_bytes']} B, new turn {r['sizes']['turn_bytes']} B.", "",
             "| c=1 | direct p50 | gateway p50 | added p50 | added p99 | gateway CPU/request |",
             "|---|---|---|---|---|---|"]
    for k, label in (("c1_small", "~300 B chat"), ("c1_big_unseen", "~100 KB chat, unseen"),
                     ("c1_big_new_turn", "new turn of a seen 100 KB chat")):
        x = r[k]
        lines.append(f"| {label} | {x['direct_p50_ms']:.2f} ms | {x['gateway_p50_ms']:.2f} ms | "
                     f"{x['added_p50_ms']:.2f} ms | {x['added_p99_ms']:.2f} ms | "
                     f"{x['gateway_cpu_ms_per_req']:.2f} ms |")
    lines += ["", "| c=32 | direct req/s | gateway req/s | gateway/direct | gateway CPU/request |",
              "|---|---|---|---|---|"]
    for k, label in (("c32_small", "~300 B chat"), ("c32_big_seen", "~100 KB chat, seen (segment cache)"),
                     ("c32_big_unseen", "~100 KB chat, unseen")):
        x = r[k]
        lines.append(f"| {label} | {x['direct_rps']:.0f} | {x['gateway_rps']:.0f} | {x['ratio']:.2f} | "
                     f"{x['gateway_cpu_ms_per_req']:.2f} ms |")
    lines += ["", "| stage (median, in-process) | tokens | tokenize | hash | lookup | decide | total |",
              "|---|---|---|---|---|---|---|"]
    for k, x in r["stages_ms"].items():
        lines.append(f"| {k} | {x['tokens']:.0f} | {x['tokenize']:.3f} ms | {x['hash']:.3f} ms | "
                     f"{x['lookup']:.3f} ms | {x['decide']:.3f} ms | {x['total']:.3f} ms |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--index", choices=("memory", "redis"), default="memory")
    args = p.parse_args(argv)
    r = asyncio.run(run(args))
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gateway.json").write_text(json.dumps(r, indent=1))
    print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
