"""Gateway overhead against fast mock workers, beside sglang-router and a direct baseline in the same run.

    python -m bench.bench_gateway [--quick] [--rounds N] [--index memory|redis] [--no-peer] [--no-floor]
                                  [--procs 1,2]

Starts 4 mock workers (bench/mock_worker.py, one process), kvgate (`kvgate serve`, kv policy, a 32K-vocab
BPE tokenizer loaded locally; once per --procs value) and sglang-router `cache_aware` (installed from PyPI
into ~/.cache/kvgate/peers by bench.sim.harness), and bench/floor_proxy.py ("python floor": a pass-through
proxy on the same server, event loop and upstream client as kvgate, with no routing), then measures each with a raw keep-alive HTTP/1.1 client:
- added latency p50/p99 at concurrency 1 (router minus direct) and the router's CPU per request, for a
  ~300 B chat; a ~100 KB chat (16 long documents shared by 64 bodies, each document seen once before);
  a seen ~100 KB conversation extended by ~1 KB; a ~100 KB chat never seen;
- throughput at concurrency 32 for the small and the shared-document chats;
- routing stages in-process (tokenize, hash, lookup, decide) through Router.plan.
Prints Markdown tables with ratios against sglang-router and writes bench/results/gateway.json. With
``--rounds N`` every target is measured N times, interleaved (a shared machine's load moves between
targets), and each ratio is the median of the per-round ratios.
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


def shared_documents(n_docs: int = 16, per_doc: int = 4, doc_bytes: int = 100_000) -> tuple[list[bytes], list[bytes]]:
    """RAG bodies: ``n_docs`` long documents, each asked ``per_doc`` questions (one user message with the
    document then the question), and one warm-up body per document (a question not asked later)."""
    docs = [corpus_text(doc_bytes, offset=7919 * (i + 1)) for i in range(n_docs)]

    def body(i: int, q: str) -> bytes:
        return chat_of([{"role": "system", "content": "Answer from the document."},
                        {"role": "user", "content": f"{docs[i]}\n\nQuestion: {q}"}])
    warm = [body(i, "what is this document about?") for i in range(n_docs)]
    asks = [body(i, f"what does part {k} of it say about item {i * per_doc + k}?")
            for k in range(per_doc) for i in range(n_docs)]
    return warm, asks


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


def start_kvgate(tmp: Path, tok_dir: Path, wports: list[int], index_cfg: dict, nprocs: int):
    """A kvgate gateway (``kvgate serve --workers nprocs``); returns (process, port)."""
    import yaml

    gport = free_port()
    cfg = tmp / f"kvgate-{nprocs}.yaml"
    cfg.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": gport, "log_level": "warning",
        "workers": [{"url": f"http://127.0.0.1:{p}", "name": f"w{i}"} for i, p in enumerate(wports)],
        "models": {MODEL: {"tokenizer": str(tok_dir)}}, "index": index_cfg,
        # the mock workers publish no KV events: a parity probe would only mark them cache-blind
        "routing": {"parity_check": False},
        "health_interval_s": 2.0}))
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(cfg),
                             "--workers", str(nprocs)], cwd=ROOT, start_new_session=True)
    wait_http(gport, "/ready")
    if nprocs > 1:
        time.sleep(3.0)  # every process up and healthy (they bind one by one)
    return proc, gport


def start_sglang(tmp: Path, wports: list[int]):
    """sglang-router ``cache_aware`` on the same mock workers; returns (process, port)."""
    from bench.sim.harness import Target, start_peer

    port = free_port()
    proc = start_peer(Target("sglang-router cache_aware", "sglang-router", "cache_aware", text=True), tmp,
                      [f"http://127.0.0.1:{p}" for p in wports], port, {})
    return proc, port


def start_floor(wports: list[int]):
    """bench/floor_proxy.py on the same mock workers (the least a Python gateway does); (process, port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.floor_proxy", "--port", str(port), "--workers",
                             ",".join(f"http://127.0.0.1:{p}" for p in wports)], cwd=ROOT, start_new_session=True)
    wait_http(port, "/health")
    return proc, port


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children (``--workers`` processes)."""
    from bench.sim.procs import children

    total = cpu_s(pid)
    for child in children(pid):
        try:
            total += cpu_s(child)
        except OSError:  # gone meanwhile
            pass
    return total


async def measure(port: int, pid: int, wports: list[int], bodies: dict, q: bool) -> dict:
    """One router: c=1 latency and CPU per case (with the direct baseline taken right after), c=32 req/s."""
    out: dict = {}

    async def pair(name, bodies_, warm=()):
        if warm:
            await latency(port, list(warm))
        await latency(port, bodies_[:5])
        c0 = tree_cpu_s(pid)
        g = await latency(port, bodies_[5:])
        cpu = (tree_cpu_s(pid) - c0) / len(g) * 1e3
        await latency(wports[0], bodies_[:5])
        d = await latency(wports[0], bodies_[5:])
        out[f"c1_{name}"] = {"direct_p50_ms": pct(d, .5), "gateway_p50_ms": pct(g, .5), "gateway_p99_ms": pct(g, .99),
                             "added_p50_ms": pct(g, .5) - pct(d, .5), "added_p99_ms": pct(g, .99) - pct(d, .99),
                             "cpu_ms_per_req": cpu, "n": len(g)}

    await pair("small", bodies["small"])
    await pair("rag_seen", bodies["rag"], warm=bodies["rag_warm"])
    await pair("extend_1k", bodies["extend"], warm=bodies["extend_warm"])
    await pair("unseen", bodies["unseen"])
    secs = 2.0 if q else 6.0
    for name in ("small", "rag"):
        c0 = tree_cpu_s(pid)
        rps, n = await throughput([port], bodies[name], 32, secs)
        out[f"c32_{name}"] = {"rps": rps, "cpu_ms_per_req": (tree_cpu_s(pid) - c0) / max(1, n) * 1e3}
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
        q = args.quick
        n_small = 300 if q else 2000
        base_conv = conversation("seen")
        rag_warm, rag = shared_documents(per_doc=2 if q else 4)
        bodies = {
            "small": [small_chat(i) for i in range(n_small)],
            "rag_warm": rag_warm, "rag": rag,
            "extend_warm": [chat_of(base_conv)],
            "extend": [chat_of(base_conv + [{"role": "user", "content": f"follow-up {i}: " + corpus_text(1000, 31 * i)}])
                       for i in range(25 if q else 105)],
            "unseen": [chat_of(conversation(f"cold{i}")) for i in range(10 if q else 40)],
        }
        results: dict = {"machine": f"{os.cpu_count()} cores", "index": args.index,
                         "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                         "sizes": {k: len(v[0]) for k, v in bodies.items()}, "targets": {}}
        targets = [(f"kvgate x{n}", n) for n in args.procs] + ([] if args.no_floor else [(FLOOR, -1)]) \
            + ([] if args.no_peer else [("sglang-router", 0)])
        rounds: list[dict] = []
        for r in range(max(1, args.rounds)):  # targets interleaved: each round measures all of them
            rounds.append({})
            for name, n in targets:
                print(f"round {r + 1}: measuring {name} ...", file=sys.stderr, flush=True)
                if n > 0:
                    proc, port = start_kvgate(tmp, tok_dir, wports, index_cfg, n)
                elif n < 0:
                    proc, port = start_floor(wports)
                else:
                    proc, port = start_sglang(tmp, wports)
                try:
                    pid = proc.p.pid if n == 0 else proc.pid
                    rounds[-1][name] = await measure(port, pid, wports, bodies, q)
                finally:
                    if n:
                        stop(proc)
                    else:
                        proc.stop()
        results["rounds"] = rounds
        results["targets"] = {name: median_of([rd[name] for rd in rounds]) for name, _ in targets}
        results["ratios"] = round_ratios(rounds)
        results["stages_ms"] = await stages(wports, tok_dir, {
            "small": bodies["small"][:200], "rag_seen": bodies["rag_warm"] + bodies["rag"],
            "extend_1k": bodies["extend_warm"] + bodies["extend"][:60]}, index_cfg)
        return results
    finally:
        for p in procs:
            stop(p)
        if redis_proc is not None:
            stop(redis_proc)
        shutil.rmtree(tmp, ignore_errors=True)


FLOOR = "python floor"


def median_of(measures: list[dict]) -> dict:
    """Each figure of one target's measurements (one per round), as the median over the rounds."""
    return {case: {k: statistics.median(m[case][k] for m in measures) for k in measures[0][case]}
            for case in measures[0]}


