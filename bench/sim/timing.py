"""The simulated engine's timing model, calibrated to the reference measurement.

Reference (gpt-oss-120b, one RTX PRO 6000, vLLM): about 32 s TTFT cold at 130K tokens; from 30K to 130K
tokens the cold TTFT grows by 29.55 s and the cached TTFT by 0.377 s.

Prefill of ``u`` uncached tokens after ``c`` cached ones (context ``L = c + u``)::

    prefill(u, c) = overhead + a*u + b*u*(c + u/2) + d*c + g4_tokens * kv_bytes_per_token / g4_read_bytes_per_s

``a`` is the per-token (MLP/projection) cost, ``b`` the attention cost of each new token over its context
(so a cold prompt costs ``a*L + b*L^2/2``), ``d`` the per-token cost of a local cache hit (reading the
cached KV). ``calibrate`` solves a, b and d from the reference figures; ``overhead`` is the fixed step cost.
Decode: each output token takes ``decode_s + decode_s_per_seq * running`` seconds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

REF_COLD_HI_S = 32.0           # cold TTFT at REF_HI tokens
REF_COLD_DELTA_S = 29.55       # cold TTFT growth from REF_LO to REF_HI
REF_CACHED_DELTA_S = 0.377     # cached TTFT growth from REF_LO to REF_HI
REF_LO, REF_HI = 30_000, 130_000


@dataclass(frozen=True)
class TimingModel:
    overhead_s: float = 0.05
    a_s_per_token: float = 0.0
    b_s_per_token2: float = 0.0
    d_s_per_cached_token: float = 0.0
    decode_s: float = 0.012
    decode_s_per_seq: float = 0.0004
    kv_bytes_per_token: int = 73_728        # gpt-oss-120b: 2 (K,V) x 36 layers x 8 KV heads x 64 dims x bf16
    g4_read_bytes_per_s: float = 20e9
    max_num_seqs: int = 64                  # continuous-batching concurrency cap
    time_scale: float = 1.0                 # >1 runs faster than real time (divides every sleep)

    def prefill_s(self, uncached: int, cached: int = 0, g4_tokens: int = 0) -> float:
        u, c = max(0, uncached), max(0, cached)
        t = self.overhead_s + self.a_s_per_token * u + self.b_s_per_token2 * u * (c + u / 2)
        t += self.d_s_per_cached_token * c
        if g4_tokens:
            t += g4_tokens * self.kv_bytes_per_token / self.g4_read_bytes_per_s
        return t

    def decode_token_s(self, running: int) -> float:
        return self.decode_s + self.decode_s_per_seq * max(0, running)

    def ttft_cold(self, tokens: int) -> float:
        return self.prefill_s(tokens, 0)

    def ttft_cached(self, tokens: int, block_size: int = 16) -> float:
        """TTFT of a prompt fully in the local cache: only the last (partial or full) block is computed."""
        hit = ((tokens - 1) // block_size) * block_size
        return self.prefill_s(tokens - hit, hit)

    def wall(self, seconds: float) -> float:
        return seconds / self.time_scale

    def with_(self, **kw) -> TimingModel:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def calibrate(cold_hi_s: float = REF_COLD_HI_S, cold_delta_s: float = REF_COLD_DELTA_S,
              cached_delta_s: float = REF_CACHED_DELTA_S, lo: int = REF_LO, hi: int = REF_HI,
              overhead_s: float = 0.05, block_size: int = 16, **kw) -> TimingModel:
    """Solve a, b (cold curve through both reference points) and d (cached growth) exactly."""
    # cold(L) = o + a L + b L^2 / 2 ; cold(hi) = cold_hi ; cold(hi) - cold(lo) = cold_delta
    y_hi = cold_hi_s - overhead_s
    y_lo = cold_hi_s - cold_delta_s - overhead_s
    det = hi * lo * lo / 2 - lo * hi * hi / 2
    a = (y_hi * lo * lo / 2 - y_lo * hi * hi / 2) / det
    b = (hi * y_lo - lo * y_hi) / det
    base = TimingModel(overhead_s=overhead_s, a_s_per_token=a, b_s_per_token2=b)
    # cached(L) grows by cached_delta: the tail compute differs a little, d carries the rest.
    tail_growth = base.ttft_cached(hi, block_size) - base.ttft_cached(lo, block_size)
    d = (cached_delta_s - tail_growth) / ((hi - 1) // block_size * block_size - (lo - 1) // block_size * block_size)
    return replace(base, d_s_per_cached_token=d, **kw)


DEFAULT_TIMING = calibrate()
