"""The replayer: sends a workload to any OpenAI-compatible endpoint at its (scaled) arrival times, streams
every response, and reports prefix hit rate (the workers' own ``cached_tokens`` over prompt tokens), TTFT
p50/p90/p99, mean end-to-end latency, throughput and failures next to the workload's ceiling.

Latencies are reported in workload seconds: wall seconds x ``time_scale`` (the simulator and the replayer
run the same factor faster than real time)."""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.replay_workloads import WorkItem
from bench.sim.tokenizer import ids_to_text


@dataclass
class Record:
    ok: bool
    at: float
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None        # wall seconds
    e2e_s: float | None = None
    status: int | None = None
    error: str | None = None
    worker: str | None = None


@dataclass
class RunResult:
    name: str
    records: list[Record]
    wall_s: float
    time_scale: float
    ceiling: float | None = None
    worker_counters: dict | None = None   # prefix cache hits/queries from the workers' /metrics, this run
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return summarize(self)


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summarize(r: RunResult) -> dict:
    ok = [x for x in r.records if x.ok]
    k = r.time_scale
    ttft = [x.ttft_s * k for x in ok if x.ttft_s is not None]
    e2e = [x.e2e_s * k for x in ok if x.e2e_s is not None]
    prompt = sum(x.prompt_tokens for x in ok)
    cached = sum(x.cached_tokens for x in ok)
    span = r.wall_s * k
    out = {
        "name": r.name,
        "requests": len(r.records),
        "ok": len(ok),
        "failed": len(r.records) - len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ceiling": r.ceiling,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
        "e2e_mean_s": float(np.mean(e2e)) if e2e else None,
        "throughput_rps": len(ok) / span if span else 0.0,
        "throughput_tokens_s": (prompt + sum(x.completion_tokens for x in ok)) / span if span else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "time_scale": k, "wall_s": r.wall_s,
    }
    if r.worker_counters:
        q, h = r.worker_counters.get("queries", 0), r.worker_counters.get("hits", 0)
        out["worker_hit_rate"] = h / q if q else 0.0
        loads = list(r.worker_counters.get("per_worker_prompt_tokens", {}).values())
        if loads and sum(loads):
            # load imbalance: the busiest worker's share of prompt tokens relative to a fair share
            out["max_worker_load_ratio"] = max(loads) / (sum(loads) / len(loads))
    out.update(r.extra)
    return out


_METRIC = re.compile(r'^(vllm:(?:prefix_cache_queries|prefix_cache_hits|prompt_tokens)_total)\{[^}]*\}\s+'
                     r'([0-9.eE+-]+)', re.M)
_KEYS = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
         "vllm:prompt_tokens_total": "prompt_tokens"}


async def scrape_prefix_counters(client: httpx.AsyncClient, worker_urls: Sequence[str]) -> dict:
    """vllm:prefix_cache_queries/hits summed over the workers (their own accounting), and each worker's
    vllm:prompt_tokens_total (how the router spread the load)."""
    tot = {"queries": 0.0, "hits": 0.0, "per_worker_prompt_tokens": {}}

    async def one(url):
        try:
            text = (await client.get(url.rstrip("/") + "/metrics", timeout=10)).text
        except httpx.HTTPError:
            return
        for name, val in _METRIC.findall(text):
            key = _KEYS[name]
            if key == "prompt_tokens":
                tot["per_worker_prompt_tokens"][url] = float(val)
            else:
                tot[key] += float(val)

    await asyncio.gather(*(one(u) for u in worker_urls))
    return tot


async def _send(client: httpx.AsyncClient, url: str, model: str, item: WorkItem, api: str, text: bool,
                headers: dict, t0: float, timeout: float) -> Record:
    n = len(item.tokens)
    rec = Record(ok=False, at=item.at, prompt_tokens=n)
    prompt = ids_to_text(item.tokens.tolist()) if text or api == "chat" else item.tokens.tolist()
    body = {"model": model, "max_tokens": int(item.max_tokens), "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    hdrs = dict(headers)
    if item.session:
        hdrs["x-session-id"] = item.session
        body["user"] = item.session
    start = time.monotonic()
    try:
        async with client.stream("POST", url + path, json=body, headers=hdrs, timeout=timeout) as resp:
            rec.status = resp.status_code
            rec.worker = resp.headers.get("x-kvgate-worker")
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:300]
                return rec
            usage = None
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"])[:300]
                    return rec
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if piece and rec.ttft_s is None:
                        rec.ttft_s = time.monotonic() - start
            rec.e2e_s = time.monotonic() - start
            if usage is None:
                rec.error = "no usage chunk in the stream"
                return rec
            rec.completion_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens") or 0)
            rec.prompt_tokens = int(usage.get("prompt_tokens") or n)
            rec.ok = rec.ttft_s is not None
            if not rec.ok:
                rec.error = "no token in the stream"
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