def round_ratios(rounds: list[dict]) -> dict:
    """kvgate x1 over sglang-router within each round (the same minutes of a shared machine): added p50
    at c=1 per case and c=32 throughput; median, min and max over the rounds."""
    per: dict[str, list[float]] = {}
    for rd in rounds:
        k, peer = rd.get("kvgate x1"), rd.get("sglang-router")
        if not k or not peer:
            continue
        for case, _ in CASES:
            key = f"c1_{case}"
            per.setdefault(key, []).append(k[key]["added_p50_ms"] / max(1e-3, peer[key]["added_p50_ms"]))
        for case in ("small", "rag"):
            key = f"c32_{case}"
            per.setdefault(key, []).append(k[key]["rps"] / max(1e-3, peer[key]["rps"]))
    return {key: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": len(v)}
            for key, v in per.items()}


def _ratio(r: dict, key: str, fallback: float) -> str:
    """The ratio column: one run's ratio, or with rounds the median of the per-round ratios (range)."""
    x = r.get("ratios", {}).get(key)
    if not x or x["rounds"] < 2:
        return f" {fallback:.2f}x |"
    return f" {x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f}) |"
CASES = (("small", "~300 B chat"), ("rag_seen", "~100 KB chat, document seen (16 docs x 64 bodies)"),
         ("extend_1k", "seen 100 KB chat + 1 KB"), ("unseen", "~100 KB chat, unseen"))


