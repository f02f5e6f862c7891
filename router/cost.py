"""The TTFT cost model: for each candidate worker, a model of vLLM's scheduler stepped forward.

    predicted TTFT = queue + prefill + G4 load

vLLM runs one step loop: every step batches each running request's next decode token with prefill
chunks of the waiting requests, first come first served, up to ``max_num_batched_tokens`` prompt tokens;
a request's first token comes at the end of the step that finishes its prefill. So, for a new request
behind the worker's queue (router/load.py: the gateway's own prefilling requests, plus what vLLM reports
waiting beyond them at the worker's mean size) while ``D`` requests decode:

- steps: the queue's uncached prompt tokens and this request's, ``max_num_batched_tokens - D`` per step
  (at least one step for the request itself);
- each step costs ``step + D * per_decode`` (router/calibrate.py: a line through vLLM's inter-token
  latency at its running count), plus the prefill work of the tokens it batches at the prefill speed;
- the request pays a fixed overhead once (the floor of what vLLM's histograms leave outside its queue and
  engine times: router/calibrate.py).

Requests held at the gateway's prefill gate (router/admission.py) are queue too, but the gate sends the
shortest first: the held ones longer than this request are behind it, not ahead.

Work is counted in tokens at context 0: a token at context L costs ``1 + L / attention_knee_tokens`` of
them (attention reads every earlier token), so the same 1,000 new tokens cost more after a 100K cached
prefix than after none. The prefill speed is calibrated online (EWMA, from the configured default) from
vLLM's own prefill histograms on ``/metrics`` (and, with the fit off, from observed TTFTs).
G4: blocks the worker would load from the shared tier beyond its local prefix, at the configured bytes
per block and G4 read bandwidth.

The sum is then corrected by what the observed TTFTs of streamed responses say the figures still get
wrong (router/ttft_fit.py: a regression on its parts, ``routing.ttft_fit``); with the fit on, those TTFTs
calibrate the fit only, and the prefill speed comes from vLLM's histograms alone (one learner per signal:
the two chased each other's error). Every prediction is clamped to [``MIN_TTFT_MS``, ``MAX_TTFT_MS``]
(``Candidate.clamped`` says so; kvgate_ttft_prediction_clamped_total counts them).

The model predicts; the policy (router.policies.kv) orders, adding what a choice costs afterwards.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from indexer.index.base import WorkerMatch
from router import eviction
from router.calibrate import EngineCalibration, clamp
from router.config import RoutingConfig
from router.kv_room import capacity_tokens, kv_room, kv_wait_s
from router.load import HELD
from router.ttft_fit import TtftFit

MIN_CALIBRATION_TOKENS = 256
# A worker's speed is the fleet-wide estimate times the worker's own ratio to it. The fleet estimate takes
# every observation and follows the request mix quickly; the ratio moves at a quarter of that weight, so it
# keeps persistent differences (a slower GPU) but not the mix's noise: one observed speed varies by a factor
# of 2-3 with prompt length and cached context (attention is not linear), and identical workers whose own
# estimates drifted apart that much drew 2-10x each other's requests on the fleet simulation.
# Only with ``routing.per_worker_prefill_speed``: sticky routing gives workers persistently different mixes
# (one holds the long conversations), which the ratio cannot tell from slower hardware, so on a fleet of
# identical workers it is off (measured on the simulator: docs/BENCHMARKS.md).
RATIO_ALPHA_SHARE = 0.25
# The ratio counts once a worker has this many observations; until then the fleet estimate alone does.
MIN_OWN_SAMPLES = 3
# The share of an interval's mean inter-token latency always kept as step time (observe_engine).
STEP_FLOOR_SHARE = 0.01
# The share of vLLM's prefill seconds always counted as prefill compute (observe_engine_prefill).
MIN_COMPUTE_SHARE = 0.5
MIN_TTFT_MS, MAX_TTFT_MS = 0.1, 3_600_000.0
TPS_RANGE = (1.0, 1e8)  # prefill tokens/s the fleet's speed stays within (a sample moves it 10x at most)
RATIO_RANGE = (0.01, 100.0)  # a worker's prefill speed against the fleet's
MAX_CONTEXT = 1e8  # tokens per request a calibration sample may show (more is a broken exporter's)
MAX_STEPS = 1e9  # engine steps priced at most (a queue beyond it is clamped with the prediction)


def _steps(x: float) -> int:
    """Engine steps for ``x`` budgets of tokens, at most ``MAX_STEPS`` (0 for NaN): never raises."""
    return math.ceil(min(x, MAX_STEPS)) if x == x else 0


@dataclass(slots=True)
class Candidate:
    """One worker's inputs and prediction for one request (kept in the decision record)."""

    worker: str
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    local_blocks: int = 0
    g4_blocks: int = 0  # blocks loadable from G4 beyond the local prefix
    cached_tokens: int = 0
    uncached_tokens: int = 0
    prefill_work: float = 0.0  # the uncached tokens' prefill work, in tokens at context 0
    inflight: int = 0
    pending_requests: int = 0
    pending_tokens: int = 0
    vllm_running: float = 0.0
    vllm_waiting: float = 0.0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    g4_load_ms: float = 0.0
    predicted_ttft_ms: float = 0.0
    # the scheduler model's own sum (queue + prefill + G4) before the learnt correction (router/ttft_fit.py)
    model_ttft_ms: float = 0.0
    fit_ms: float = 0.0  # predicted_ttft_ms - model_ttft_ms
    score_ms: float | None = None  # the policy's ordering key, when it has one (router.policies.kv)
    terms_ms: dict[str, float] = field(default_factory=dict)  # score_ms by scorer (router/policies/scorers.py)
    score_notes: list[str] = field(default_factory=list)  # inputs a scorer found missing or bad, and its fallback
    load: float = 0.0
    # The queue the scheduler model stepped through (explain shows it)
    queue_requests: float = 0.0  # ahead of this request: the gateway's own and vLLM's unknown waiting
    queue_tokens: float = 0.0  # their uncached prompts, and queue_lost_tokens
    queue_lost_tokens: float = 0.0  # cached prefixes of theirs their own demand evicts before they run
    queue_done_ms: float = 0.0  # of the queue's prefill: what the worker has done already (left out)
    # held at the worker's prefill gate with longer prompts: this request goes before them (their wait grows)
    jumped_requests: int = 0
    # of queue_tokens, the KV the queue allocates beyond the scraped usage (router/load.py kv_demand_tokens,
    # and queue_lost_tokens): what the eviction model, the KV wait and the footprint scorer compare with the room
    kv_demand_tokens: float = 0.0
    decodes: int = 0
    steps: int = 0  # engine steps until this request's first token
    step_ms: float = 0.0  # one step's fixed and decode cost at this worker's decode count
    overhead_ms: float = 0.0
    calibration: str = "defaults"  # what the step and overhead figures come from (router/calibrate.py)
    clamped: bool = False
    evicted_blocks: int = 0  # of the local prefix, expected evicted by the queue before this is scheduled
    # what priced that (router/eviction.py): "" nothing to price (no queue, no prefix or room unknown),
    # "pressure", "lru" (the worker's releases place the prefix), "held" (a request in flight holds it)
    eviction_model: str = ""
    lru_older_tokens: float = 0.0  # lru: free tokens released before the prefix (absorbed first)
    # the KV released on the worker since the prefix's last use (router/load.py prefix_age), where an
    # eviction model looked it up; None: not looked up, unknown or held. With the scale, what a reader of the
    # decision records needs to replay the LRU and occupancy models against what vLLM delivered
    prefix_age_tokens: float | None = None
    eviction_scale: float = 1.0  # the worker's learnt pressure scale at pricing (router/eviction.py)
    # of the local prefix, the leading blocks a request in flight has, which the eviction model kept (only
    # the tail past them is priced; what the scale learns from is that tail too)
    eviction_held_blocks: int = 0
    # occupancy, where it looked (None: not): the KV the requests in flight hold when this one is admitted
    # (with vLLM's waiting ones the gateway did not send), the prefix's leading blocks one of them has (None:
    # not probed) and the excess over the capacity priced evicted from the prefix's tail (<= 0: it fits)
    occupancy_tokens: float | None = None
    occupancy_held_blocks: int | None = None
    occupancy_excess_tokens: float | None = None
    eviction_pressure: float = 0.0  # the queue's demand / free blocks, unscaled (router/eviction.py; -1: none free)
    # KV room from vLLM's last scrape: the share of blocks no running request holds, and those blocks in
    # tokens (with num_gpu_blocks); None when the metrics are missing or malformed
    kv_free: float | None = None
    kv_free_tokens: float | None = None
    kv_wait_ms: float = 0.0  # of queue_ms: until running requests free the KV the queue and this one need

    def to_dict(self) -> dict:
        d = asdict(self)
        d["terms_ms"] = {k: round(v, 3) for k, v in self.terms_ms.items()}
        return d


