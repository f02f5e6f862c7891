"""Capacity-bound mode of ``bench.bench_vllm_policies`` (issue #11): ``--capacity-bound``.

Two real vLLM CPU servers whose KV cache (``--num-gpu-blocks-override``) is a third of the mixed
workload's working set (``--kv-ratio``), the mixed workload of ``bench.mixed_workload`` (RAG users over
shared documents, agent loops, multi-turn chat, all concurrent), and on the same servers, emptying both
prefix caches before each: kvgate ``kv``, ``round_robin``, ``least_loaded`` and sglang-router
``cache_aware`` (the peer, from ``bench.sim.harness``). Per target: the hit rate by vLLM's usage
(Σ cached / Σ prompt tokens), mean and p90 streamed TTFT, total time, ratios against sglang-router and
round_robin; for kvgate targets, from ``/admin/decisions``, observed/predicted TTFT (median, p90) and the
share of requests whose predicted cached tokens equal the delivered ones.

``--rounds N`` runs every target N times on the same servers and reports each round and the medians (a ratio
is the median of the per-round ratios). The order balances the targets' positions
(``bench.sim.harness.order_of``): rounds come in pairs, an order and its reverse, each pair's order rotated
by one, so over 2 x targets rounds every target runs in every position twice and each runs before every
other in half the rounds. Why: on the same servers the order moves a target as much as the router does
(session 9's host: kv last 0.88 s mean TTFT and +8.5 points over sglang-router, kv first, same code,
1.35-1.60 s and -5 to -8 points; sessions 38-39: kv / sglang-router 0.79x in the rounds kv ran first, 1.05x
where the peer did, while rotation by one put the peer before kv in 6 or 3 of 8 three-target rounds). The
report splits each target's ratio against the peer by who ran first (:func:`order_lines`). Against the peer
each target also gets an interval for that median (:func:`median_interval`) and the goals are checked over
it: rounds of the same code spread 0.5-1.8x, so 8 or more rounds are needed to tell 0.8x from 1.0x.

``--peer-variant KEY=VALUE,...`` also runs sglang-router ``cache_aware`` with those launch flags (``--KEY
VALUE``) beside its defaults: sized to these servers (``max-tree-size`` near one server's cache in
characters, a short ``eviction-interval-secs``, ``balance-abs-threshold`` under the clients' count), as a
reviewer would tune it (docs/BENCHMARKS.md, session 40).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench import mixed_workload as mw
from bench import prediction
from bench.chat_workload import TurnResult, run_clients
from bench.eviction_timing import EventLog, attribute, summarize_window, window_removals

PEER = "sglang-router"
TARGETS = f"kv,round_robin,least_loaded,{PEER}"


def quantile(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


def prediction_stats(decisions: list[dict], kind_of: dict[str, str] | None = None) -> dict:
    """``bench.prediction.accuracy`` of the gateway's decision records (observed / predicted TTFT, predicted
    cached tokens against vLLM's delivered ones), with the share under-predicted and the token sums;
    ``kind_of`` (request id -> workload kind) adds the same figures per kind."""

    def stats(ds: list[dict]) -> dict:
        out = prediction.accuracy(ds)
        cached = [((d.get("predicted_cached_tokens") or 0), d["delivered_cached_tokens"]) for d in ds
                  if d.get("outcome") == "ok" and d.get("delivered_cached_tokens") is not None]
        out["decisions"] = len(ds)
        out["cached_under_share"] = sum(p < got for p, got in cached) / len(cached) if cached else None
        out["cached_predicted_sum"] = sum(p for p, _ in cached)
        out["cached_delivered_sum"] = sum(got for _, got in cached)
        return out

    out = stats(decisions)
    if kind_of:
        by: dict[str, list[dict]] = {}
        for d in decisions:
            by.setdefault(kind_of.get(d.get("request_id") or "", "?"), []).append(d)
        out["by_kind"] = {k: stats(v) for k, v in sorted(by.items())}
    return out


def added_ttft_ms(results: list[TurnResult], decisions: list[dict]) -> float | None:
    """The mean of the client's TTFT less the gateway's observed one (the decision record's
    ``observed_ttft_ms``: from its send to vLLM, the prefill gate's wait included, to vLLM's first byte):
    what the gateway's own work before the send and the hops between the client and vLLM add."""
    seen = {d.get("request_id"): d.get("observed_ttft_ms") for d in decisions}
    gaps = [r.ttft_s * 1000.0 - seen[r.request_id] for r in results if seen.get(r.request_id) is not None]
    return statistics.mean(gaps) if gaps else None


