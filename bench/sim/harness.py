"""One benchmark run = a fresh simulated fleet + one router in front of it + one replay of the same items.

Targets: kvgate with a policy (and an index backend), or a peer router installed in its own virtualenv.
Every run starts from empty caches, so runs are comparable."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import prediction
from bench import replay as rp
from bench.sim import procs
from bench.sim.occupancy import OccupancySampler, cached_hashes

PEERS_DIR = Path.home() / ".cache" / "kvgate" / "peers"


@dataclass
class Target:
    name: str
    kind: str                      # "kvgate" | "sglang-router" | "vllm-router"
    policy: str
    index: str = "memory"          # kvgate only
    text: bool = False             # send prompts as text (peers route on text)
    extra: list[str] = field(default_factory=list)
    g4: bool = False               # the fleet shares a simulated G4 store (``kvgate sim --g4``)


def order_of(targets: list, rnd: int) -> list:
    """Round ``rnd``'s order of the targets: rounds in pairs, an order then its reverse, each pair's rotated
    by one. Over 2 x targets rounds every target runs in every position twice and before every other
    target in half the rounds: on the same servers (or the same host) the order moves a target as much as
    a router does (docs/BENCHMARKS.md, session 40), and rotation by one balances positions but not who
    runs before whom."""
    k = (rnd // 2) % len(targets)
    order = targets[k:] + targets[:k]
    return order[::-1] if rnd % 2 else order


def overrides(spec: str) -> dict:
    """``future_turns=5,stay_margin=0.5`` -> ``{"future_turns": 5.0, "stay_margin": 0.5}``: the settings of
    a kv variant target (``--kv-variant`` of bench.side_by_side and of the capacity-bound mode); a value
    that is not a number stays a string (a setting that takes a name)."""
    out: dict = {}
    for kv in filter(None, (x.strip() for x in spec.split(","))):
        k, _, v = kv.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            out[k.strip()] = v.strip()
    return out


# The peers' versions the results were measured with (a newer release may route differently: results name
# the version they ran, peer_version)
PEER_PINS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}


def peer_venv(package: str, log=print) -> Path:
    """``~/.cache/kvgate/peers/<package>``: created and ``pip install <package>==<pin>`` on first use (and
    again when the pin changes)."""
    venv = PEERS_DIR / package
    marker = venv / ".installed"
    want = PEER_PINS.get(package, "")
    if marker.exists() and (marker.read_text().strip() == want or peer_version(package) == want):
        return venv
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log(f"installing {package} {want} from PyPI into {venv} ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"{package}=={want}" if want else package],
                   check=True)
    marker.write_text(want)
    return venv


def peer_version(package: str) -> str | None:
    """The installed peer's version (what a result ran), None when it is not installed."""
    py = PEERS_DIR / package / "bin" / "python"
    if not py.exists():
        return None
    out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or None if out.returncode == 0 else None


def start_peer(t: Target, log_dir: Path, worker_urls: list[str], port: int, desc: dict) -> procs.Proc:
    venv = peer_venv(t.kind)
    if t.kind == "sglang-router":
        cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--prometheus-port", str(procs.free_port()), "--policy", t.policy,
               "--log-level", "warn", "--worker-urls", *worker_urls, *t.extra]
    elif t.kind == "vllm-router":
        cmd = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-port", str(procs.free_port()), "--policy", t.policy, "--log-level", "warning",
               "--worker-urls", *worker_urls]
        if t.policy == "kv_aware":
            for w in desc["workers"]:
                cmd += ["--kv-event-source", f"{w['url']}={w['events_endpoint']}",
                        "--kv-event-replay-source", f"{w['url']}={w['replay_endpoint']}"]
            cmd += ["--kv-event-block-size", str(desc["block_size"]), "--kv-event-model", desc["model"]]
        cmd += t.extra
    else:
        raise ValueError(t.kind)
    proc = procs.Proc(f"{t.name}", cmd, log_dir)
    procs.wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 60, ok=(200,))
    return proc


