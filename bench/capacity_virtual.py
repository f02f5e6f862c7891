"""The capacity-bound run on the virtual clock: ``python -m bench.capacity_virtual``.

The mixed workload of the capacity-bound real-vLLM benchmark (``bench.capacity_bound``: the same
``MixSpec`` and seeds, rendered with the tiny model's chat template into token ids, placeholder answers of
``--max-tokens`` tokens), its clients run in a closed loop as there (each turn waits for the last answer;
clients start ``--stagger`` s apart), against two simulated engines (``bench.sim.engine``) whose KV caches
are ``1/--kv-ratio`` of the working set, on the virtual clock (``bench.sim.virtual``): no HTTP, no gateway,
no wall time, so a run is deterministic and takes seconds.

Why: on real vLLM one round of the capacity-bound run takes minutes and kv's hit rate spread 34-61% over
seven rounds of one code (session 14), so a policy change cannot be told from chance there. Here every
placement is compared on the same seeds, and the spread over seeds shows how much of a real run's spread the
closed loop itself makes. Placements: the kv policy's scorers over candidates priced with the engines' true
state (``bench.policy_virtual.candidate``: its real hit now, the queue's prefill time), with variants of its
routing settings; the sglang-router ``cache_aware`` emulation (``bench.policy_virtual``); round_robin;
least prefill time ahead (``bench.sim.virtual``'s own). The engines' timing is a CPU-vLLM-like model set by
``--prefill-tps`` and ``--step-ms`` (not calibrated to one machine: policies are compared, not seconds).
``--g4``: the engines share one G4 store, as the real run's ``--g4`` (kvgate's connector on both servers):
every prompt's full blocks are written after its prefill, a local miss loads them (asynchronously, one load
at a time per engine at ``--g4-gbps``), and the gateway's candidates price that load.
``--jitter J``: each seed also runs with the prefill speed and the step time ``J`` slower and faster (nine
timings). On real vLLM kv's rounds of one seed fall into two basins, set by which prefill finished a tenth
of a second first; here the timings stand in for that: at ``--jitter 0.13`` kv's defaults on seed 0 (slow
host figures, ``--gateway --prefill-tps 150 --step-ms 1000 --batched-tokens 2048``) reach 61% hits at
six of nine timings and 49-57% at the others, so a placement meant to pick the good basin can be told
from one that got lucky.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from itertools import count
from pathlib import Path

from bench import mixed_workload as mw
from bench.policy_virtual import placer, sglang_cache_aware
from router.policies.kv import kv_order, scorers_of
from bench.sim import virtual as vt
from bench.sim.cache import MEDIUM_GPU, PrefixCache, SharedG4Store, external
from bench.sim.engine import SimEngine
from bench.sim.events import BlockRemoved, BlockStored
from indexer.hashing import chained_run
from bench.sim.timing import TimingModel
from indexer.index.base import WorkerMatch
from router.config import RoutingConfig, WorkerConfig
from router.cost import Candidate, CostModel
from router.eviction import observe_delivery
from router.admission import PrefillGate, gate_budget, gate_orders
from router.kv_room import kv_room
from router.load import ActiveSequences, Sequence, shared_blocks
from router.worker import Worker, WorkerLoad


@dataclass
class Turn:
    client: int
    kind: str
    session: str
    turn: int
    prompt: int
    cached: int
    ttft_s: float
    worker: int


def render_clients(tokenizer_dir: str, spec: mw.MixSpec, seed: int, answer_tokens: int) -> list[tuple[str, list]]:
    """Per client: its kind and, per session, every turn's prompt as token ids."""
    clients = mw.make_mixed(tokenizer_dir, spec, seed=seed)
    return [(c.kind, sessions) for c, sessions in zip(clients, mw.render_prompts(tokenizer_dir, clients, answer_tokens))]


def prompts_of(clients) -> list[list[int]]:
    return [ids for _, sessions in clients for turns in sessions for ids in turns]