class CostModel:
    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.fleet_tps = cfg.prefill_tokens_per_s  # every observation calibrates it
        self.fleet_samples = 0  # the first replaces the prior (_calibrate)
        # Step and overhead figures, fleet-wide: every worker's samples move it (the per-worker figures are
        # kept, and used with per_worker_prefill_speed, for the same reason as the speed: identical workers
        # whose own estimates differ by noise would send every cold request to the one that looks faster).
        self.fleet_engine = EngineCalibration(cfg.step_ms / 1000.0, cfg.per_decode_ms / 1000.0,
                                              cfg.request_overhead_ms / 1000.0)
        self.fleet_fit = TtftFit()  # what the model's sum still gets wrong (router/ttft_fit.py)

    def work(self, uncached: float, cached: float) -> float:
        """Prefill work of ``uncached`` tokens after ``cached`` ones, in tokens at context 0."""
        knee = self.cfg.attention_knee_tokens
        return uncached * (1.0 + (cached + uncached / 2.0) / knee) if knee > 0 else float(uncached)

    def prefill_speed(self, worker) -> float:
        own = self.cfg.per_worker_prefill_speed and worker.prefill_samples >= MIN_OWN_SAMPLES
        ratio = worker.prefill_ratio if own else 1.0
        return max(1.0, self.fleet_tps * ratio)

    def engine_of(self, worker) -> EngineCalibration:
        """The step and overhead figures ``worker`` is priced with (fleet-wide unless per-worker)."""
        own = worker.engine
        if self.cfg.per_worker_prefill_speed and own.step_samples >= MIN_OWN_SAMPLES:
            return own
        return self.fleet_engine

    def fit_of(self, worker) -> TtftFit | None:
        """The correction ``worker``'s predictions get (fleet-wide unless per-worker; None: off)."""
        if not self.cfg.ttft_fit:
            return None
        if self.cfg.per_worker_prefill_speed and worker.ttft_fit.ready:
            return worker.ttft_fit
        return self.fleet_fit

    def budget(self, worker) -> int:
        return getattr(worker.config, "max_num_batched_tokens", None) or self.cfg.max_num_batched_tokens

    def score(self, worker, match: WorkerMatch, g4: int, num_tokens: int, block_size: int,
              pending_blocks: int = 0, hashes=None, after=None) -> Candidate:
        """``pending_blocks``: the last of ``match.local`` are blocks the gateway sent the worker whose
        events are not indexed yet (router/pending.py): being computed or just computed, not evictable.
        ``hashes``: the prompt's routable blocks (where the worker's releases place its prefix). ``after``:
        the request held at the worker's prefill gate that those pending blocks are from (it goes first).
        Runs for every candidate of every request: one load view, one Candidate, no intermediate dicts."""
        cfg = self.cfg
        tps = self.prefill_speed(worker)
        load = worker.load
        v = worker.view()
        cal = self.engine_of(worker)
        m_local = match.local
        indexed = m_local - max(0, min(pending_blocks, m_local))
        usage = load.kv_usage
        kv_free, kv_free_tokens = kv_room(load, block_size, worker.active.kv_since_scrape(),
                                         worker.active.running_tokens())
        lost = 0.0  # the queue's own cached prefixes its demand evicts first (router/load.py queue_losses)
        if v.unadmitted_tokens and kv_free_tokens is not None:
            lost = worker.active.queue_losses(kv_free_tokens, v.now)
        queue_tokens = v.queue_tokens + lost
        demand = v.kv_demand_tokens + lost  # what the queue allocates beyond the room
        p = eviction.pressure(demand, kv_free_tokens)
        ev_model, older, age = "", 0.0, None
        occupied = over = occ_held = None  # occupancy's terms, where it looked (the decision record's)
        waiting = cfg.waiting_evicts and load.waiting > 0
        held = None
        if indexed > 0 and (p > 0 or waiting):
            # the leading blocks a request in flight has in its prompt are not in the free queue: only the
            # tail past them can be evicted (a shared document is held while its first reader runs)
            held = worker.active.held_blocks(hashes, indexed) if hashes else 0
            if held >= indexed:
                ev_model, local = "held", indexed
            elif waiting:  # routing.waiting_evicts: the waiting prompts take the free queue first
                ev_model, local = "waiting", held
            else:
                age = worker.active.prefix_age(hashes, indexed) if hashes else None
                if age == HELD:
                    ev_model, local = "held", indexed
                elif age is None:
                    ev_model = "pressure"
                    local = held + eviction.surviving(indexed - held, p, worker.eviction.scale)
                else:
                    ev_model = "lru"
                    tail, older = eviction.lru_surviving(indexed - held, block_size, demand, kv_free_tokens,
                                                         age, worker.eviction.scale)
                    local = held + tail
        else:
            local = indexed
        cap = capacity_tokens(load, block_size)
        if cfg.occupancy_evicts and local > 0 and cap > 0 and ev_model != "held":
            # occupancy: every request in flight here is scheduled before this one and holds its KV then;
            # the part of this prompt's prefix that no longer fits beside them is taken from the free
            # queue while it waits (its own uncached blocks come after it is admitted: not counted).
            # Held blocks only lower the excess: probed only when the whole prefix would not fit.
            occupied = worker.active.inflight_tokens() + v.unknown_waiting * v.mean_tokens
            over = occupied + local * block_size - cap
            # blocks released after the prefix sit behind it in the free queue: vLLM evicts the prefix
            # before them, so they do not spare it (router/load.py prefix_age; HELD or unknown: none).
            # Only free blocks sit there: a release a request in flight since reused (a shared document
            # read again) is in the requests' KV already, so no more than the free room past the prefix
            # (probed only when that room could make the excess positive).
            behind = (kv_free_tokens if kv_free_tokens is not None else cap) - local * block_size
            if cfg.occupancy_age and hashes and over + behind > 0:
                if ev_model not in ("lru", "pressure"):  # those two probed it already (None: pressure)
                    age = worker.active.prefix_age(hashes, indexed)
                if age is not None and age > 0:
                    over += min(age, max(0.0, behind))
            if over > 0:
                if held is None:
                    held = worker.active.held_blocks(hashes, indexed) if hashes else 0
                over -= held * block_size
                occ_held = held
                keep = max(held, local - math.ceil(min(over / block_size, local))) if over > 0 else local
                if keep < local:
                    ev_model, local = "occupancy", keep
        if local == indexed:  # nothing evicted ahead of them: the pending blocks extend the prefix
            local = m_local
        g4_extra = max(0, g4 - local)
        cached = min(num_tokens, (local + g4_extra) * block_size)
        uncached = max(0, num_tokens - cached)
        queue_work = v.queue_work
        queue_requests = v.queue_requests
        jumped = 0
        if v.gated:  # the prefill gate sends the shorter ones first: the longer ones it holds are behind
            jumped, t, w = v.gated_behind(uncached, after)
            queue_requests, queue_tokens, queue_work = queue_requests - jumped, queue_tokens - t, queue_work - w
        budget = self.budget(worker)
        decodes = min(v.decodes, budget - 1)
        per_step = budget - decodes
        queue_steps = _steps(queue_tokens / per_step)
        steps = max(queue_steps + 1, _steps((queue_tokens + uncached) / per_step))
        step_ms = cal.step_time_s(decodes) * 1000.0
        # the part of the queue's first prefill the worker has done already (at most all of that prefill)
        done_ms = min(v.head_elapsed_s, v.head_work / tps) * 1000.0 if cfg.queue_progress else 0.0
        queue_ms = max(0.0, (queue_work + self.work(lost, 0.0)) / tps * 1000.0 - done_ms) \
            + queue_steps * step_ms
        wait_ms = 0.0
        if v.decoding and kv_free_tokens is not None:
            wait_ms = kv_wait_s(v.decoding, kv_free_tokens, demand + uncached, step_ms / 1000.0,
                                v.now) * 1000.0
            queue_ms += wait_ms
        work = self.work(uncached, cached)
        overhead_ms = cal.request_s * 1000.0
        compute_ms = work / tps * 1000.0
        own_steps_ms = (steps - queue_steps) * step_ms
        prefill_ms = compute_ms + own_steps_ms + overhead_ms
        if g4_extra:  # G4 price: the worker's calibrated figures (router/prefetch.py) or the defaults
            bpb = getattr(worker, "g4_bytes_per_block", 0) or cfg.g4_bytes_per_block
            bw = getattr(worker, "g4_bytes_per_s", 0.0) or cfg.g4_bytes_per_s
            g4_ms = g4_extra * bpb / max(1.0, bw) * 1000.0
        else:
            g4_ms = 0.0
        raw = total = queue_ms + prefill_ms + g4_ms
        clamped = not MIN_TTFT_MS <= total <= MAX_TTFT_MS  # NaN included
        if clamped:
            raw = total = MAX_TTFT_MS if total > MIN_TTFT_MS else MIN_TTFT_MS
        else:
            fit = self.fit_of(worker)
            if fit is not None and fit.ready:
                total = fit.correct(raw, compute_ms, own_steps_ms, queue_ms, cached / 1000.0,
                                    1.0 if g4_extra else 0.0)
                if not MIN_TTFT_MS <= total <= MAX_TTFT_MS:
                    total = raw
        inflight = v.inflight
        running_waiting = load.running + load.waiting
        return Candidate(
            worker=worker.name, gpu_blocks=match.gpu, cpu_blocks=match.cpu, local_blocks=local,
            g4_blocks=g4_extra, cached_tokens=cached, uncached_tokens=uncached, prefill_work=work,
            inflight=inflight, pending_requests=v.prefill_requests, pending_tokens=round(v.prefill_work),
            vllm_running=load.running, vllm_waiting=load.waiting, kv_usage=usage, prefill_tokens_per_s=tps,
            queue_ms=queue_ms, prefill_ms=prefill_ms, g4_load_ms=g4_ms, predicted_ttft_ms=total,
            model_ttft_ms=raw, fit_ms=total - raw,
            load=(inflight if inflight > running_waiting else running_waiting) + usage,
            queue_requests=queue_requests, queue_tokens=queue_tokens, queue_lost_tokens=lost,
            queue_done_ms=done_ms, jumped_requests=jumped,
            kv_demand_tokens=demand,
            decodes=decodes, steps=steps,
            step_ms=step_ms, overhead_ms=overhead_ms, calibration=cal.source, clamped=clamped,
            evicted_blocks=m_local - local, eviction_pressure=p if math.isfinite(p) else -1.0,
            eviction_model=ev_model, lru_older_tokens=older,
            prefix_age_tokens=None if age is None or age == HELD else age,
            eviction_scale=worker.eviction.scale, eviction_held_blocks=held or 0,
            occupancy_tokens=occupied, occupancy_held_blocks=occ_held,
            occupancy_excess_tokens=over,
            kv_free=kv_free, kv_free_tokens=kv_free_tokens, kv_wait_ms=wait_ms,
        )

    def observe_ttft(self, worker, ttft_s: float, predicted: Candidate) -> None:
        """One observed TTFT (streamed responses only) against the candidate it was predicted by. With
        ``routing.ttft_fit`` it trains the correction (router/ttft_fit.py), the worker's and the fleet's.
        Without, it calibrates the prefill speed: what is left after the predicted queue, steps, overhead
        and G4 load is the prefill work's compute (small prefills, dominated by fixed costs, are skipped)."""
        worker.ttft_samples += 1
        if self.cfg.ttft_fit:
            for fit in (worker.ttft_fit, self.fleet_fit):
                fit.observe(predicted, ttft_s * 1000.0)
            return
        uncached = predicted.uncached_tokens
        if uncached < MIN_CALIBRATION_TOKENS:
            return
        # the prediction's own steps and overhead: its prefill time less the compute of its work
        compute_ms = predicted.prefill_work / max(1.0, predicted.prefill_tokens_per_s) * 1000.0
        fixed_ms = predicted.queue_ms + predicted.g4_load_ms + predicted.prefill_ms - compute_ms
        compute_s = ttft_s - fixed_ms / 1000.0
        if compute_s <= 1e-4:
            return
        self._calibrate(worker, predicted.prefill_work / compute_s)

    def observe_engine(self, worker, sample) -> None:
        """One scrape interval's engine figures (``WorkerLoad.engine_since``, an ``EngineSample``) into the
        worker's calibration. An inter-token latency is a whole step's time, and a step that also computes
        a prefill chunk lasts that chunk's compute longer: the interval's prompt tokens computed per step,
        at the prefill speed, are taken off, so the step figure is the per-step cost the model adds on top
        of the prefill work (capacity-bound real vLLM on CPU: mean ITL 1-2.4 s where a decode-only step
        took tens of ms, and with it every queued step was priced at a second or more). At least
        ``STEP_FLOOR_SHARE`` of the latency is kept (a prefill speed that is off must not zero it)."""
        itl, per_step = sample.itl_s, sample.prefill_tokens_per_step
        if itl is not None and per_step and math.isfinite(per_step):  # NaN: max() below would keep 1% of it
            prefill_s = per_step / self.prefill_speed(worker)
            itl = max(itl * STEP_FLOOR_SHARE, itl - prefill_s)
        for cal in (worker.engine, self.fleet_engine):
            if itl is not None:
                cal.observe_steps(sample.running, itl)
            if sample.overhead_s is not None:
                cal.observe_request_overhead(sample.overhead_s)

    def observe_engine_prefill(self, worker, tokens: float, seconds: float, requests: float,
                               prompt_tokens: float = 0.0) -> None:
        """Calibrate from vLLM's own accounting between two /metrics scrapes: the work of the tokens computed
        in prefill over the seconds from scheduling to first token (``vllm:request_prefill_kv_computed_tokens``,
        ``vllm:request_prefill_time_seconds``; ``vllm:request_prompt_tokens`` gives the cached context, taken
        as the interval's mean per request). It sees every request, streamed or not, and no queue wait.
        The steps' own cost (router/calibrate.py) is not prefill compute: it is taken off, down to half of
        the time at most. The step figure is itself learnt with this speed (``observe_engine`` takes the
        prefill chunks off the inter-token latency at it), so a looser bound fed back: on capacity-bound CPU
        vLLM, a tenth let a speed 4-5x too high leave most of the prefill in the step figure, which took
        most of the next interval's prefill seconds off, and the speed swung 500-3,100 tokens/s."""
        if requests <= 0 or not 1e-4 < seconds < math.inf \
                or not MIN_CALIBRATION_TOKENS <= tokens / requests <= MAX_CONTEXT:
            return
        per_request = tokens / requests
        cached = max(0.0, prompt_tokens - tokens) / requests
        steps = _steps(per_request / self.budget(worker))
        stepping = requests * steps * self.engine_of(worker).step_time_s(worker.load.running)
        compute_s = max(seconds * MIN_COMPUTE_SHARE, seconds - stepping)
        self._calibrate(worker, requests * self.work(per_request, cached) / compute_s)

    def _calibrate(self, worker, observed_tps: float) -> None:
        """The first sample replaces the configured prior (within ``TPS_RANGE``); later ones move the fleet's
        estimate as a running mean until that weighs less than ``calibration_alpha``, then by it, each
        clamped to a factor of 10 around the current value; the worker's ratio to it moves by a quarter of
        that. Why: the prior is a guess (10,000 tokens/s), and the clamp and EWMA meant for noisy samples
        kept it for the whole run where it was 100x off (capacity-bound CPU vLLM: the warm-up measured 35
        tokens/s, the first scrape moved the prior to 6,724, and the first wave was priced 180-560x under)."""
        if not (math.isfinite(observed_tps) and observed_tps > 0):  # NaN, inf: one would stay in the mean
            return
        n, fleet = self.fleet_samples, self.fleet_tps
        self.fleet_samples = n + 1
        if n == 0:
            self.fleet_tps = clamp(observed_tps, *TPS_RANGE)
        else:
            w = max(self.cfg.calibration_alpha, 1.0 / (n + 1))
            moved = (1 - w) * fleet + w * clamp(observed_tps, fleet / 10, fleet * 10)
            self.fleet_tps = clamp(moved, *TPS_RANGE)
            b = self.cfg.calibration_alpha * RATIO_ALPHA_SHARE
            ratio = worker.prefill_ratio
            moved = (1 - b) * ratio + b * clamp(observed_tps / fleet, ratio / 10, ratio * 10)
            worker.prefill_ratio = clamp(moved, *RATIO_RANGE)
        worker.prefill_samples += 1