def by_kind(results: list[TurnResult], kind_of_session: dict[str, str]) -> dict:
    out: dict[str, dict] = {}
    for k in sorted(set(kind_of_session.values())):
        rs = [r for r in results if kind_of_session.get(r.session) == k]
        prompt = sum(r.prompt_tokens for r in rs)
        out[k] = {
            "requests": len(rs),
            "hit_rate": sum(r.cached_tokens for r in rs) / max(1, prompt),
            "ttft_mean_s": statistics.fmean(r.ttft_s for r in rs) if rs else None,
        }
    return out


def add_ratios(rows: list[dict]) -> None:
    """Ratios of every row against the peer and against round_robin (same run), when they ran."""
    for base_name, key in ((PEER, "vs_sglang"), ("round_robin", "vs_round_robin")):
        base = next((r for r in rows if r["target"] == base_name), None)
        for r in rows:
            if base is None:
                continue
            r[key] = {
                "hit_rate_points": 100 * (r["cached_share"] - base["cached_share"]),
                "ttft_mean": r["ttft_mean_s"] / base["ttft_mean_s"] if base["ttft_mean_s"] else None,
                "ttft_p90": r["ttft_p90_s"] / base["ttft_p90_s"] if base["ttft_p90_s"] else None,
                "total": r["total_s"] / base["total_s"] if base["total_s"] else None,
            }


def _ratio_goal(out: dict, name: str, kv: dict, key: str, metric: str, bound: float,
                at_most: bool = True) -> None:
    """Goal ``name``: kv's ``metric`` against a baseline (``key``: ``vs_sglang``, ``vs_round_robin``) at
    most (or at least) ``bound``; over rounds also ``name``_over_the_interval, by the far end of the
    median's interval (:func:`median_interval`) rather than the median."""
    if not kv.get(key):
        return

    def ok(v) -> bool:
        return v is not None and (v <= bound if at_most else v >= bound)

    out[name] = ok(kv[key].get(metric))
    iv = (kv.get(key + "_interval") or {}).get(metric)
    if iv:
        out[name + "_over_the_interval"] = ok(iv[1] if at_most else iv[0])