def cpu_timing(prefill_tps: float = 1500.0, step_ms: float = 30.0, batched_tokens: int = 4096,
               g4_read_gbps: float = 1.0) -> TimingModel:
    """A small model on one CPU core: prefill linear in the new tokens (no attention term at these
    lengths), a fixed cost per request, a decode step of ``step_ms``; G4 blocks of a 12-layer, 768-wide
    bf16 model (36 KiB of KV per token) read at ``g4_read_gbps`` GB/s (a file read and a copy on a CPU),
    in the step when that takes at most 20 ms, as kvgate's connector does by default (``load_async: auto``)."""
    return TimingModel(overhead_s=0.02, a_s_per_token=1.0 / prefill_tps, decode_s=step_ms / 1000.0,
                       decode_s_per_seq=0.001, max_num_seqs=256, max_num_batched_tokens=batched_tokens,
                       kv_bytes_per_token=36_864, g4_read_bytes_per_s=g4_read_gbps * 1e9,
                       g4_sync_load_max_s=0.02)


def round_robin():
    turn = count()
    return lambda engines, tokens: next(turn) % len(engines)


@dataclass
class _Stored:
    """An engine's event publisher, as the gateway's ingestor at each step's end: its GPU blocks stored and
    removed go into the gateway's index of that engine (``GatewayView.indexed``), and (with
    ``admit_on_events``) the stored ones to its load tracker (router/state.py ``_observe_events``)."""

    view: GatewayView
    engine: int

    def publish(self, events) -> None:
        tracker = self.view.tracker(self.engine) if self.view.admit_on_events else None
        indexed = self.view.indexed.setdefault(self.engine, set())
        for ev in events:
            if getattr(ev, "medium", None) != MEDIUM_GPU:
                continue
            if isinstance(ev, BlockStored):
                indexed.update(ev.block_hashes)
                if tracker is not None:
                    tracker.stored(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                indexed.difference_update(ev.block_hashes)


async def closed_loop(clients, place, *, workers: int, num_blocks: int, block_size: int, timing: TimingModel,
                      max_tokens: int, stagger_s: float, g4: bool = False, asked_tokens: int = 0,
                      usage: bool = True) -> list[Turn]:
    """Every client's sessions in order, each turn sent when the last one's answer is complete; call on a
    :class:`bench.sim.virtual.VirtualLoop`. ``g4``: the engines share one G4 store (kvgate's connector on
    both servers: every prompt's full blocks are written after its prefill, and a local miss loads them).
    ``asked_tokens``: the load trackers see requests asking for this many tokens (``max_tokens`` in the
    body) while the engines answer ``max_tokens``, as a chat client that asks for 4,096 and gets 50;
    ``usage``: each response tells the tracker what it generated (``usage.completion_tokens``).
    A placement with a ``gate`` (the kv placements' routing settings, when ``prefill_gate`` is on) holds each
    request at the gateway's prefill gate (router/admission.py) on the engine's load tracker, as the gateway
    does."""
    store = SharedG4Store() if g4 else None
    view: GatewayView | None = getattr(place, "view", None)  # the kv placer's load trackers, fed here
    engines = [SimEngine(PrefixCache(num_blocks, block_size, g4=store), _Stored(view, i) if view else None,
                         timing) for i in range(workers)]
    for e in engines:
        e.start()
    loop = asyncio.get_running_loop()
    out: list[Turn] = []
    routing = getattr(place, "gate", None)  # the placement's RoutingConfig when it gates
    gates = [PrefillGate(clock=loop.time) for _ in engines] if view is not None and routing is not None else None
    budget = gate_budget(routing, timing.max_num_batched_tokens) if gates else 0
    if gates and not gate_orders(budget, routing.prefill_tokens_per_s, routing.prefill_gate_max_wait_s):
        gates = None  # as the gateway's: it stands aside where a step's prefill outlasts its wait

    async def client(i: int, kind: str, sessions) -> None:
        await asyncio.sleep(i * stagger_s)
        for s, prompts in enumerate(sessions):
            for t, tokens in enumerate(prompts):
                w = place(engines, tokens)
                t0 = loop.time()
                seq = view.sent(w, engines[w], tokens, asked_tokens or max_tokens) if view else None
                if gates:
                    await gates[w].admit(view.tracker(w), seq, budget, routing.prefill_gate_max_wait_s)
                r = engines[w].submit(list(tokens), max_tokens)
                first = None
                while (chunk := await r.out.get()) is not None:
                    if first is None and chunk:
                        first = loop.time()
                        if view:
                            view.first(w, seq)
                            if gates:
                                gates[w].wake()
                if view:
                    view.done(w, seq, r.cached_tokens, None if first is None else first - t0,
                              r.n_out if usage else None)
                    if gates:
                        gates[w].wake()
                out.append(Turn(i, kind, f"{i}.{s}", t, len(tokens), r.cached_tokens, (first or loop.time()) - t0, w))

    try:
        await asyncio.gather(*(client(i, kind, sessions) for i, (kind, sessions) in enumerate(clients)))
    finally:
        for e in engines:
            await e.stop()
    return out


def summary(turns: list[Turn]) -> dict:
    prompt = sum(t.prompt for t in turns)
    by_kind = {}
    for k in sorted({t.kind for t in turns}):
        ts = [t for t in turns if t.kind == k]
        by_kind[k] = sum(t.cached for t in ts) / max(1, sum(t.prompt for t in ts))
    return {"requests": len(turns), "hit_rate": sum(t.cached for t in turns) / max(1, prompt),
            "ttft_mean_s": statistics.fmean(t.ttft_s for t in turns) if turns else 0.0, "by_kind": by_kind}


PEER = "sglang-router cache_aware (emulated)"


def table(results: dict[str, list[dict]], seeds: list) -> str:
    """Medians over the seeds, with ranges; against the peer, the median of the per-seed differences (the
    seeds are paired: the same workload and timing), with the worst seed's."""
    def rng(xs, fmt):
        return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"

    pct, sec = (lambda x: f"{x:.1%}"), (lambda x: f"{x:.2f}")
    peer = results.get(PEER)
    lines = [(f"| placement | hit rate over seeds {','.join(map(str, seeds))}: median (range) | mean TTFT s | "
              "hit vs sglang: median, worst seed | mean TTFT vs sglang: median, worst seed |"),
             "|---|---|---|---|---|"]
    for name, ss in results.items():
        h, t = [s["hit_rate"] for s in ss], [s["ttft_mean_s"] for s in ss]
        vs = "- | -"
        if peer and name != PEER:
            d = [100 * (a["hit_rate"] - b["hit_rate"]) for a, b in zip(ss, peer)]
            r = [a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in zip(ss, peer)]
            vs = f"{statistics.median(d):+.1f} pts, {min(d):+.1f} | {statistics.median(r):.2f}x, {max(r):.2f}x"
        lines.append(f"| {name} | {rng(h, pct)} | {rng(t, sec)} | {vs} |")
    return "\n".join(lines)


def prediction_table(results: dict[str, list[dict]], seeds: list) -> str:
    """Per predictor, medians (ranges) over the seeds of the shares of requests whose predicted cached
    tokens were equal to, above and below what the engine delivered."""
    lines = [f"| eviction model | cached == delivered, seeds {','.join(map(str, seeds))} | over | under | "
             "mean abs error, tokens | obs/pred TTFT median | p90 |", "|---|---|---|---|---|---|---|"]
    for name, ss in results.items():
        cols = []
        for k in ("exact", "over", "under", "mean_abs_error_tokens", "ttft_ratio_median", "ttft_ratio_p90"):
            xs = [x["prediction"][k] for x in ss]
            f = (lambda v: f"{v:.0f}") if k.startswith("mean") else (
                (lambda v: f"{v:.2f}") if k.startswith("ttft") else (lambda v: f"{v:.1%}"))
            cols.append(f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})")
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


