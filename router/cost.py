"""The TTFT cost model: for each candidate worker,

    predicted TTFT = queue wait + prefill time of the uncached prompt tokens + G4 load time

- queue wait: prompt tokens the gateway has sent the worker and not yet seen a first byte for, plus the
  requests vLLM reports waiting that the gateway did not send (each counted as the worker's mean prompt
  size), divided by the worker's prefill speed; plus a small penalty per running request (decode steps
  share the batch with a new prefill);
- prefill: prompt tokens beyond the worker's longest cached prefix (GPU or CPU tier), at the worker's
  prefill speed, calibrated online (EWMA, starting from the configured default) from observed TTFTs of
  streamed responses and from vLLM's own prefill histograms on ``/metrics`` (every request);
- G4: blocks the worker would load from the shared tier beyond its local prefix, at the configured
  bytes per block and G4 read bandwidth.

Minimum wins; ties go to the least loaded. A cache hit on a busy worker therefore loses as soon as its
queue costs more than recomputing the prefix on an idle one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from indexer.index.base import WorkerMatch
from router.config import RoutingConfig

MIN_CALIBRATION_TOKENS = 256
# A worker's own prefill speed is used once it has this many calibrating observations; until then the
# fleet-wide estimate is. Otherwise the first worker to be calibrated looks faster (or slower) than the
# rest, which still carry the configured guess, and takes (or loses) every request: a hot spot.
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

    def prefill_speed(self, worker) -> float:
        own = worker.prefill_tps if getattr(worker, "prefill_samples", 0) >= MIN_OWN_SAMPLES else 0.0
        return max(1.0, own or self.fleet_tps)

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
        prefill_ms = uncached / tps * 1000.0
        # G4 price: the worker's calibrated figures (connector counters, router/prefetch.py) or the defaults
        bpb = getattr(worker, "g4_bytes_per_block", 0) or cfg.g4_bytes_per_block
        bw = getattr(worker, "g4_bytes_per_s", 0.0) or cfg.g4_bytes_per_s
        g4_ms = g4_extra * bpb / max(1.0, bw) * 1000.0
        return Candidate(
            worker=worker.name, gpu_blocks=match.gpu, cpu_blocks=match.cpu, local_blocks=local,
            g4_blocks=g4_extra, cached_tokens=cached, uncached_tokens=uncached, inflight=worker.inflight,
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
        self._calibrate(worker, uncached / compute_s)

    def observe_engine_prefill(self, worker, tokens: float, seconds: float, requests: float) -> None:
        """Calibrate from vLLM's own accounting between two /metrics scrapes: tokens computed in prefill
        over seconds from scheduling to first token (``vllm:request_prefill_kv_computed_tokens`` and
        ``vllm:request_prefill_time_seconds``). It sees every request, streamed or not, and no queue wait."""
        if requests <= 0 or seconds <= 1e-4 or tokens / requests < MIN_CALIBRATION_TOKENS:
            return
        self._calibrate(worker, tokens / seconds)

    def _calibrate(self, worker, observed_tps: float) -> None:
        """One sample moves the fleet's and the worker's estimates by ``calibration_alpha``, clamped to a
        factor of 10 around the current value."""
        a = self.cfg.calibration_alpha
        fleet = self.fleet_tps
        self.fleet_tps = (1 - a) * fleet + a * min(fleet * 10, max(fleet / 10, observed_tps))
        # A worker's own estimate starts from the fleet's, so its first samples refine rather than jump.
        current = worker.prefill_tps if getattr(worker, "prefill_samples", 0) else fleet
        sample = min(current * 10, max(current / 10, observed_tps))
        worker.prefill_tps = (1 - a) * current + a * sample
        worker.prefill_samples = getattr(worker, "prefill_samples", 0) + 1