def goals(rows: list[dict], g4: bool = False) -> dict:
    """Issue #11's goals, checked on this run's rows (None where a target did not run). With G4 on both
    servers the hit rate no longer depends on placement, so there the goals are on mean TTFT alone."""
    kv = next((r for r in rows if r["target"] == "kv"), None)
    out: dict = {}
    if kv is None:
        return out
    if g4:
        _ratio_goal(out, "g4_kv_mean_ttft_vs_round_robin_le_0.85x", kv, "vs_round_robin", "ttft_mean", 0.85)
        _ratio_goal(out, "g4_kv_mean_ttft_vs_sglang_le_0.8x", kv, "vs_sglang", "ttft_mean", 0.8)
    elif kv.get("vs_sglang"):
        _ratio_goal(out, "kv_hit_rate_vs_sglang_ge_plus_5_points", kv, "vs_sglang", "hit_rate_points", 5.0,
                    at_most=False)
        _ratio_goal(out, "kv_mean_ttft_vs_sglang_le_0.8x", kv, "vs_sglang", "ttft_mean", 0.8)
    mine = [r for r in rows if r["target"] != PEER and "[" not in r["target"]]  # variants are not policies
    if len(mine) > 1:  # kv alone is not "the lowest of kvgate's policies": not measured, not met
        out["kv_lowest_mean_ttft_of_kvgate_policies"] = min(mine, key=lambda r: r["ttft_mean_s"]) is kv
    pr = kv.get("prediction") or {}
    med, p90 = pr.get("ttft_ratio_p50"), pr.get("ttft_ratio_p90")
    out["kv_observed_over_predicted_median_in_0.8_1.25"] = med is not None and 0.8 <= med <= 1.25
    out["kv_observed_over_predicted_p90_le_2"] = p90 is not None and p90 <= 2.0
    ex = pr.get("cached_exact_share")
    out["kv_predicted_cached_eq_delivered_ge_90pct"] = ex is not None and ex >= 0.9
    return out


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_interval(xs: list, level: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of per-round figures: the k-th smallest and the k-th
    largest of n, for the largest k whose coverage (1 - 2 P(Binomial(n, 1/2) < k)) is at least ``level``;
    with too few rounds for ``level``, the range and its coverage (3 rounds: 75%). Why: on a shared host
    the per-round ratios spread 0.5-1.8x (docs/BENCHMARKS.md, session 27), so the median of a few rounds
    meets a goal by chance as often as not. None below two rounds."""
    xs = sorted(x for x in xs if x is not None)
    n = len(xs)
    if n < 2:
        return None

    def coverage(k: int) -> float:
        return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n

    k = 1
    while k + 1 <= n // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def summarize_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per target over ``--rounds`` (each round ran every target, in a balanced order):
    medians of its figures, and of its per-round ratios against the peer and round_robin (a ratio is
    only taken between targets of the same round), with their ranges. Same shape as a round's rows, so
    ``table`` and ``goals`` read it."""
    labels = list(dict.fromkeys(r["target"] for rows in rounds for r in rows))
    out = []
    for t in labels:
        rs = [r for rows in rounds for r in rows if r["target"] == t]
        row = {"target": t, "label": rs[0]["label"], "rounds": len(rs)}
        for k in ("cached_share", "ttft_mean_s", "ttft_p90_s", "total_s", "router_cpu_s", "server_api_cpu_s",
                  "server_engine_cpu_s"):
            row[k] = _median([r.get(k) for r in rs])
        for key in ("vs_sglang", "vs_round_robin"):
            per = [r[key] for r in rs if r.get(key)]
            if per:
                row[key] = {k: _median([p.get(k) for p in per]) for k in per[0]}
                row[key + "_range"] = {k: (min(v), max(v)) for k in per[0]
                                       if (v := [p[k] for p in per if p.get(k) is not None])}
                row[key + "_interval"] = {k: iv for k in ("hit_rate_points", "ttft_mean")
                                          if (iv := median_interval([p.get(k) for p in per]))}
                row[key + "_faster_rounds"] = sum(1 for p in per if (p.get("ttft_mean") or 1.0) < 1.0)
                row[key + "_rounds"] = len(per)  # fewer than the target's when the baseline failed in a round
        preds = [r["prediction"] for r in rs if r.get("prediction")]
        if preds:
            row["prediction"] = {k: _median([p.get(k) for p in preds])
                                 for k in ("ttft_ratio_p50", "ttft_ratio_p90", "cached_exact_share")}
        out.append(row)
    return out


def interval_lines(rows: list[dict]) -> list[str]:
    """Per target over rounds, its ratios against the peer (and round_robin, when it ran) as the median, the
    interval for it (:func:`median_interval`) and the rounds it was faster in."""
    out = []
    for key, base in (("vs_sglang", PEER), ("vs_round_robin", "round_robin")):
        for r in rows:
            iv = r.get(key + "_interval") or {}
            if r["target"] == base or "ttft_mean" not in iv:
                continue
            (tl, th, tc), vs = iv["ttft_mean"], r[key]
            n = r.get(key + "_rounds", r["rounds"])
            line = (f"{r['target']} vs {base} over {n} rounds: mean TTFT {vs['ttft_mean']:.2f}x "
                    f"({tl:.2f}-{th:.2f}x, a {tc:.0%} interval for the median; faster in "
                    f"{r[key + '_faster_rounds']} rounds)")
            if "hit_rate_points" in iv:
                hl, hh, _ = iv["hit_rate_points"]
                line += f", hit rate {vs['hit_rate_points']:+.1f} points ({hl:+.1f} to {hh:+.1f})"
            out.append(line)
    return out


def reference_line(rows: list[dict], ref: dict) -> str:
    """Each target's hit rate (the median over rounds) against the LRU reference of the workload
    (``mixed_workload.lru_reference``): how much of what one LRU cache of both servers would serve it got."""
    parts = [f"{r['target']} {100 * (r['cached_share'] - ref['median']):+.1f}" for r in rows
             if r.get("cached_share") is not None]
    return f"hit rate against the LRU reference ({100 * ref['median']:.1f}%), points: " + ", ".join(parts)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict]) -> str:
    lines = [
        "| target | hit rate (usage) | mean TTFT | p90 TTFT | total | mean TTFT vs sglang | vs round_robin "
        "| hit rate vs sglang | obs/pred TTFT median | p90 | predicted cached == delivered | router CPU "
        "| vLLM API servers' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs, rr, pr = r.get("vs_sglang") or {}, r.get("vs_round_robin") or {}, r.get("prediction") or {}
        lines.append(
            f"| {r['label']} | {r['cached_share']:.1%} | {r['ttft_mean_s']:.2f} s | {r['ttft_p90_s']:.2f} s "
            f"| {r['total_s']:.1f} s | {_x(vs.get('ttft_mean'))} | {_x(rr.get('ttft_mean'))} "
            f"| {_f(vs.get('hit_rate_points'), '{:+.1f} pts')} | {_f(pr.get('ttft_ratio_p50'))} "
            f"| {_f(pr.get('ttft_ratio_p90'))} | {_f(pr.get('cached_exact_share'), '{:.0%}')} "
            f"| {_f(r.get('router_cpu_s'), '{:.1f} s')} | {_f(r.get('server_api_cpu_s'), '{:.1f} s')} |"
        )
    return "\n".join(lines)


def run_target(target: str, servers, model_dir: str, clients: list[mw.Client], args, workdir: Path,
               rnd: int = 0) -> dict:
    """One target's run of the workload on the servers (caches emptied first). ``rnd``: the round, which
    names its decision records (``decisions-<target>-round<N>.json`` in the work directory)."""
    from bench.bench_gateway import tree_cpu_s
    from bench.bench_vllm_policies import MODEL, Gateway, reset_caches, scrape_prefix_cache, summarize

    reset_caches(servers)
    if args.g4:
        clear_g4(servers, args.g4_dir)
    for c in clients:  # fresh conversations (run_session rebuilds each one's messages)
        for s in c.sessions:
            s.messages = []
    kind_of_session = mw.kinds(clients)
    requests = sum(len(s.users) for c in clients for s in c.sessions)

    extra: dict = {}

    def drive(url: str, pid: int) -> tuple[list[TurnResult], float, list, list]:
        check_alive(servers)  # a server that died since its last request fails the target, not hangs it
        before = [scrape_prefix_cache(s.url) for s in servers]
        g4_before = [s.g4_stats() for s in servers] if args.g4 else []
        srv0 = [server_cpu_s(s) for s in servers]
        cpu0, t0 = tree_cpu_s(pid), time.perf_counter()
        res = asyncio.run(run_clients(url, MODEL, [c.sessions for c in clients], max_tokens=args.max_tokens,
                                      stagger_s=args.stagger))
        total = time.perf_counter() - t0
        # the router's own CPU: on a 2-core machine it is taken from the vLLM servers
        extra["router_cpu_s"] = tree_cpu_s(pid) - cpu0
        # the servers' own: the API server (HTTP, tokenizing, /metrics) shares the cores with the engines
        srv1 = [server_cpu_s(s) for s in servers]
        extra["server_api_cpu_s"] = sum(b[0] - a[0] for a, b in zip(srv0, srv1))
        extra["server_engine_cpu_s"] = sum(b[1] - a[1] for a, b in zip(srv0, srv1))
        if args.g4:  # what the connectors did during this target (counter deltas per server)
            extra["g4_stats"] = [{k: v - b.get(k, 0) for k, v in s.g4_stats().items() if isinstance(v, int)}
                                 for s, b in zip(servers, g4_before)]
        return res, total, before, [scrape_prefix_cache(s.url) for s in servers]

    if target.partition("[")[0] == PEER:  # sglang-router[round_robin]: another of its policies
        from bench.sim import procs
        from bench.sim.harness import Target, start_peer

        port = procs.free_port()
        label, policy, flags = peer_of(target)
        peer = start_peer(Target(label, PEER, policy, text=True, extra=flags), workdir,
                          [s.url for s in servers], port, {})
        try:
            results, total, before, after = drive(f"http://127.0.0.1:{port}", peer.p.pid)
        finally:
            peer.stop()
    else:
        policy, routing = variant_of(target)
        routing["decisions_kept"] = max(1000, 2 * requests)
        with Gateway(servers, model_dir, policy, workdir, routing=routing) as gw, \
                EventLog([sv.events_endpoint for sv in servers] if args.event_log else []) as log:
            results, total, before, after = drive(gw.url, gw.proc.pid)
            decisions = httpx.get(f"{gw.url}/admin/decisions", params={"limit": prediction.MAX_DECISIONS},
                                  timeout=60.0).json()
            workers = httpx.get(f"{gw.url}/admin/workers", timeout=60.0).json()
        kind_of_request = {r.request_id: kind_of_session.get(r.session, "?") for r in results if r.request_id}
        mine = [d for d in decisions["decisions"] if d.get("request_id") in kind_of_request]
        extra["prediction"] = prediction_stats(mine, kind_of_request)
        extra["added_ttft_ms"] = added_ttft_ms(results, mine)
        if args.event_log:  # when vLLM evicted what over-predicted decisions expected (bench/eviction_timing.py)
            names = [sv.name for sv in servers]
            extra["eviction_timing"] = et = attribute(log.events, mine, names)
            # per eviction model, what vLLM evicted while its requests waited; the raw stream too
            # (``python -m bench.eviction_timing DIR`` reads it again)
            extra["eviction_window"] = summarize_window(window_removals(log.events, mine, names))
            (workdir / f"events-{target}-round{rnd + 1}.json").write_text(json.dumps(log.events))
            print(f"  over-predicted {et['over_predicted']}, matched {et['matched']}: blocks removed before "
                  f"the decision {et['blocks_removed_before_decision']}, after it "
                  f"{et['blocks_removed_after_decision']} (median {et['removal_delay_s_median']} s)", flush=True)
        extra["decisions_seen"] = {"count": decisions["count"], "capacity": decisions["capacity"],
                                   "matched": len(mine)}
        extra["worker_prediction"] = {
            w.get("name"): (w.get("load") or {}).get("prediction")
            for w in (workers if isinstance(workers, list) else workers.get("workers", []))
        }
        label = f"kvgate {target}"
        (workdir / f"decisions-{target}-round{rnd + 1}.json").write_text(json.dumps(decisions))
    return {"target": target, "label": label, **summarize(results, total, before, after),
            "by_kind": by_kind(results, kind_of_session), **extra}


def server_cpu_s(server) -> tuple[float, float]:
    """CPU seconds of a vLLM server's API process and of its engine processes (all its descendants)."""
    from bench.bench_gateway import cpu_s
    from bench.sim.procs import children

    if server.proc is None:
        return 0.0, 0.0
    api, engine, todo = cpu_s(server.proc.pid), 0.0, children(server.proc.pid)
    while todo:
        pid = todo.pop()
        try:
            engine += cpu_s(pid)
        except OSError:  # gone meanwhile
            continue
        todo.extend(children(pid))
    return api, engine


def check_alive(servers) -> None:
    """Raise with the log's tail when a server's process has exited (the gateway would hold the clients'
    requests for want of a healthy worker until their timeout)."""
    for s in servers:
        if s.proc is None or s.proc.poll() is not None:
            code = None if s.proc is None else s.proc.returncode
            raise RuntimeError(f"{s.name} is not running (exit status {code}); log {s.log_path}:\n"
                               f"{s.log_tail()}")


def peer_of(target: str) -> tuple[str, str, list[str]]:
    """``sglang-router`` -> its ``cache_aware`` policy; ``sglang-router[round_robin]`` -> that one;
    ``sglang-router[cache_aware;max-tree-size=27000,...]`` (``--peer-variant``) -> that policy launched with
    ``--max-tree-size 27000 ...``. The label, the policy and the extra launch flags."""
    inner = target.partition("[")[2].rstrip("]")
    policy, _, spec = inner.partition(";")
    policy = policy or "cache_aware"
    flags = [x for k, v in (kv.split("=", 1) for kv in filter(None, spec.split(","))) for x in (f"--{k}", v)]
    return (f"sglang-router {policy}" + (f" ({spec})" if spec else "")), policy, flags


def order_lines(rounds: list[list[dict]]) -> list[str]:
    """Each target's per-round mean TTFT ratio and hit-rate points against each sglang-router target, the
    rounds it ran before that peer apart from those it ran after (rows are in run order)."""
    out = []
    peers = list(dict.fromkeys(r["target"] for rows in rounds for r in rows if r["target"].startswith(PEER)))
    targets = list(dict.fromkeys(r["target"] for rows in rounds for r in rows))
    for p in peers:
        for t in targets:
            if t == p:
                continue
            split: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
            for rows in rounds:
                names = [r["target"] for r in rows]
                if t not in names or p not in names:
                    continue
                a, b = rows[names.index(t)], rows[names.index(p)]
                if a["ttft_mean_s"] and b["ttft_mean_s"]:
                    split["before" if names.index(t) < names.index(p) else "after"].append(
                        (a["ttft_mean_s"] / b["ttft_mean_s"], 100 * (a["cached_share"] - b["cached_share"])))
            both = split["before"] + split["after"]
            if not both:
                continue
            parts = [f"{k} it {len(v)}: {_median([x for x, _ in v]):.2f}x, "
                     f"{_median([y for _, y in v]):+.1f} pts" for k, v in split.items() if v]
            out.append(f"{t} vs {p}: mean TTFT {_median([x for x, _ in both]):.2f}x, hit rate "
                       f"{_median([y for _, y in both]):+.1f} points over {len(both)} rounds (ran "
                       + "; ".join(parts) + ")")
    return out


def variant_of(target: str) -> tuple[str, dict]:
    """``kv[future_turns=5,stay_margin=0.5]`` (``--kv-variant``): the kv policy with those routing settings
    beside the default one, on the same servers and in the same rounds; a plain name has no overrides."""
    from bench.sim.harness import overrides

    policy, _, spec = target.partition("[")
    return policy, overrides(spec.rstrip("]"))


# MixSpec fields set by the chat options the default mode has too
CHAT_ARGS = {"chats": "sessions", "chat_turns": "turns", "first_tokens": "first_tokens",
             "turn_tokens": "turn_tokens"}
HELP = {"rag_questions": "requests per RAG user", "tool_tokens": "mean tool result per agent turn"}


def add_arguments(ap) -> None:
    """The capacity-bound options of ``bench.bench_vllm_policies``."""
    cap = ap.add_argument_group(
        "capacity-bound mode (issue #11)",
        "a mixed workload (RAG over shared documents, agent loops, the chat sessions above) against servers "
        "whose KV cache is a fraction of its working set; targets kvgate kv, round_robin, least_loaded and "
        "sglang-router cache_aware",
    )
    cap.add_argument("--capacity-bound", action="store_true")
    cap.add_argument("--rounds", type=int, default=1,
                     help="run every target this many times, the targets' positions balanced (order_of); "
                          "report medians")
    cap.add_argument("--kv-ratio", type=float, default=3.0,
                     help="working set (distinct prefix blocks) / one server's KV cache")
    cap.add_argument("--num-gpu-blocks", type=int, default=0, help="override the computed blocks per server")
    cap.add_argument("--block-size", type=int, default=32)
    cap.add_argument("--kv-variant", action="append", default=[], metavar="KEY=VALUE,...",
                     help="also run kv with these routing settings, as target kv[KEY=VALUE,...] (repeatable)")
    cap.add_argument("--peer-variant", action="append", default=[], metavar="KEY=VALUE,...",
                     help="also run sglang-router cache_aware launched with --KEY VALUE ..., as target "
                          "sglang-router[cache_aware;KEY=VALUE,...] (repeatable)")
    cap.add_argument("--event-log", action="store_true",
                     help="subscribe to the servers' KV events beside the gateway and report, for each "
                          "over-predicted decision, whether vLLM evicted its blocks before the decision "
                          "(index lag) or while it waited (bench/eviction_timing.py); the events go to "
                          "events-<target>-round<N>.json beside the decision records")
    cap.add_argument("--g4", action="store_true",
                     help="both servers run kvgate's connector on one shared G4 directory (emptied before each target)")
    cap.add_argument("--g4-config", action="append", default=[], metavar="KEY=VALUE",
                     help="with --g4: a kv_connector_extra_config key of kvgate's connector, e.g. "
                          "load_async=false (repeatable)")
    for f in dataclasses.fields(mw.MixSpec):
        if f.name not in CHAT_ARGS:
            cap.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help=HELP.get(f.name))


