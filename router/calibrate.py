"""Per-worker calibration of the scheduler model (router/cost.py) from what vLLM exports, online.

- Step time. vLLM runs one step loop; each running request decodes one token per step, so the mean
  inter-token latency between two ``/metrics`` scrapes (``vllm:inter_token_latency_seconds``) is the mean
  step time at the mean number of running requests, less the prefill chunks those steps computed
  (``vllm:prompt_tokens_by_source_total{source="local_compute"}`` over ``vllm:iteration_tokens_total``'s
  count, at the prefill speed: router/cost.py ``observe_engine``), which the model prices as prefill work.
  A decayed least-squares line through those points gives ``step_s + seq_s * decodes``. Until the running
  count has varied, the whole step time is ``step_s`` and ``seq_s`` keeps its prior.
- Per-request overhead: the time vLLM counts for a request that is neither queue nor engine time
  (``e2e_request_latency - request_queue_time - request_inference_time``, means over the requests finished
  in the interval, all recorded at finish): the API server's tokenization, detokenization and HTTP, paid
  once per request. Without those histograms (older vLLM): ``time_to_first_token - request_queue_time -
  request_prefill_time``, whose first term is recorded at first token and the others at finish, so it
  mixes two sets of requests and reads seconds of "overhead" while a queue builds. Either also holds the
  wait for the engine step in progress when a request arrives: the engine core takes new requests between
  steps, and vLLM's queue time starts there. The scheduler model prices that wait as the queue's work in
  flight, so the overhead is the floor of the samples (a low quantile of the last ``OVERHEAD_WINDOW``):
  what a request pays when no step is in progress. On capacity-bound CPU vLLM (session 29) the interval
  means read 1.4-8 s under load and 0.01 s when a server was idle; priced as their mean, they made most
  of the error of predictions for small prefills on idle workers (0.6 s observed, 3.8 s predicted).
- The first scrape of a server compares its counters with zero: what it ran before the gateway saw it
  calibrates it at once (registry ``_scrape``).

Every estimate starts from the configured prior, moves by EWMA and is clamped to a sane range, so a
worker with no samples, missing or malformed metrics keeps the conservative defaults (``source`` says
which) and a bad sample never drives a prediction to 0 or to infinity.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

STEP_RANGE_S = (1e-4, 5.0)
SEQ_RANGE_S = (0.0, 0.5)
MAX_DECODES = 1e5  # a mean running count beyond it is a broken gauge's (vLLM's max_num_seqs is ~1e3)
OVERHEAD_RANGE_S = (0.0, 10.0)
DECAY = 0.9  # weight of the past in the step-time regression, per interval
OVERHEAD_WINDOW = 32  # scrape intervals the overhead's floor is taken over
OVERHEAD_QUANTILE = 0.1  # the floor: robust to one odd interval (a negative sample clamped to 0)


def default_calibration() -> EngineCalibration:
    """The configured priors' defaults (a Worker built outside a registry, as in tests)."""
    from router.config import RoutingConfig

    r = RoutingConfig()
    return EngineCalibration(r.step_ms / 1000.0, r.per_decode_ms / 1000.0, r.request_overhead_ms / 1000.0)


def clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


@dataclass
class EngineCalibration:
    step_s: float
    seq_s: float
    request_s: float
    step_samples: int = 0
    request_samples: int = 0
    clamped: int = 0  # samples that fell outside the sane range
    _overheads: deque = field(default_factory=lambda: deque(maxlen=OVERHEAD_WINDOW), repr=False)
    # decayed sums of (decodes, step seconds) for the regression
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    @property
    def source(self) -> str:
        if self.step_samples and self.request_samples:
            return "vllm-metrics"
        if self.step_samples or self.request_samples:
            return "partial"
        return "defaults"

    def step_time_s(self, decodes: float) -> float:
        return self.step_s + self.seq_s * max(0.0, decodes)

    def observe_steps(self, mean_decodes: float, itl_s: float) -> None:
        """One interval's mean inter-token latency at its mean running count."""
        # (a NaN or infinite count, kept, would stay in the sums for good)
        if not (itl_s > 0.0 and 0.0 <= mean_decodes <= MAX_DECODES):
            return
        lo, hi = STEP_RANGE_S[0], STEP_RANGE_S[1] * 4
        if not lo <= itl_s <= hi:
            self.clamped += 1
            itl_s = clamp(itl_s, lo, hi)
        self._w = DECAY * self._w + 1.0
        self._x = DECAY * self._x + mean_decodes
        self._y = DECAY * self._y + itl_s
        self._xx = DECAY * self._xx + mean_decodes * mean_decodes
        self._xy = DECAY * self._xy + mean_decodes * itl_s
        self.step_samples += 1
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 0.25 and self.step_samples >= 3:  # the running count varied: fit the slope too
            # at most the mean step over (mean decodes + 1), so the fixed part stays at least one decode's
            # cost: a noisy slope (on capacity-bound CPU vLLM, prefill time left in the samples grows with
            # the running count) drove it below zero, which priced an idle server's step at 0
            hi = min(SEQ_RANGE_S[1], my / (mx + 1.0))
            self.seq_s = clamp((self._xy / self._w - mx * my) / var, SEQ_RANGE_S[0], hi)
        self.step_s = clamp(my - self.seq_s * mx, *STEP_RANGE_S)

    def observe_request_overhead(self, seconds: float) -> None:
        """One interval's mean time outside the engine; the overhead is their floor (module docstring)."""
        if seconds != seconds:  # NaN
            return
        if not OVERHEAD_RANGE_S[0] <= seconds <= OVERHEAD_RANGE_S[1]:
            self.clamped += 1
            seconds = clamp(seconds, *OVERHEAD_RANGE_S)
        self._overheads.append(seconds)
        xs = sorted(self._overheads)
        self.request_s = xs[int(OVERHEAD_QUANTILE * (len(xs) - 1))]
        self.request_samples += 1

    def to_dict(self) -> dict:
        return {"source": self.source, "step_ms": round(self.step_s * 1000, 3),
                "per_decode_ms": round(self.seq_s * 1000, 4), "request_overhead_ms": round(self.request_s * 1000, 3),
                "step_samples": self.step_samples, "request_samples": self.request_samples,
                "clamped_samples": self.clamped}


@dataclass
class PredictionErrors:
    """Observed / predicted TTFT of a worker's last streamed responses (bounded): its median and p90 say
    how far the model is off there, in /admin/workers."""

    ratios: deque = field(default_factory=lambda: deque(maxlen=256))

    def add(self, observed_ms: float, predicted_ms: float) -> float | None:
        if not (observed_ms > 0 and predicted_ms > 0) or observed_ms == float("inf"):
            return None
        r = observed_ms / predicted_ms
        self.ratios.append(r)
        return r

    def to_dict(self) -> dict:
        xs = sorted(self.ratios)
        n = len(xs)
        q = (lambda p: round(xs[min(n - 1, int(p * n))], 3)) if n else (lambda p: None)
        return {"samples": n, "median": q(0.5), "p90": q(0.9)}
