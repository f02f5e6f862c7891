"""What the scheduler model still gets wrong, learnt from the TTFTs the gateway observes.

The model (router/cost.py) adds a candidate's queue, its own prefill compute, its own engine steps and a
fixed overhead, each priced by a figure calibrated on its own from vLLM's ``/metrics``
(router/calibrate.py). Those figures trade off against each other: on capacity-bound CPU vLLM an overhead
of ~1 s and a step of ~0.5 s fitted the histograms beside a prefill speed 5x too high, which priced a mostly
cached request at 2.0 s (0.37 s observed) and a cold one at a third of what it took. Each streamed response
shows its TTFT beside the components its prediction was made of, so a regression over them tells how far
each component should be scaled, and what the model leaves out costs (reading cached tokens)::

    observed = raw * (1 + r),   r ~ (c0 * 1 s + c1 * compute + c2 * steps + c3 * queue + c4 * cached
                                     + c5 * 1 s if it loads from G4) / raw

The last term is what an asynchronous G4 load costs beyond its bytes at the connector's measured
bandwidth: vLLM parks the request until the load is reported finished at a step's end and schedules it the
step after, so a loading request waits about a step of the batch it joins (capacity-bound real vLLM with G4,
session 20: observed / predicted TTFT median 1.13 where it loaded from G4, 0.74 where its prefix was local).

``r`` is the relative error, so a 100 ms request weighs as much as a 10 s one (the goal is the ratio);
ridge-shrunk towards 0 (the model as it is) and decayed, so it follows a changing load. It corrects once
``MIN_SAMPLES`` responses were seen; each coefficient and the corrected prediction stay within
``[raw / MAX_FACTOR, raw * MAX_FACTOR]``, so a bad sample can never drive a prediction to 0 or infinity.
"""
from __future__ import annotations

from dataclasses import dataclass, field

N = 6  # features: one second, own compute, own steps, queue (ms), cached tokens (thousands), one second if
# it loads from G4; each over the raw ms
DECAY = 0.97  # weight of the past per observation (an effective window of ~33 responses)
RIDGE = 0.5
MIN_SAMPLES = 8
MAX_FACTOR = 4.0  # a correction scales the model's prediction by at most this, either way
INTERCEPT_RANGE_MS = (-10_000.0, 10_000.0)
CACHED_RANGE_MS = (0.0, 1_000.0)  # reading 1K cached tokens costs 0-1 s (a negative cost is noise)
G4_RANGE_MS = (0.0, 10_000.0)  # an asynchronous G4 load's extra wait: 0-10 s (a negative one is noise)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small dense system (None: singular)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def components(cand) -> tuple[float, float, float, float, float, float] | None:
    """A candidate's raw prediction and its parts the fit scales (compute, own steps, queue, in ms; cached
    tokens in thousands; 1 if it loads blocks from G4, else 0); None when the raw prediction was clamped or
    is not positive."""
    raw = cand.model_ttft_ms
    if cand.clamped or not raw > 0.0:
        return None
    compute = cand.prefill_work / max(1.0, cand.prefill_tokens_per_s) * 1000.0
    steps = max(0.0, cand.prefill_ms - compute - cand.overhead_ms)
    return raw, compute, steps, cand.queue_ms, cand.cached_tokens / 1000.0, 1.0 if cand.g4_blocks > 0 else 0.0


@dataclass
class TtftFit:
    samples: int = 0
    clipped: int = 0  # observations whose error was beyond MAX_FACTOR (taken at the bound)
    coef: list[float] = field(default_factory=lambda: [0.0] * N)  # c0 ms, c1-c3 per ms, c4 ms per 1K, c5 ms
    _a: list[list[float]] = field(default_factory=lambda: [[0.0] * N for _ in range(N)])
    _b: list[float] = field(default_factory=lambda: [0.0] * N)

    @property
    def ready(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def correct(self, raw: float, compute: float, steps: float, queue: float, cached_k: float,
                g4: float = 0.0) -> float:
        """The corrected prediction (ms) for a raw one and its parts (``cached_k``: thousands of tokens;
        ``g4``: 1 if it loads from G4)."""
        if not (self.samples >= MIN_SAMPLES and raw > 0.0):
            return raw
        c = self.coef
        out = raw + c[0] + c[1] * compute + c[2] * steps + c[3] * queue + c[4] * cached_k + c[5] * g4
        lo, hi = raw / MAX_FACTOR, raw * MAX_FACTOR
        return lo if out < lo else hi if out > hi else out

    def observe(self, cand, observed_ms: float) -> None:
        """One streamed response's TTFT beside the candidate its prediction was made of."""
        parts = components(cand)
        if parts is None or not 0.0 < observed_ms < float("inf"):
            return
        raw, compute, steps, queue, cached_k, g4 = parts
        z = (1000.0 / raw, compute / raw, steps / raw, queue / raw, cached_k / raw, 1000.0 * g4 / raw)
        r = observed_ms / raw - 1.0
        lo, hi = 1.0 / MAX_FACTOR - 1.0, MAX_FACTOR - 1.0
        if not lo <= r <= hi:
            self.clipped += 1
            r = lo if r < lo else hi
        a, b = self._a, self._b
        for i in range(N):
            zi = z[i]
            b[i] = DECAY * b[i] + zi * r
            row = a[i]
            for j in range(N):
                row[j] = DECAY * row[j] + zi * z[j]
        self.samples += 1
        if self.samples < MIN_SAMPLES:
            return
        coef = _solve([[a[i][j] + (RIDGE if i == j else 0.0) for j in range(N)] for i in range(N)], b)
        if coef is None:
            return
        lo_ms, hi_ms = INTERCEPT_RANGE_MS
        coef[0] = min(hi_ms, max(lo_ms, coef[0] * 1000.0))
        for i in range(1, 4):  # each part scaled by (1 + c) within [1 / MAX_FACTOR, MAX_FACTOR]
            coef[i] = min(MAX_FACTOR - 1.0, max(1.0 / MAX_FACTOR - 1.0, coef[i]))
        coef[4] = min(CACHED_RANGE_MS[1], max(CACHED_RANGE_MS[0], coef[4]))
        coef[5] = min(G4_RANGE_MS[1], max(G4_RANGE_MS[0], coef[5] * 1000.0))
        self.coef = coef

    def to_dict(self) -> dict:
        c = self.coef
        return {"samples": self.samples, "active": self.ready, "clipped_samples": self.clipped,
                "intercept_ms": round(c[0], 3), "compute_scale": round(1.0 + c[1], 4),
                "steps_scale": round(1.0 + c[2], 4), "queue_scale": round(1.0 + c[3], 4),
                "cached_ms_per_1k": round(c[4], 3), "g4_load_ms": round(c[5], 3)}