def spec_from(args) -> mw.MixSpec:
    return mw.MixSpec(**{f.name: getattr(args, CHAT_ARGS.get(f.name, f.name))
                         for f in dataclasses.fields(mw.MixSpec)})


def plan(model_dir: str, args) -> tuple[list[mw.Client], dict]:
    """The workload and the sizes of the run: working set, max_model_len, KV blocks per server."""
    clients = mw.make_mixed(model_dir, spec_from(args), seed=args.seed)
    ws = mw.working_set(model_dir, clients, args.block_size, args.max_tokens)
    max_model_len = -(-(ws["max_prompt_tokens"] + 2 * args.max_tokens + 64) // args.block_size) * args.block_size
    blocks = args.num_gpu_blocks or mw.kv_blocks_for(ws["distinct_blocks"], args.kv_ratio, args.block_size,
                                                       max_model_len)
    # both servers' KV as one LRU cache (vLLM's block pool sets the null block aside)
    ref = mw.lru_reference(model_dir, clients, args.block_size, 2 * (blocks - 1), args.max_tokens,
                           seed=args.seed)
    ws.update({
        "lru_reference": ref,
        "block_size": args.block_size, "max_model_len": max_model_len, "num_gpu_blocks": blocks,
        "server_cache_tokens": blocks * args.block_size,
        "working_set_over_one_server": ws["distinct_blocks"] / blocks,
        "working_set_over_fleet": ws["distinct_blocks"] / (2 * blocks),
        "clients": {k: sum(c.kind == k for c in clients) for k in ("rag", "agent", "chat")},
    })
    return clients, ws


def lru_line(b: dict) -> str:
    """What every router's hit rate on these servers is set beside (``mixed_workload.lru_reference``)."""
    return (f"{100 * b['median']:.1f}% ({100 * b['min']:.1f}-{100 * b['max']:.1f}% over {b['orders']} "
            f"interleavings of the clients) for both servers' KV as one least-recently-used cache, running "
            f"requests' blocks not counted; ceiling {100 * b['ceiling']:.1f}%")


def warm_up(servers, model_dir: str, tokens: int, max_tokens: int) -> None:
    """A long prompt through each fresh server (twice), so that the first target does not pay for the
    servers' first prefills; ``reset_caches`` empties the caches before every target anyway."""
    from bench.bench_vllm_policies import MODEL
    from bench.chat_workload import TextMaker

    tm = TextMaker(model_dir, 999)
    for s in servers:
        for _ in range(2):
            httpx.post(f"{s.url}/v1/completions", timeout=300.0,
                       json={"model": MODEL, "prompt": tm.text(tokens), "max_tokens": max_tokens}).raise_for_status()


def fresh_servers(servers, model_dir: str, prompt_tokens: int, max_tokens: int) -> None:
    """Restart both servers (and warm them up again) before a ``--g4`` target that is not the run's first.
    Why: a new gateway subscribing to a running server replays its buffered events (router: a first message
    with seq > 0), which hold the previous target's G4 ``BlockStored`` events; ``clear_g4`` deletes those
    files behind the index's back, so the next target was priced on phantom G4 entries (session 19: the
    second target's predicted cached tokens 0% exact). A restarted server's events start over at 0."""
    from bench.vllm_server import start_all

    for s in servers:
        s.stop()
    start_all(servers)
    warm_up(servers, model_dir, prompt_tokens, max_tokens)


def g4_config(pairs: list[str]) -> dict | None:
    """``["load_async=false", "read_threads=2"]`` -> ``{"load_async": False, "read_threads": 2}`` (JSON
    values; anything else is a string)."""
    out = {}
    for kv in pairs:
        key, _, value = kv.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out or None


def clear_g4(servers, g4_dir: str) -> None:
    """Empty the shared G4 directory between targets (its namespace files stay, the servers keep running):
    wait for the connectors' planned saves, delete every block file, then wait out the scheduler side's
    presence cache (a block it saw within its TTL would be offered, fail to load and be recomputed)."""
    import inspect

    from bench.redbook_runs import wait_saves
    from cache_tier.store import PresenceCache

    wait_saves(servers)
    for ns in Path(g4_dir).iterdir():
        if ns.is_dir():
            for p in ns.rglob("*"):
                if p.is_file() and p.suffix != ".json":
                    p.unlink(missing_ok=True)
    time.sleep(inspect.signature(PresenceCache).parameters["ttl_s"].default + 1.0)


def run(args, model_dir: str) -> int:
    from bench.bench_vllm_policies import MODEL
    from bench.vllm_server import VllmServer, one_core_each, start_all

    clients, ws = plan(model_dir, args)
    print(
        f"working set: {ws['distinct_blocks']} distinct blocks x {ws['block_size']} = "
        f"{ws['distinct_prefix_tokens']} prefix tokens over {ws['requests']} requests "
        f"({ws['prompt_tokens']} prompt tokens, longest {ws['max_prompt_tokens']}); clients {ws['clients']}\n"
        f"KV cache per server: {ws['num_gpu_blocks']} blocks = {ws['server_cache_tokens']} tokens "
        f"(--num-gpu-blocks-override, max_model_len {ws['max_model_len']}): working set = "
        f"{ws['working_set_over_one_server']:.2f}x one server, {ws['working_set_over_fleet']:.2f}x both\n"
        f"LRU reference: {lru_line(ws['lru_reference'])}",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-capacity-"))
    args.g4_dir = str(workdir / "g4") if args.g4 else None
    servers = [
        VllmServer(model_dir, name=f"vllm-{i}", served_model_name=MODEL, omp_threads_bind=bind,
                   block_size=args.block_size, max_model_len=ws["max_model_len"],
                   num_gpu_blocks=ws["num_gpu_blocks"], g4_path=args.g4_dir,
                   g4_config=g4_config(args.g4_config))
        for i, bind in enumerate(one_core_each(2))
    ]
    print(f"starting two vLLM servers ({args.size}); logs under {workdir} and "
          f"{[str(s.workdir) for s in servers]}", flush=True)
    rounds: list[list[dict]] = []
    failed: dict[str, str] = {}
    t_run = time.perf_counter()
    try:
        start_all(servers)
        warm_up(servers, model_dir, ws["max_prompt_tokens"], args.max_tokens)
        from bench.sim import harness

        targets = [t.strip() for t in (args.policies or TARGETS).split(",") if t.strip()]
        targets += [f"kv[{spec}]" for spec in args.kv_variant]
        targets += [f"{PEER}[cache_aware;{spec}]" for spec in args.peer_variant]
        if args.rounds > 1 and args.rounds % (2 * len(targets)):
            print(f"note: {args.rounds} rounds do not balance {len(targets)} targets' positions (a multiple "
                  f"of {2 * len(targets)} does)", flush=True)
        for rnd in range(max(1, args.rounds)):
            order = harness.order_of(targets, rnd)  # positions balanced (the order moves a target)
            rows = []
            for i, target in enumerate(order):
                print(f"round {rnd + 1}, target {target}: {ws['requests']} requests ...", flush=True)
                try:
                    if args.g4 and (rnd or i):
                        fresh_servers(servers, model_dir, ws["max_prompt_tokens"], args.max_tokens)
                    rows.append(run_target(target, servers, model_dir, clients, args, workdir, rnd))
                except Exception as e:  # noqa: BLE001 - one failed target must not lose the others
                    failed[f"{target} (round {rnd + 1})"] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"  {target} failed: {failed[f'{target} (round {rnd + 1})']}", flush=True)
                    continue
                r = rows[-1]
                print(f"  hit {r['cached_share']:.1%}  mean TTFT {r['ttft_mean_s']:.2f} s  total {r['total_s']:.1f} s"
                      f"  per server {r['requests_per_server']}  preempted {r['preemptions_per_server']}", flush=True)
            add_ratios(rows)
            rounds.append(rows)
    finally:
        for s in servers:
            s.close()
    rows = rounds[0] if len(rounds) == 1 else summarize_rounds(rounds)
    checked = goals(rows, g4=bool(args.g4))
    print()
    if len(rounds) > 1:
        for i, rd in enumerate(rounds):
            print(f"round {i + 1} (order {', '.join(r['target'] for r in rd)}):\n{table(rd)}\n")
        print(f"median of {len(rounds)} rounds (ratios: the median of per-round ratios; ranges in the JSON):")
    print(table(rows))
    print()
    for line in interval_lines(rows) + (order_lines(rounds) if len(rounds) > 1 else []):
        print(line)
    print(reference_line(rows, ws["lru_reference"]))
    for k, v in checked.items():
        print(f"- {k}: {'met' if v else 'NOT met'}")
    for name, why in failed.items():  # their rounds have no ratio against them: the medians are over fewer
        print(f"FAILED {name}: {why.splitlines()[0] if why else ''}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench.sim.harness import peer_version

    out.write_text(json.dumps({"args": vars(args), "workload": ws, "wall_s": time.perf_counter() - t_run,
                               "peer_version": peer_version(PEER), "results": rows, "rounds": rounds,
                               "goals": checked, "failed": failed},
                              indent=2) + "\n")
    print(f"\nwritten to {out}")
    return 0 if rows and not failed else 1
