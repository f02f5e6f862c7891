"""The TTFT cost model: for each candidate worker,

    predicted TTFT = queue wait + prefill time of the uncached prompt tokens + G4 load time

- queue wait: the prefill work the gateway has sent the worker and not yet seen a first byte for, plus the
  requests vLLM reports waiting that the gateway did not send (each counted as the worker's mean work),
  divided by the prefill speed; plus a small penalty per running request (decode steps share the batch
  with a new prefill);
- prefill: the work of the prompt tokens beyond the worker's longest cached prefix (GPU or CPU tier), at
  the prefill speed. Work is counted in tokens at context 0: a token at context L costs
  ``1 + L / attention_knee_tokens`` of them (attention reads every earlier token), so the same 1,000 new
  tokens cost more after a 100K cached prefix than after none. The speed is calibrated online (EWMA,
  starting from the configured default) from observed TTFTs of streamed responses and from vLLM's own
  prefill histograms on ``/metrics`` (every request);
- G4: blocks the worker would load from the shared tier beyond its local prefix, at the configured
  bytes per block and G4 read bandwidth.

The model predicts; the policy (router.policies.kv) orders, adding what a choice costs afterwards.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from indexer.index.base import WorkerMatch
from router.config import RoutingConfig

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


@dataclass
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
    score_ms: float | None = None  # the policy's ordering key, when it has one (router.policies.kv)
    load: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class CostModel:
    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.fleet_tps = cfg.prefill_tokens_per_s  # every observation calibrates it

    def work(self, uncached: float, cached: float) -> float:
        """Prefill work of ``uncached`` tokens after ``cached`` ones, in tokens at context 0."""
        knee = self.cfg.attention_knee_tokens
        return uncached * (1.0 + (cached + uncached / 2.0) / knee) if knee > 0 else float(uncached)

    def prefill_speed(self, worker) -> float:
        own = self.cfg.per_worker_prefill_speed and worker.prefill_samples >= MIN_OWN_SAMPLES
        ratio = worker.prefill_ratio if own else 1.0
        return max(1.0, self.fleet_tps * ratio)

    def score(self, worker, match: WorkerMatch, g4: int, num_tokens: int, block_size: int) -> Candidate:
        cfg = self.cfg
        tps = self.prefill_speed(worker)
        local = match.local
        g4_extra = max(0, g4 - local)
        cached = min(num_tokens, (local + g4_extra) * block_size)
        uncached = max(0, num_tokens - cached)
        load = worker.load
        extra_waiting = max(0.0, load.waiting - worker.pending_requests)
        running = max(float(worker.inflight - worker.pending_requests), load.running)
        queue_tokens = worker.pending_tokens + extra_waiting * worker.mean_prompt_tokens
        queue_ms = queue_tokens / tps * 1000.0 + running * cfg.running_penalty_ms
        work = self.work(uncached, cached)
        prefill_ms = work / tps * 1000.0
        # G4 price: the worker's calibrated figures (connector counters, router/prefetch.py) or the defaults
        bpb = getattr(worker, "g4_bytes_per_block", 0) or cfg.g4_bytes_per_block
        bw = getattr(worker, "g4_bytes_per_s", 0.0) or cfg.g4_bytes_per_s
        g4_ms = g4_extra * bpb / max(1.0, bw) * 1000.0
        return Candidate(
            worker=worker.name, gpu_blocks=match.gpu, cpu_blocks=match.cpu, local_blocks=local,
            g4_blocks=g4_extra, cached_tokens=cached, uncached_tokens=uncached, prefill_work=work,
            inflight=worker.inflight,
            pending_requests=worker.pending_requests, pending_tokens=worker.pending_tokens,
            vllm_running=load.running, vllm_waiting=load.waiting, kv_usage=load.kv_usage,
            prefill_tokens_per_s=tps, queue_ms=queue_ms, prefill_ms=prefill_ms, g4_load_ms=g4_ms,
            predicted_ttft_ms=queue_ms + prefill_ms + g4_ms,
            load=max(float(worker.inflight), load.running + load.waiting) + load.kv_usage,
        )

    def observe_ttft(self, worker, ttft_s: float, predicted: Candidate) -> None:
        """Calibrate the worker's prefill speed from one observed TTFT (streamed responses only).

        Small prefills are dominated by fixed overheads and are skipped."""
        worker.ttft_samples += 1
        uncached = predicted.uncached_tokens
        if uncached < MIN_CALIBRATION_TOKENS:
            return
        compute_s = ttft_s - predicted.queue_ms / 1000.0 - predicted.g4_load_ms / 1000.0
        if compute_s <= 1e-4:
            return
        self._calibrate(worker, predicted.prefill_work / compute_s)

    def observe_engine_prefill(self, worker, tokens: float, seconds: float, requests: float,
                               prompt_tokens: float = 0.0) -> None:
        """Calibrate from vLLM's own accounting between two /metrics scrapes: the work of the tokens computed
        in prefill over the seconds from scheduling to first token (``vllm:request_prefill_kv_computed_tokens``,
        ``vllm:request_prefill_time_seconds``; ``vllm:request_prompt_tokens`` gives the cached context, taken
        as the interval's mean per request). It sees every request, streamed or not, and no queue wait."""
        if requests <= 0 or seconds <= 1e-4 or tokens / requests < MIN_CALIBRATION_TOKENS:
            return
        cached = max(0.0, prompt_tokens - tokens) / requests
        self._calibrate(worker, requests * self.work(tokens / requests, cached) / seconds)

    def _calibrate(self, worker, observed_tps: float) -> None:
        """One sample moves the fleet's estimate by ``calibration_alpha`` and the worker's ratio to it by a
        quarter of that; each is clamped to a factor of 10 around its current value."""
        a = self.cfg.calibration_alpha
        fleet = self.fleet_tps
        self.fleet_tps = (1 - a) * fleet + a * min(fleet * 10, max(fleet / 10, observed_tps))
        b = a * RATIO_ALPHA_SHARE
        ratio = worker.prefill_ratio
        worker.prefill_ratio = (1 - b) * ratio + b * min(ratio * 10, max(ratio / 10, observed_tps / fleet))
        worker.prefill_samples += 1