VARIANTS = {
    "kv defaults": {},
    "kv prefill_gate=0": {"prefill_gate": False},
    "kv future_turns=0, stay_margin=0": {"future_turns": 0.0, "stay_margin": 0.0},
}


class GatewayView:
    """Each engine's KV room as the gateway sees it: vLLM's usage as of its last scrape (kv_cache_usage_perc,
    one every ``scrape_s``: the gateway's health_interval_s; the first look in a tick scrapes, so it is at
    most that old), and with ``live`` corrected by what the gateway's own requests took and freed since
    (its load tracker, router/load.py ``ActiveSequences``, fed by the closed loop: sent, first token, done).
    ``scrape_s`` 0: the engines' own room, now."""

    def __init__(self, scrape_s: float, live: bool) -> None:
        self.scrape_s, self.live = scrape_s, live
        self.active: dict[int, ActiveSequences] = {}
        self.admit_on_events = True  # its engines' BlockStored events reach the trackers (``_Stored``)
        # engine -> the GPU blocks the gateway's index shows: its KV events, applied at each step's end
        self.indexed: dict[int, set[int]] = {}
        self.seen: dict[int, tuple[int, WorkerLoad]] = {}  # engine -> (scrape tick, what it read)

    def tracker(self, i: int) -> ActiveSequences:
        if i not in self.active:
            self.active[i] = ActiveSequences(clock=asyncio.get_running_loop().time)
        return self.active[i]

    def free_of(self, i: int, e: SimEngine) -> float | None:
        if self.scrape_s <= 0:
            return None
        tick = int(asyncio.get_running_loop().time() // self.scrape_s)
        if self.seen.get(i, (None,))[0] != tick:
            self.seen[i] = (tick, WorkerLoad(kv_usage=e.cache.usage(), num_gpu_blocks=e.cache.num_blocks,
                                             updated_at=1.0, running=float(e.running),
                                             waiting=float(e.num_waiting)))
            self.tracker(i).mark_scrape(float(e.num_waiting))
        since = self.tracker(i).kv_since_scrape() if self.live else 0.0
        return kv_room(self.seen[i][1], e.block_size, since)[0]

    def sent(self, i: int, e: SimEngine, tokens: list[int], max_tokens: int) -> Sequence:
        digests = e.cache.digests(tokens)
        hashes = [external(d) for d in digests[: len(tokens) // e.block_size]]
        # its uncached prompt as the engine holds it now (what the prefill gate orders by)
        hit = e.cache.longest_hit(digests, len(tokens), hashes[: (len(tokens) - 1) // e.block_size])
        return self.tracker(i).add(len(tokens) - hit * e.block_size, 0.0, 1.0, streamed=True,
                                   tokens=len(tokens), max_tokens=max_tokens, hashes=hashes,
                                   block_size=e.block_size)

    def first(self, i: int, seq: Sequence) -> None:
        self.tracker(i).first_token(seq)

    def done(self, i: int, seq: Sequence, delivered: int = 0, ttft_s: float | None = None,
             completion: int | None = None) -> None:
        self.tracker(i).finish(seq, completion)


class _Session15Tracker(ActiveSequences):
    """The load tracker as the eviction model read it before session 16, for the comparison: every
    prefilling request's uncached prompt is demand (none admitted), the queue's own prefixes are not lost
    ahead of it (no cascade), and no request in flight holds part of a prefix."""

    def mark_scrape(self, waiting: float | None = None, snapshot: tuple | None = None) -> None:
        super().mark_scrape(None, snapshot)

    def queue_losses(self, free_tokens: float, now: float | None = None) -> float:
        return 0.0

    def held_blocks(self, hashes, n: int) -> int:
        return 0


class PredictingView(GatewayView):
    """A :class:`GatewayView` that also predicts, as the gateway does (router/cost.py ``CostModel.score``
    on its load tracker, the scraped gauges and its index: the engine's KV events up to its last step's
    end), the cached tokens of each request on the worker it was placed on, and learns the eviction scale
    from what the engine delivered (router/eviction.py ``observe_delivery``). The placement is not changed:
    the predictions are scored against the same turns. ``current`` False: the tracker as it was before
    session 16 (:class:`_Session15Tracker`)."""

    def __init__(self, scrape_s: float, routing: dict, current: bool = True) -> None:
        super().__init__(scrape_s or 1.0, live=True)
        self.cost = CostModel(RoutingConfig(**routing))
        self.current = current
        self.workers: dict[int, Worker] = {}
        self.priced: dict[int, Candidate] = {}  # id(seq) -> its prediction
        self.outcomes: list[tuple[int, int, int]] = []  # (indexed prefix tokens, predicted, delivered)
        self.ttft_ratios: list[float] = []  # observed / predicted TTFT
        self.placed: dict[int, tuple[Candidate, list[int]]] = {}  # the last placement's prices, per engine

    def tracker(self, i: int) -> ActiveSequences:
        if i not in self.active:
            kind = ActiveSequences if self.current else _Session15Tracker
            self.active[i] = kind(clock=asyncio.get_running_loop().time)
        return self.active[i]

    def price(self, i: int, e: SimEngine, tokens: list[int]) -> tuple[Candidate, list[int]]:
        """The gateway's candidate for ``tokens`` on engine ``i`` now, and the prompt's block hashes."""
        bs = e.block_size
        digests = e.cache.digests(tokens)
        hashes = [external(d) for d in digests[: (len(tokens) - 1) // bs]]
        w = self.workers.setdefault(i, Worker(name=str(i), url="sim", config=WorkerConfig(url="sim")))
        self.free_of(i, e)  # scrapes when due
        w.active, w.load = self.tracker(i), self.seen[i][1]
        # the index as the gateway's: the engine's KV events up to its last step's end, so blocks the step in
        # flight evicted still show (read from the engine's cache instead, an eviction-model change scored
        # 89.0% against main's 86.6% here and 80.5% against 85.9% on real vLLM: session 42)
        idx = self.indexed.get(i, ())
        stored = chained_run(0, len(hashes), lambda k: hashes[k] in idx)
        g4 = e.cache.g4_run(hashes)  # the index's G4 run, from the first block
        # blocks requests in flight here are computing (the gateway's pending blocks, router/pending.py)
        inflight = max((shared_blocks(hashes, s.hashes) for s in w.active._live.values() if s.hashes), default=0)
        local = max(stored, inflight)
        return self.cost.score(w, WorkerMatch(gpu=local, local=local), g4, len(tokens), bs, local - stored,
                               hashes), hashes

    def sent(self, i: int, e: SimEngine, tokens: list[int], max_tokens: int) -> Sequence:
        # the placement's own pricing of this request on engine i, when it priced it (nothing ran since)
        c, hashes = self.placed.pop(i, None) or self.price(i, e, tokens)
        self.placed.clear()
        seq = self.workers[i].active.add(c.uncached_tokens, c.prefill_work, c.predicted_ttft_ms / 1000.0,
                                         streamed=True, tokens=len(tokens), max_tokens=max_tokens,
                                         hashes=hashes, block_size=e.block_size, prefix_blocks=c.local_blocks)
        self.priced[id(seq)] = c
        return seq

    def done(self, i: int, seq: Sequence, delivered: int = 0, ttft_s: float | None = None,
             completion: int | None = None) -> None:
        super().done(i, seq, completion=completion)
        c = self.priced.pop(id(seq))
        observe_delivery(self.workers[i].eviction, c, delivered, seq.block_size)
        if ttft_s is not None:
            self.cost.observe_ttft(self.workers[i], ttft_s, c)
            self.ttft_ratios.append(ttft_s * 1000.0 / max(1e-6, c.predicted_ttft_ms))
        self.outcomes.append(((c.local_blocks + c.evicted_blocks) * seq.block_size, c.cached_tokens, delivered))


def prediction_summary(outcomes: list[tuple[int, int, int]], ttft_ratios: list[float] = ()) -> dict:
    """How the predicted cached tokens compare with the delivered (the share equal, over and under), and
    the median and p90 of observed / predicted TTFT."""
    n = max(1, len(outcomes))
    r = sorted(ttft_ratios)
    return {"requests": len(outcomes), "exact": sum(p == d for _, p, d in outcomes) / n,
            "over": sum(p > d for _, p, d in outcomes) / n, "under": sum(p < d for _, p, d in outcomes) / n,
            "mean_abs_error_tokens": sum(abs(p - d) for _, p, d in outcomes) / n,
            "ttft_ratio_median": statistics.median(r) if r else None,
            "ttft_ratio_p90": r[min(len(r) - 1, int(0.9 * len(r)))] if r else None}


def _fed(place, view, rc: RoutingConfig):
    """``place`` with the load trackers ``closed_loop`` feeds (``place.view``) and, when ``rc`` turns the
    prefill gate on, the settings it gates by (``place.gate``)."""
    place.view, place.gate = view, (rc if rc.prefill_gate else None)
    view.admit_on_events = rc.admit_on_events
    return place


def kv_placer(routing: dict, scrape_s: float = 0.0, live: bool = True):
    """The kv policy's placement over the KV room a :class:`GatewayView` shows (``place.view``)."""
    view = GatewayView(scrape_s, live)
    rc = RoutingConfig(**routing)
    place = placer(rc, lambda i, e: view.free_of(i, e))
    return _fed(place, view, rc)


def predicting_placer(routing: dict, scrape_s: float = 1.0, current: bool = True):
    """The kv placement, with the gateway's predictions of each request's cached tokens (``place.view``,
    a :class:`PredictingView`)."""
    view = PredictingView(scrape_s, routing, current)
    rc = RoutingConfig(**routing)
    place = placer(rc, lambda i, e: view.free_of(i, e))
    return _fed(place, view, rc)


def calibrated(timing: TimingModel, block_size: int = 32) -> dict:
    """The cost model's figures for engines of ``timing`` (``cpu_timing``), as if calibrated: the gateway
    learns them from vLLM's histograms, which the engines here do not export."""
    return {"prefill_tokens_per_s": 1.0 / timing.a_s_per_token, "attention_knee_tokens": 0,
            "step_ms": timing.decode_s * 1000.0, "per_decode_ms": timing.decode_s_per_seq * 1000.0,
            "request_overhead_ms": timing.overhead_s * 1000.0,
            "max_num_batched_tokens": timing.max_num_batched_tokens,
            "g4_bytes_per_block": timing.kv_bytes_per_token * block_size,
            "g4_bytes_per_s": timing.g4_read_bytes_per_s}


def gateway_placer(routing: dict, timing: TimingModel, scrape_s: float = 1.0, block_size: int = 32):
    """The kv policy as the gateway runs it: its scorers over the gateway's own predicted candidates (a
    :class:`PredictingView` per engine, the cost model at the engines' figures, ``calibrated``), not the
    engines' true state."""
    cfg = {**calibrated(timing, block_size), **routing}
    view = PredictingView(scrape_s, cfg)
    rc = RoutingConfig(**cfg)
    scorers, turn = scorers_of(rc), count(1)

    def place(engines: list[SimEngine], tokens: list[int]) -> int:
        view.placed = {i: view.price(i, e, tokens) for i, e in enumerate(engines)}
        cands = [c for c, _ in view.placed.values()]
        return int(kv_order(cands, next(turn) % len(engines), scorers, rc.overlap_share)[0].worker)

    return _fed(place, view, rc)


PREDICTORS = {"session 16: admitted, held, cascade": True, "before: every prefilling prompt is demand": False}


def placements(variants: dict[str, dict], scrape_s: float = 0.0, live: bool = True,
               gateway: TimingModel | None = None, block_size: int = 32) -> dict:
    """Fresh placement state per run: name -> factory. ``gateway``: the engines' timing, to add each
    variant as the gateway runs it (``gateway_placer``)."""
    out = {f"{name}": (lambda r=routing: kv_placer(r, scrape_s, live)) for name, routing in variants.items()}
    if gateway is not None:
        out.update({f"{name}, gateway's predictions":
                    (lambda r=routing: gateway_placer(r, gateway, scrape_s or 1.0, block_size))
                    for name, routing in variants.items()})
    out[PEER] = sglang_cache_aware
    out["round_robin"] = round_robin
    out["least prefill ahead"] = lambda: None
    return out


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The capacity-bound run's workload flags, at the values its real-vLLM runs use (docs/BENCHMARKS.md)."""
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=800)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--agent-turns", type=int, default=6)
    p.add_argument("--rag-docs", type=int, default=3)
    p.add_argument("--rag-users", type=int, default=4)
    p.add_argument("--rag-questions", type=int, default=5)
    p.add_argument("--doc-tokens", type=int, default=1000)


def workload_spec(args) -> mw.MixSpec:
    return mw.MixSpec(rag_docs=args.rag_docs, rag_users=args.rag_users, rag_questions=args.rag_questions,
                      doc_tokens=args.doc_tokens, agents=args.agents, agent_turns=args.agent_turns,
                      chats=args.sessions, chat_turns=args.turns, first_tokens=args.first_tokens,
                      turn_tokens=args.turn_tokens)


def main(argv: list[str] | None = None) -> int:
    from bench.tiny_model import build_tokenizer

    p = argparse.ArgumentParser(prog="python -m bench.capacity_virtual", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9", help="workload seeds (comma-separated)")
    p.add_argument("--kv-ratio", type=float, default=3.0, help="working set / one engine's KV cache")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--asked-tokens", type=int, default=0,
                   help="the gateway sees requests asking for this many tokens while the engines answer "
                        "--max-tokens (a chat client that asks for 4,096 and gets 50); 0: what they get")
    p.add_argument("--no-usage", action="store_true",
                   help="responses do not tell the gateway how many tokens they generated")
    p.add_argument("--stagger", type=float, default=0.5)
    p.add_argument("--prefill-tps", type=float, default=1500.0, help="prefill tokens per second per engine")
    p.add_argument("--step-ms", type=float, default=30.0, help="a decode step's base time")
    p.add_argument("--batched-tokens", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="also run each seed with the prefill speed and the step time this share slower and "
                        "faster (9 timings): how much a placement depends on timing")
    p.add_argument("--g4", action="store_true", help="both engines share a G4 store (the --g4 real run)")
    p.add_argument("--g4-gbps", type=float, default=1.0, help="G4 read bandwidth per engine, GB/s")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE,...",
                   help="also run kv with these routing settings (repeatable)")
    p.add_argument("--scrape-s", type=float, default=1.0,
                   help="kv candidates see each engine's KV usage as of a scrape this often (0: exact)")
    p.add_argument("--stale", action="store_true",
                   help="without the gateway's correction of the scraped usage by its own requests")
    p.add_argument("--only", default="", help="run only placements whose name contains this")
    p.add_argument("--json", help="write every run's summary here")
    p.add_argument("--gateway", action="store_true",
                   help="also run each kv variant on the gateway's own predicted candidates (its cost model at "
                        "the engines' figures) instead of the engines' true state")
    p.add_argument("--predict", action="store_true",
                   help="instead: how well the gateway's cost model predicts each request's cached tokens under "
                        "the kv placement (the eviction model now and before session 16)")
    add_workload_arguments(p)
    args = p.parse_args(argv)
    from bench.sim.harness import overrides

    spec = workload_spec(args)
    variants = dict(VARIANTS)
    for v in args.variant:
        variants[f"kv {v}"] = overrides(v)
    j = args.jitter
    scales = [(a, b) for a in (1.0 - j, 1.0, 1.0 + j) for b in (1.0 - j, 1.0, 1.0 + j)] if j else [(1.0, 1.0)]
    timings = [(f"prefill x{a:g}, step x{b:g}", cpu_timing(args.prefill_tps * a, args.step_ms * b,
                                                            args.batched_tokens, args.g4_gbps)) for a, b in scales]

    def runs_for(timing):
        if args.predict:
            return {k: (lambda c=c: predicting_placer(calibrated(timing, args.block_size), args.scrape_s or 1.0,
                                                      c)) for k, c in PREDICTORS.items()}
        return {k: f for k, f in placements(variants, args.scrape_s, not args.stale,
                                            timing if args.gateway else None, args.block_size).items()
                if args.only in k}

    results: dict[str, list[dict]] = {k: [] for k in runs_for(timings[0][1])}
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="kvgate-capvirt-") as tokdir:
        build_tokenizer(Path(tokdir))
        workloads = [render_clients(tokdir, spec, seed, args.max_tokens) for seed in seeds]
    for seed, clients in zip(seeds, workloads):
        prompts = prompts_of(clients)
        ws = mw.distinct_blocks(prompts, args.block_size)
        longest = max(map(len, prompts)) + args.max_tokens
        blocks = mw.kv_blocks_for(ws, args.kv_ratio, args.block_size, longest)
        print(f"seed {seed}: {len(prompts)} requests, working set {ws} blocks, "
              f"{blocks} per engine", flush=True)
        for label, timing in timings:
            if j:
                print(f" {label}", flush=True)
            for name, make in runs_for(timing).items():
                place = make()
                turns = vt.run(closed_loop(clients, place or vt._place, workers=2, num_blocks=blocks,
                                           block_size=args.block_size, timing=timing, max_tokens=args.max_tokens,
                                           stagger_s=args.stagger, g4=args.g4, asked_tokens=args.asked_tokens,
                                           usage=not args.no_usage))
                s = summary(turns)
                if args.predict or hasattr(place, "view") and hasattr(place.view, "outcomes"):
                    s["prediction"] = prediction_summary(place.view.outcomes, place.view.ttft_ratios)
                    pr = s["prediction"]
                    print(f"  {name}: " + "  ".join(f"{k} {pr[k]:.1%}" for k in ("exact", "over", "under"))
                          + (f"  obs/pred TTFT median {pr['ttft_ratio_median']:.2f} "
                             f"p90 {pr['ttft_ratio_p90']:.2f}" if pr["ttft_ratio_median"] is not None else ""),
                          flush=True)
                results[name].append(s)
                print(f"  {name}: hit {s['hit_rate']:.1%}  mean TTFT {s['ttft_mean_s']:.2f} s  "
                      + " ".join(f"{k} {v:.0%}" for k, v in s["by_kind"].items()), flush=True)
    if j:
        seeds = [f"{','.join(map(str, seeds))} x {len(timings)} timings"]
    print("\n" + (prediction_table(results, seeds) if args.predict else table(results, seeds)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