def run_target(t: Target, items, *, log_dir: Path, workers: int, num_blocks: int, block_size: int,
               time_scale: float, tokenizer_dir: str, ceiling: float | None, redis_url: str | None = None,
               label: str | None = None, progress: bool = True, settle_s: float = 1.0,
               g4_capacity_blocks: int = 1_000_000, routing: dict | None = None) -> rp.RunResult:
    """``routing``: overrides of the gateway's ``routing`` settings (kvgate targets); a dotted key such as
    ``tokenizer.defer_tail_bytes`` sets another section's. With ``t.g4`` the
    result's extra also holds what the gateway saw of G4 (``gateway_g4``, see :func:`gateway_g4_view`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    g4_args = ["--g4", "--g4-capacity-blocks", str(g4_capacity_blocks)] if t.g4 else []
    fleet, desc = procs.start_fleet(log_dir, workers, num_blocks=num_blocks, block_size=block_size,
                                    time_scale=time_scale, extra=g4_args)
    router = None
    try:
        port = procs.free_port()
        urls = [w["url"] for w in desc["workers"]]
        if t.kind == "kvgate":
            settings = procs.gateway_settings(desc, t.policy, port, tokenizer_dir, t.index, redis_url)
            settings["routing"].setdefault("decisions_kept", prediction.MAX_DECISIONS)  # the report reads them
            for key, value in (routing or {}).items():  # "section.key" reaches other settings sections
                section, _, name = key.rpartition(".")
                settings.setdefault(section or "routing", {})[name] = value
            router = procs.start_gateway(log_dir, f"gateway-{t.name}", settings)
        else:
            router = start_peer(t, log_dir, urls, port, desc)
        time.sleep(settle_s)  # let event subscriptions connect (ZMQ slow joiner)
        cpu0 = {"fleet": fleet.cpu_s(), "router": router.cpu_s(), "replayer": time.process_time()}
        load0 = os.getloadavg()[0]
        occupancy = OccupancySampler(urls).start()
        res = asyncio.run(rp.replay(items, f"http://127.0.0.1:{port}", desc["model"], name=label or t.name,
                                    time_scale=time_scale, text=t.text, worker_urls=urls, ceiling=ceiling,
                                    progress=progress))
        res.extra["occupancy"] = occupancy.stop()  # duplicated blocks in the fleet's caches (bench/sim/occupancy.py)
        # CPU seconds each process used during the replay (wall x time scale = trace seconds of delay, when
        # the machine's cores are short), and the 1-minute load average before and after
        cpu1 = {"fleet": fleet.cpu_s(), "router": router.cpu_s(), "replayer": time.process_time()}
        res.extra["cpu_s"] = {k: round(cpu1[k] - cpu0[k], 1) for k in cpu0
                              if cpu0[k] is not None and cpu1[k] is not None}
        res.extra["loadavg"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        res.extra.update({"router": t.kind, "policy": t.policy, "index": t.index if t.kind == "kvgate" else None,
                          "workers": workers, "num_blocks": num_blocks, "block_size": block_size,
                          "prompts_as_text": t.text, "g4": t.g4})
        if t.kind == "kvgate":
            res.extra["prediction"] = prediction.fetch(f"http://127.0.0.1:{port}",
                                                       save=log_dir / f"decisions-{t.name}.json")
            res.extra["index_view"] = index_view(f"http://127.0.0.1:{port}", desc["workers"],
                                                 save=log_dir / f"index-{t.name}.json")
        if t.kind == "kvgate" and t.g4:
            res.extra["gateway_g4"] = gateway_g4_view(f"http://127.0.0.1:{port}", desc["model"])
        res.extra["engine"] = engine_breakdown(urls, time_scale)
        return res
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


def index_view(base_url: str, workers: list[dict], save: Path | None = None) -> dict:
    """The gateway's index against the engines' caches at the end of a run: per worker, the index's GPU
    entries and the blocks the simulated engine holds (``GET /sim/cached``), and the ingestion counters.
    An index that lags the engines' evictions shows as more entries than blocks (routing then predicts
    hits that are gone); ``save`` keeps /admin/workers and /admin/index as they were."""
    import httpx

    out: dict = {"workers": {}}
    with httpx.Client(timeout=30) as client:
        try:
            ws = client.get(base_url + "/admin/workers").json()
            idx = client.get(base_url + "/admin/index").json()
        except (httpx.HTTPError, ValueError):
            return out
        if save is not None:
            save.write_text(json.dumps({"workers": ws, "index": idx}))
        by_url = {w["url"].rstrip("/"): w for w in ws.get("workers", [])}
        for d in workers:
            w = by_url.get(d["url"].rstrip("/"))
            if w is None:
                continue
            try:
                held = len(cached_hashes(client, d["url"]))
            except (httpx.HTTPError, ValueError, KeyError):
                held = None
            ev = w.get("events") or {}
            out["workers"][w["name"]] = {
                "index_gpu": (w.get("cached_blocks") or {}).get("GPU", 0), "engine_blocks": held,
                **{k: ev.get(k, 0) for k in ("applied", "dropped", "gaps", "replays", "resets", "resyncs")}}
    rows = [v for v in out["workers"].values() if v["engine_blocks"] is not None]
    if rows:
        out["index_gpu"] = sum(v["index_gpu"] for v in rows)
        out["engine_blocks"] = sum(v["engine_blocks"] for v in rows)
    return out


_HIST = {"vllm:request_queue_time_seconds": "queue", "vllm:request_prefill_time_seconds": "prefill",
         "vllm:time_to_first_token_seconds": "ttft"}


def engine_breakdown(worker_urls, time_scale: float = 1.0) -> dict:
    """The workers' own view of TTFT, summed over the fleet from their vLLM histograms: mean queue time
    (arrival -> scheduled), mean prefill time (scheduled -> first token, G4 loads included) and mean TTFT
    at the engine, in trace seconds (wall x ``time_scale``), plus mean G4 and computed tokens per request.
    The replayer's TTFT minus the engine's is what the gateway and the loopback added."""
    import re

    import httpx

    sums: dict[str, float] = {}
    line = re.compile(r'^(vllm:[a-z_]+?)(_sum|_count|_total)\{[^}]*\}\s+([0-9.eE+-]+)$', re.M)
    for u in worker_urls:
        try:
            text = httpx.get(u.rstrip("/") + "/metrics", timeout=30).text
        except httpx.HTTPError:
            continue
        for name, suffix, val in line.findall(text):
            sums[name + suffix] = sums.get(name + suffix, 0.0) + float(val)
    out: dict = {}
    for name, key in _HIST.items():
        n = sums.get(name + "_count", 0.0)
        out[f"{key}_mean_s"] = sums.get(name + "_sum", 0.0) / n * time_scale if n else None
    n = sums.get("vllm:request_prefill_kv_computed_tokens_count", 0.0)
    if n:
        out["computed_tokens_mean"] = sums.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0) / n
        out["g4_tokens_mean"] = sums.get("vllm:external_prefix_cache_hits_total", 0.0) / n
    return out


def gateway_g4_view(base_url: str, model: str) -> dict:
    """What the gateway learnt of G4 during the run: the index's G4 blocks for ``model`` (fed by the
    simulated workers' STORAGE events) and how many of its recent routing decisions counted G4 blocks."""
    import httpx

    out: dict = {}
    try:
        idx = httpx.get(base_url + "/admin/index", timeout=30).json()
        out["index_g4_blocks"] = next((m["g4_blocks"] for m in idx["models"] if m["model"] == model), 0)
        dec = httpx.get(base_url + "/admin/decisions", params={"limit": 100_000}, timeout=30).json()
        g4 = [d.get("g4_blocks") or 0 for d in dec["decisions"]]
        out.update(decisions=len(g4), decisions_with_g4=sum(1 for x in g4 if x > 0),
                   decision_g4_blocks=sum(g4))
        # what a candidate's prediction charged per block loaded from G4, and per block computed (at
        # context 0, the gateway's calibrated speed), wall milliseconds: medians over every candidate that
        # would load from G4 (chosen or not: whether the chosen one does depends on the run's timing)
        g4_ms, compute_ms, chosen = [], [], 0
        for d in dec["decisions"]:
            for c in d.get("candidates") or []:
                if c.get("g4_blocks") and c.get("prefill_tokens_per_s"):
                    g4_ms.append(c["g4_load_ms"] / c["g4_blocks"])
                    compute_ms.append(1000.0 * (d.get("block_size") or 16) / c["prefill_tokens_per_s"])
                    chosen += c.get("worker") == d.get("chosen")
        out["chosen_g4_loads"] = chosen  # decisions whose chosen worker loads blocks from G4
        if g4_ms:
            out["g4_ms_per_block"] = float(np.median(g4_ms))
            out["compute_ms_per_block"] = float(np.median(compute_ms))
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    return out
