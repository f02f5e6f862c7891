"""The simulated engine's timing model, calibrated to the reference measurement.

Reference (gpt-oss-120b, one RTX PRO 6000, vLLM): about 32 s TTFT cold at 130K tokens; from 30K to 130K
tokens the cold TTFT grows by 29.55 s and the cached TTFT by 0.377 s.

Prefill of ``u`` uncached tokens after ``c`` cached ones (context ``L = c + u``)::

    prefill(u, c) = overhead + a*u + b*u*(c + u/2) + d*c + g4_tokens * kv_bytes_per_token / g4_read_bytes_per_s

``a`` is the per-token (MLP/projection) cost, ``b`` the attention cost of each new token over its context
(so a cold prompt costs ``a*L + b*L^2/2``), ``d`` the per-token cost of a local cache hit (reading the
cached KV). ``calibrate`` solves a, b and d from the reference figures; ``overhead`` is the fixed step cost.

The engine runs vLLM v1's step loop (``bench/sim/engine.py``): one step batches every running decode and
prefill chunks within ``max_num_batched_tokens``. A step with ``D`` decodes and prefill chunks of ``u_i`` new
tokens after ``c_i`` tokens of context (cached or computed in earlier chunks) costs::

    step = decode_s + decode_s_per_seq * D + sum_i [a*u_i + b*u_i*(c_i + u_i/2)] + sum_j start_j
    start_j = overhead + d*cached_j + g4_tokens_j * kv_bytes_per_token / g4_read_bytes_per_s

where ``start_j`` is paid once by each request whose prefill starts in the step. The chunks' attention terms
add up to the unchunked one (``sum u_i*(c_i + u_i/2) = u*(c + u/2)``), so a lone prefill costs ``prefill``
plus ``decode_s`` per step it spans (``lone_prefill_s``: +0.19 s, 0.6 %, for a cold 130K prompt at the
default budget of 8192 tokens).
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
    # continuous-batching concurrency cap: vLLM 0.32's default for its OpenAI API server on a GPU of at
    # least 70 GiB that is not an A100, like the reference RTX PRO 6000 (96 GB): get_batch_defaults in
    # vllm/engine/arg_utils.py
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192      # per-step token budget (chunked prefill), vLLM 0.32's default too
    time_scale: float = 1.0                 # >1 runs faster than real time (divides every sleep)
    # G4 loads as with an async-loading KV connector (vLLM's WAITING_FOR_REMOTE_KVS): the request waits for
    # its blocks outside the step, one load at a time per worker at g4_read_bytes_per_s, and joins a step
    # once they are in, when its loaded blocks are cached (``delay_cache_blocks``); False: the load runs
    # inside the step that starts the prefill, stalling that step (a synchronous ``start_load_kv``).
    g4_async_load: bool = True
    # ... except a load no longer than this, which runs in the step (kvgate's connector, ``load_async:
    # auto`` with its ``sync_load_max_s``; 0: every load outside the step)
    g4_sync_load_max_s: float = 0.0

    def prefill_s(self, uncached: int, cached: int = 0, g4_tokens: int = 0) -> float:
        """Compute time of a prefill as one piece (no step overhead): its start cost plus one chunk."""
        return self.start_s(cached, g4_tokens) + self.chunk_s(uncached, cached)

    def start_s(self, cached: int = 0, g4_tokens: int = 0) -> float:
        """Paid once per request, in the step its prefill starts: the fixed overhead, reading its cached KV
        and (``g4_tokens``, a synchronous load) loading its G4 blocks."""
        return self.overhead_s + self.d_s_per_cached_token * max(0, cached) + self.g4_load_s(g4_tokens)

    def g4_load_s(self, g4_tokens: int) -> float:
        """Reading ``g4_tokens`` tokens of KV from G4 at the worker's G4 read bandwidth."""
        return max(0, g4_tokens) * self.kv_bytes_per_token / self.g4_read_bytes_per_s

    def chunk_s(self, new: int, context: int = 0) -> float:
        """``new`` prompt tokens computed after ``context`` tokens already in the KV cache."""
        u, c = max(0, new), max(0, context)
        return self.a_s_per_token * u + self.b_s_per_token2 * u * (c + u / 2)

    def step_s(self, decodes: int, compute_s: float = 0.0) -> float:
        """One engine step: the base cost, ``decodes`` decode tokens, plus the chunk and start costs."""
        return self.decode_s + self.decode_s_per_seq * max(0, decodes) + compute_s

    def decode_token_s(self, running: int) -> float:
        """One token of a decode-only step with ``running`` decodes."""
        return self.step_s(running)

    def lone_prefill_s(self, uncached: int, cached: int = 0, g4_tokens: int = 0) -> float:
        """TTFT of a prefill alone on an idle engine, chunked by the step budget."""
        steps = max(1, -(-max(0, uncached) // max(1, self.max_num_batched_tokens)))
        return self.prefill_s(uncached, cached, g4_tokens) + steps * self.step_s(0)

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
