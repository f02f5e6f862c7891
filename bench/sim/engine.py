"""One simulated vLLM engine: a waiting queue, continuous batching up to ``max_num_seqs``, one prefill lane
(a long prefill delays the prefills behind it, as it saturates a real GPU), concurrent decode, and the
prefix cache whose events go out on the engine's publisher once per scheduling step."""
from __future__ import annotations

import asyncio
import zlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.sim.cache import Allocation, PrefixCache, SharedG4Store
from bench.sim.events import ZmqPublisher
from bench.sim.timing import DEFAULT_TIMING, TimingModel


class RequestError(ValueError):
    """A request the engine refuses (400), e.g. longer than max_model_len."""


@dataclass
class SimRequest:
    tokens: list[int]
    max_tokens: int
    cache_salt: str | None = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # lists of token ids, then None
    alloc: Allocation | None = None
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    # Seconds from the start of its prefill to its first token, on the wall clock (like vLLM's): a fleet
    # replayed N times faster looks to the gateway like N-times-faster GPUs, for every latency it sees.
    prefill_s: float | None = None


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_ok: int = 0
    requests_aborted: int = 0
    # vLLM's per-request histograms, recorded when a request finishes (sum and count only):
    # vllm:request_prefill_kv_computed_tokens and vllm:request_prefill_time_seconds.
    prefill_kv_computed_tokens: int = 0
    prefill_time_s: float = 0.0
    prefill_requests: int = 0
    request_prompt_tokens: int = 0  # vllm:request_prompt_tokens (sum; same count)


class SimEngine:
    def __init__(self, cache: PrefixCache, publisher: ZmqPublisher | None, timing: TimingModel = DEFAULT_TIMING,
                 max_model_len: int = 262_144, vocab_size: int = 32000, stream_interval: int = 16):
        self.cache, self.publisher, self.timing = cache, publisher, timing
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.stream_interval = max(1, stream_interval)
        self.waiting: deque[SimRequest] = deque()
        self.running = 0
        self._prefill: deque[SimRequest] = deque()
        self._prefill_wake = asyncio.Event()
        self._prefill_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stats = EngineStats()

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def start(self) -> None:
        self._prefill_task = asyncio.get_running_loop().create_task(self._prefill_loop())

    async def stop(self) -> None:
        for t in [self._prefill_task, *self._tasks]:
            if t:
                t.cancel()
        await asyncio.gather(*[t for t in [self._prefill_task, *self._tasks] if t], return_exceptions=True)

    # -- admission -----------------------------------------------------------------------------------------
    def submit(self, tokens: list[int], max_tokens: int, cache_salt: str | None = None) -> SimRequest:
        if not tokens:
            raise RequestError("The prompt is empty.")
        if len(tokens) + max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the messages, {max_tokens} in the completion).")
        if self.cache.blocks_needed(len(tokens) + max_tokens) > self.cache.num_blocks:
            raise RequestError(f"The request needs {self.cache.blocks_needed(len(tokens) + max_tokens)} KV blocks; "
                               f"this engine has {self.cache.num_blocks}.")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab_size + 5:  # words + the tokenizer's special tokens
            raise RequestError(f"Token id {hi if hi >= 0 else lo} is out of vocabulary")
        req = SimRequest(tokens=tokens, max_tokens=max(1, max_tokens), cache_salt=cache_salt)
        self.waiting.append(req)
        self._schedule()
        return req

    def abort(self, req: SimRequest) -> None:
        req.cancelled = True
        if req.alloc is None:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _schedule(self) -> None:
        while self.waiting and self.running < self.timing.max_num_seqs:
            req = self.waiting[0]
            alloc = self.cache.allocate(req.tokens, len(req.tokens) + req.max_tokens, req.cache_salt)
            if alloc is None:
                break  # FIFO, like vLLM's waiting queue: the head waits for room
            self.waiting.popleft()
            self.running += 1
            req.alloc = alloc
            req.cached_tokens = (alloc.hit_blocks + alloc.g4_blocks) * self.block_size
            self.stats.prompt_tokens += len(req.tokens)
            self._prefill.append(req)
            self._prefill_wake.set()
        self._publish()

    # -- execution -----------------------------------------------------------------------------------------
    async def _prefill_loop(self) -> None:
        while True:
            while not self._prefill:
                self._prefill_wake.clear()
                await self._prefill_wake.wait()
            req = self._prefill.popleft()
            a = req.alloc
            local = a.hit_blocks * self.block_size
            g4 = a.g4_blocks * self.block_size
            dt = self.timing.prefill_s(len(req.tokens) - local - g4, local + g4, g4)
            if not req.cancelled:
                req.prefill_s = self.timing.wall(dt)
                await asyncio.sleep(req.prefill_s)
            self.cache.write_g4(a, req.tokens)
            self._publish()
            t = asyncio.get_running_loop().create_task(self._decode(req))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _output_tokens(self, req: SimRequest) -> np.ndarray:
        """Deterministic 'greedy' output: the same prompt always generates the same tokens."""
        tail = np.asarray(req.tokens[-64:], dtype="<u4").tobytes()
        rng = np.random.default_rng(zlib.crc32(tail) ^ len(req.tokens))
        return rng.integers(0, self.vocab_size, size=req.max_tokens)

    async def _decode(self, req: SimRequest) -> None:
        out = self._output_tokens(req)
        n = len(out)
        try:
            produced = 1
            req.generated.extend(int(x) for x in out[:1])
            req.out.put_nowait(req.generated[:1])
            while produced < n and not req.cancelled:
                k = min(self.stream_interval, n - produced)
                await asyncio.sleep(self.timing.wall(k * self.timing.decode_token_s(self.running)))
                chunk = [int(x) for x in out[produced:produced + k]]
                req.generated.extend(chunk)
                req.out.put_nowait(chunk)
                produced += k
        finally:
            self._finish(req)

    def _finish(self, req: SimRequest) -> None:
        if req.done:
            return
        req.done = True
        a = req.alloc
        # Blocks filled by generated tokens are cached too (all but the last sampled token has KV).
        all_tokens = req.tokens + req.generated
        n_full = (len(all_tokens) - 1) // self.block_size
        if n_full > len(a.digests):
            digests = a.digests + self._more_digests(a, all_tokens, n_full)
            self.cache.cache_full_blocks(a, all_tokens, n_full, digests)
        self.cache.free(a)
        self.running -= 1
        self.stats.generation_tokens += len(req.generated)
        if req.prefill_s is not None:
            self.stats.prefill_kv_computed_tokens += len(req.tokens) - req.cached_tokens
            self.stats.prefill_time_s += req.prefill_s
            self.stats.prefill_requests += 1
            self.stats.request_prompt_tokens += len(req.tokens)
        if req.cancelled:
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_ok += 1
        req.out.put_nowait(None)
        self._schedule()
        self._publish()

    def _more_digests(self, a: Allocation, all_tokens: list[int], n_full: int) -> list[bytes]:
        from bench.sim.cache import block_digests

        start = len(a.digests)
        parent = a.digests[-1] if a.digests else None
        return block_digests(all_tokens, self.block_size, self.cache.root, None, start=start, parent=parent,
                             n_blocks=n_full)

    def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        self._publish()
        return ok