def report(r: dict) -> str:
    t = r["targets"]
    peer = t.get("sglang-router")
    names = list(t)
    n_rounds = len(r.get("rounds", [])) or 1
    lines = [(f"{n_rounds} rounds, targets interleaved; figures are medians over the rounds, ratios the median "
              f"(range) of the per-round ratios. " if n_rounds > 1 else "")
             + f"Load average at start: {r.get('loadavg', '?')}. Index: {r['index']}; body bytes: "
             + ", ".join(f"{k} {v}" for k, v in r["sizes"].items() if not k.endswith("warm")) + ".", "",
             "| c=1, added p50 (p99) | " + " | ".join(names) + (" | kvgate x1 / sglang |" if peer else " |"),
             "|---" * (len(names) + 1 + bool(peer)) + "|"]
    for k, label in CASES:
        row = [f"{t[n][f'c1_{k}']['added_p50_ms']:.2f} ({t[n][f'c1_{k}']['added_p99_ms']:.2f}) ms" for n in names]
        ratio = ""
        if peer and "kvgate x1" in t:
            ratio = _ratio(r, f"c1_{k}",
                           t['kvgate x1'][f'c1_{k}']['added_p50_ms'] / max(1e-3, peer[f'c1_{k}']['added_p50_ms']))
        lines.append(f"| {label} | " + " | ".join(row) + " |" + ratio)
    lines += ["", "| c=1, router CPU per request | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k, label in CASES:
        lines.append(f"| {label} | " + " | ".join(f"{t[n][f'c1_{k}']['cpu_ms_per_req']:.2f} ms" for n in names) + " |")
    lines += ["", "| c=32 req/s (CPU/request) | " + " | ".join(names) + (" | kvgate x1 / sglang |" if peer else " |"),
              "|---" * (len(names) + 1 + bool(peer)) + "|"]
    for k, label in (("small", "~300 B chat"), ("rag", "~100 KB chat, document seen")):
        row = [f"{t[n][f'c32_{k}']['rps']:.0f} ({t[n][f'c32_{k}']['cpu_ms_per_req']:.2f} ms)" for n in names]
        ratio = ""
        if peer and "kvgate x1" in t:
            ratio = _ratio(r, f"c32_{k}", t['kvgate x1'][f'c32_{k}']['rps'] / max(1e-3, peer[f'c32_{k}']['rps']))
        lines.append(f"| {label} | " + " | ".join(row) + " |" + ratio)
    if "kvgate x1" in t:
        k1 = t["kvgate x1"]
        lines += ["", f"kvgate x1 CPU per request, seen 100 KB + 1 KB vs small chat: "
                  f"{k1['c1_extend_1k']['cpu_ms_per_req'] / max(1e-3, k1['c1_small']['cpu_ms_per_req']):.2f}x"]
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
    p.add_argument("--procs", default="1,2", help="kvgate gateway process counts to measure (serve --workers)")
    p.add_argument("--no-peer", action="store_true", help="leave sglang-router out")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every target this many times, interleaved; report medians and per-round ratios")
    p.add_argument("--no-floor", action="store_true",
                   help="leave out bench/floor_proxy.py (a Python pass-through proxy: the floor of kvgate's stack)")
    args = p.parse_args(argv)
    args.procs = [int(x) for x in args.procs.split(",") if x.strip()]
    save_and_print("gateway.json", asyncio.run(run(args)), report)
    return 0


def save_and_print(name: str, result: dict, render) -> None:
    """Write ``bench/results/<name>`` and print the rendered tables."""
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    sys.exit(main())