async def replay(items: Sequence[WorkItem], base_url: str, model: str, *, name: str = "run",
                 time_scale: float = 1.0, api: str = "completions", text: bool = False,
                 max_inflight: int = 256, timeout_s: float = 600.0, headers: dict | None = None,
                 worker_urls: Sequence[str] = (), ceiling: float | None = None, progress: bool = True,
                 deadline_s: float | None = None) -> RunResult:
    """Replay ``items`` at ``item.at / time_scale`` wall seconds. ``deadline_s`` (wall) stops issuing new
    requests (those not sent are not counted)."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=max_inflight, max_keepalive_connections=max_inflight)
    sem = asyncio.Semaphore(max_inflight)
    bar = None
    if progress:
        from tqdm import tqdm

        # disable=None: a bar on a terminal, nothing in logs and pipes
        bar = tqdm(total=len(items), desc=name, unit="req", leave=False, dynamic_ncols=True, disable=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        before = await scrape_prefix_counters(client, worker_urls) if worker_urls else None
        t0 = time.monotonic()
        records: list[Record] = []

        async def one(item: WorkItem):
            async with sem:
                rec = await _send(client, base_url, model, item, api, text, headers or {}, t0, timeout_s)
            records.append(rec)
            if bar is not None:
                bar.update(1)

        tasks = []
        for item in items:
            delay = t0 + item.at / time_scale - time.monotonic()
            if deadline_s is not None and time.monotonic() - t0 + max(0.0, delay) > deadline_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        if bar is not None:
            bar.total = len(tasks)
            bar.refresh()
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
        counters = None
        if worker_urls:
            after = await scrape_prefix_counters(client, worker_urls)
            counters = {"queries": after["queries"] - before["queries"], "hits": after["hits"] - before["hits"],
                        "per_worker_prompt_tokens": {
                            u: v - before["per_worker_prompt_tokens"].get(u, 0.0)
                            for u, v in after["per_worker_prompt_tokens"].items()}}
    if bar is not None:
        bar.close()
    records.sort(key=lambda r: r.at)
    return RunResult(name=name, records=records, wall_s=wall, time_scale=time_scale, ceiling=ceiling,
                     worker_counters=counters)


# -- reporting -----------------------------------------------------------------------------------------------
def _fmt(v, pct=False, digits=2):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:.{digits}f}"


def table(summaries: Sequence[dict], baseline: str | None = None) -> str:
    """A plain-text (and Markdown-compatible) table; TTFT ratios against ``baseline`` when given."""
    base = next((s for s in summaries if s["name"] == baseline), None)
    head = ["policy", "hit rate", "ceiling", "TTFT p50 s", "p90 s", "p99 s", "mean TTFT s", "mean e2e s",
            "req/s", "busiest worker", "failed"]
    if base:
        head.append(f"mean TTFT vs {baseline}")
    occ = any(s.get("occupancy") for s in summaries)
    if occ:  # bench/sim/occupancy.py: the share of the fleet's resident KV blocks that are second copies
        head.append("KV duplicated")
    engine = any((s.get("engine") or {}).get("ttft_mean_s") is not None for s in summaries)
    if engine:  # the engines' own mean TTFT (vLLM's histograms), the rest of the client's; of that, kvgate's own
        # part and the time requests waited at its prefill gate (the queue kept there instead of in vLLM)
        head += ["engine TTFT s", "outside engine s", "kvgate's own s", "kvgate's gate s"]
    pred = any(isinstance(s.get("prediction"), dict) for s in summaries)
    if pred:  # kvgate's own accuracy (bench/prediction.py)
        head += ["obs/pred TTFT p50", "p90", "cached = predicted"]
    rows = []
    for s in summaries:
        row = [s["name"], _fmt(s["hit_rate"], True), _fmt(s.get("ceiling"), True), _fmt(s["ttft_p50_s"]),
               _fmt(s["ttft_p90_s"]), _fmt(s["ttft_p99_s"]), _fmt(s["ttft_mean_s"]), _fmt(s["e2e_mean_s"]),
               _fmt(s["throughput_rps"]),
               "-" if s.get("max_worker_load_ratio") is None else f"{s['max_worker_load_ratio']:.2f}x fair",
               f"{s['failed']}/{s['requests']}"]
        if base:
            ratio = (s["ttft_mean_s"] / base["ttft_mean_s"]) if s["ttft_mean_s"] and base["ttft_mean_s"] else None
            row.append("-" if ratio is None else f"{ratio:.2f}x")
        if occ:
            row.append(_fmt((s.get("occupancy") or {}).get("dup_share_mean"), True))
        if engine:
            e = (s.get("engine") or {}).get("ttft_mean_s")
            own = (s.get("prediction") or {}).get("first_byte_ms_mean")
            gate = (s.get("prediction") or {}).get("gate_wait_ms_mean")
            row += [_fmt(e), _fmt(None if e is None or s["ttft_mean_s"] is None else s["ttft_mean_s"] - e),
                    *(_fmt(None if ms is None else ms / 1000.0 * s.get("time_scale", 1.0)) for ms in (own, gate))]
        if pred:
            p = s.get("prediction") or {}
            row += [_fmt(p.get("ttft_ratio_p50")), _fmt(p.get("ttft_ratio_p90")), _fmt(p.get("cached_exact_share"), True)]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *[line(r) for r in rows]])


def plot(results: Sequence[RunResult], path: str | Path, title: str = "") -> Path:
    """TTFT distribution per policy (CDF) and hit rate vs the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        v = np.sort([x.ttft_s * r.time_scale for x in r.records if x.ok and x.ttft_s is not None])
        if len(v):
            ax1.plot(v, np.arange(1, len(v) + 1) / len(v), label=r.name)
    ax1.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.set_xlabel("TTFT (s, workload time)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    sums = [summarize(r) for r in results]
    names = [s["name"] for s in sums]
    ax2.bar(names, [100 * s["hit_rate"] for s in sums], color="tab:blue", label="hit rate")
    ceil = next((s["ceiling"] for s in sums if s.get("ceiling") is not None), None)
    if ceil is not None:
        ax2.axhline(100 * ceil, color="tab:red", ls="--", label=f"ceiling {100 * ceil:.1f}%")
    ax2.set_ylabel("prefix hit rate (%)")
    ax2.set_title("hit rate vs ceiling")
    ax2.tick_params(axis="x", rotation=30, labelsize=8)
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(results: Sequence[RunResult], path: str | Path, meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta or {}, "runs": [{"summary": summarize(r), "records": [asdict(x) for x in r.records]}
                                        for r in results]}
    path.write_text(json.dumps(data, indent=1))
    return path
