"""One simulated vLLM engine, scheduled like vLLM 0.32's v1 scheduler: one step loop, a FIFO waiting queue,
at most ``max_num_seqs`` running, and a per-step token budget (``max_num_batched_tokens``, chunked prefill).

Each step goes through the running requests first come first served: a request in decode takes one token of
the budget, a request still in prefill takes the next chunk of its prompt (as much as the budget left
allows). Blocks are held as vLLM holds them: a chunk's blocks when it is scheduled, a decode's next block when
its tokens reach it; they are cached (hittable, announced) as vLLM's allocate_slots caches them, in the
step that computes their last token: a chunk's full blocks, a block of generated tokens in the decode step
that fills it. A running request the pool cannot grow preempts the last admitted one (its blocks freed,
cached ones staying hittable; it goes back to the head of the queue and later recomputes its prompt and what
it generated). Then, if nothing was preempted, waiting requests are admitted while budget and seats remain:
the head is admitted only if its whole prompt fits in the free blocks (vLLM's ``scheduler_reserve_full_isl``
gate, its free prefix hit counted as taken), else it and everything behind it wait. The step lasts
``TimingModel.step_s`` for what it batched; at its end each decode has one more token and a request whose
prefill the step finished has its first token. The prefix cache's events go out on the engine's publisher
once per step, at its end (with its output, as vLLM's)."""
from __future__ import annotations

import asyncio
import math
import zlib
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from bench.sim.cache import Allocation, PrefixCache
from bench.sim.events import ZmqPublisher
from bench.sim.timing import DEFAULT_TIMING, TimingModel

# vLLM's default histogram buckets (vllm/v1/metrics/buckets.py); request-token buckets are 1-2-5 up to
# max_model_len.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# A step loop that falls further behind the wall clock than this restarts from now (seconds).
_LAG_RESET_S = 0.05


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """A Prometheus histogram: per-bucket counts (rendered cumulative), sum and count."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for le, c in zip([*map(float, self.buckets), "+Inf"], self.counts):
            acc += c
            out.append((str(le), acc))
        return out


class RequestError(ValueError):
    """A request the engine refuses (400), e.g. longer than max_model_len."""


@dataclass(eq=False)
class SimRequest:
    tokens: list[int]
    max_tokens: int
    cache_salt: str | None = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # lists of token ids, then None
    alloc: Allocation | None = None
    digests: list[bytes] | None = None  # of the full blocks of what it prefills (hashed once while it waits)
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)  # tokens pushed to ``out`` so far
    cancelled: bool = False
    done: bool = False
    # Seconds from scheduling to its first token, on the wall clock (vLLM's prefill time): a fleet replayed
    # N times faster looks to the gateway like N-times-faster GPUs, for every latency it sees.
    prefill_s: float | None = None
    arrival: float = 0.0                # loop time of submit
    scheduled_at: float | None = None   # start of the step that first scheduled it
    computed: int = 0                   # prompt tokens with KV (cached, then computed chunk by chunk)
    prefill_len: int = 0                # tokens to compute before its next token: the prompt, and after a
                                        # preemption the prompt and the tokens generated so far
    preemptions: int = 0
    n_out: int = 0                      # tokens sampled so far
    output: np.ndarray | None = None    # its whole deterministic output, drawn at the first token
    # The engine's clock (model seconds of steps run) when it was scheduled and at its first token.
    scheduled_clock: float = 0.0
    first_token_clock: float | None = None
    load_done: float | None = None      # loop time its async G4 load completes
    g4_tokens: int = 0                  # of cached_tokens, those loaded from G4


class _Sequence:
    """A request's tokens, its prompt then its first ``n`` sampled ones, sliced without joining the two."""

    __slots__ = ("prompt", "output", "n")

    def __init__(self, prompt: list[int], output: np.ndarray, n: int):
        self.prompt, self.output, self.n = prompt, output, n

    def __len__(self) -> int:
        return len(self.prompt) + self.n

    def __getitem__(self, s: slice) -> list[int]:
        lo, hi, _ = s.indices(len(self))
        p = len(self.prompt)
        return list(self.prompt[lo:min(hi, p)]) + self.output[max(lo, p) - p:max(hi, p) - p].tolist()


@dataclass
class EngineStats:
    # Counted as vLLM's PromptTokenStats, with a request's first token, from its first scheduling
    prompt_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens computed (not cached)
    cached_tokens: int = 0  # prompt tokens from the prefix cache
    external_tokens: int = 0  # prompt tokens loaded from G4
    generation_tokens: int = 0
    preemptions: int = 0
    requests_ok: int = 0
    requests_aborted: int = 0


@dataclass
class _Step:
    start: float
    prefills: list[tuple[SimRequest, int]]   # (request, new prompt tokens in this step)
    decodes: list[SimRequest]
    compute_s: float                          # chunk and start costs (model seconds)
    model_s: float = 0.0                      # the step's duration in model seconds


class SimEngine:
    def __init__(self, cache: PrefixCache, publisher: ZmqPublisher | None, timing: TimingModel = DEFAULT_TIMING,
                 max_model_len: int = 262_144, vocab_size: int = 32000, stream_interval: int = 16):
        self.cache, self.publisher, self.timing = cache, publisher, timing
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.stream_interval = max(1, stream_interval)
        self.waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []   # admission order
        # Admitted, blocks held, waiting for their async G4 load (vLLM's WAITING_FOR_REMOTE_KVS), in load
        # order; the worker's G4 reads are served one after another, so a load starts when the previous ends.
        self._loading: deque[SimRequest] = deque()
        self._g4_free_at = 0.0
        self._wake: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.stats = EngineStats()
        tok = request_tokens_buckets(max_model_len)
        # vLLM's histograms. Per request, at finish: prefill time (scheduled -> first token), queue time
        # (arrival -> scheduled), e2e and inference time, new KV tokens computed, prompt tokens. Per token: TTFT (arrival -> first
        # token) and inter-token latency. Per step with output: its prompt tokens computed (a chunked prompt
        # counts whole in the step of its first token, as vLLM's) plus its generated tokens.
        self.h_prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_prefill_kv_computed = Histogram(tok)
        self.h_prompt_tokens = Histogram(tok)
        self.h_e2e = Histogram(REQUEST_LATENCY_BUCKETS)  # at finish: arrival -> finished
        self.h_inference = Histogram(REQUEST_LATENCY_BUCKETS)  # at finish: scheduled -> finished
        self.h_ttft = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.h_itl = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.h_iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.steps = 0
        self.clock = 0.0  # model seconds of steps run
        # Test hook: when a deque, one (scheduled tokens, decodes, repeats) per run of identical steps.
        self.step_log: deque[tuple[int, int, int]] | None = None

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """vllm:num_requests_waiting: the queue, plus requests waiting for their G4 blocks (vLLM keeps
        those in its waiting queue)."""
        return len(self.waiting) + len(self._loading)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- admission -----------------------------------------------------------------------------------------
    def submit(self, tokens: list[int], max_tokens: int, cache_salt: str | None = None) -> SimRequest:
        if not tokens:
            raise RequestError("The prompt is empty.")
        if len(tokens) + max_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(tokens) + max_tokens} tokens ({len(tokens)} in the messages, {max_tokens} in the completion).")
        if self.cache.blocks_needed(len(tokens) + max_tokens) > self.cache.usable:
            raise RequestError(f"The request needs {self.cache.blocks_needed(len(tokens) + max_tokens)} KV blocks; "
                               f"this engine has {self.cache.usable}.")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab_size + 5:  # words + the tokenizer's special tokens
            raise RequestError(f"Token id {hi if hi >= 0 else lo} is out of vocabulary")
        req = SimRequest(tokens=tokens, max_tokens=max(1, max_tokens), cache_salt=cache_salt,
                         arrival=asyncio.get_running_loop().time(), prefill_len=len(tokens))
        self.waiting.append(req)
        self._interrupt()
        return req

    def abort(self, req: SimRequest) -> None:
        req.cancelled = True
        if req.alloc is None:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        else:
            self._interrupt()  # freed at the next step boundary

    def _interrupt(self) -> None:
        """End an idle wait or a run of identical decode steps at the next step boundary."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _publish(self) -> None:
        events = self.cache.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    # -- the step loop -------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        t = self.timing
        end: float | None = None   # when the previous step ended (wall clock), None after idling
        while True:
            self._reap()
            now = loop.time()
            start = end if end is not None and now - end < _LAG_RESET_S else now
            step = self._plan(start)
            if not step.prefills and not step.decodes:
                self._publish()
                end = None
                self._wake = fut = loop.create_future()
                timer = None
                if self._loading:  # the next load to complete ends the idle wait
                    timer = loop.call_at(self._loading[0].load_done, lambda: fut.done() or fut.set_result(None))
                await fut
                if timer is not None:
                    timer.cancel()
                continue
            step.model_s = t.step_s(len(step.decodes), step.compute_s)
            dt = t.wall(step.model_s)
            # A decode-only step that schedules everything repeats identically until a request reaches its
            # next streamed chunk or its end, or a request arrives or is aborted: sleep once for the run.
            # A run has no KV events: a step whose scheduling queued some (a decode's new block evicting a
            # cached one, a decode filling a block) runs alone, so they go out after it, as vLLM's.
            n = 1
            if not step.prefills and len(step.decodes) == len(self._running) and not self.cache.events:
                k = self.stream_interval
                n = min(min(r.max_tokens, len(r.generated) + k) - r.n_out for r in step.decodes)
                # ... and ends before a step where a decode fills a block: that step caches the block (vLLM's
                # allocate_slots), so it is planned anew (a decode needs a block it does not hold only later)
                n = max(1, min(n, min(-self._seq_len(r) % self.block_size for r in step.decodes)))
                if self._loading and dt > 0:  # a finished load joins the next step
                    n = max(1, min(n, math.ceil((self._loading[0].load_done - start) / dt)))
            done = await self._sleep_steps(loop, start, dt, n)
            end = start + done * dt
            self._apply(step, done, dt)
            # vLLM publishes a step's events (those of its scheduling: blocks cached, evicted) once, in
            # Scheduler.update_from_output, after the forward pass, with the step's output
            self._publish()

    async def _sleep_steps(self, loop, start: float, dt: float, n: int) -> int:
        """Sleep through ``n`` steps of ``dt`` from ``start``; an interrupt ends the run after the step in
        flight. Returns the steps done."""
        deadline = start + n * dt
        if n > 1:
            self._wake = fut = loop.create_future()
            timer = loop.call_at(deadline, lambda: fut.done() or fut.set_result(None))
            await fut
            timer.cancel()
            self._wake = None
            done = min(n, int((loop.time() - start) / dt) + 1) if dt > 0 else n
            deadline = start + done * dt
        else:
            done = 1
        delay = deadline - loop.time()
        await asyncio.sleep(delay if delay > 0 else 0)
        return done

    def _plan(self, start: float) -> _Step:
        """Schedule one step, FCFS within the token budget: running requests, then admissions."""
        t = self.timing
        budget = t.max_num_batched_tokens
        prefills, decodes, compute = [], [], 0.0
        preempted = False
        i = 0
        while i < len(self._running) and budget > 0:
            r = self._running[i]
            decoding = r.computed >= r.prefill_len
            u = 1 if decoding else min(r.prefill_len - r.computed, budget)
            need = self._seq_len(r) if decoding else r.computed + u
            while not self.cache.grow(r.alloc, self._seq_tokens(r), need):
                preempted = True
                if self._preempt(self._running[-1]) is r:
                    break
            if r.alloc is None:  # it was the last one: nothing behind it to take blocks from
                break
            i += 1
            if decoding:
                decodes.append(r)
                budget -= 1
                continue
            compute += t.chunk_s(u, r.computed)
            prefills.append((r, u))
            budget -= u
        if preempted:  # vLLM admits nothing in a step that preempted
            return _Step(start, prefills, decodes, compute)
        # requests whose G4 load has completed join first, as they were admitted earlier. Their loaded blocks
        # are cached (hittable, announced) now, not at admission: vLLM allocates an async load's blocks with
        # delay_cache_blocks and caches them when it sees the load done (_update_waiting_for_remote_kv),
        # before it schedules the request's first chunk
        while budget > 0 and self._loading and self._loading[0].load_done <= start + 1e-9 \
                and len(self._running) < t.max_num_seqs:
            r = self._loading[0]
            u = min(r.prefill_len - r.computed, budget)
            tokens = self._seq_tokens(r)
            self.cache.cache_full_blocks(r.alloc, tokens, r.computed // self.block_size)
            r.alloc.loading = False
            if not self.cache.grow(r.alloc, tokens, r.computed + u):
                break
            self._loading.popleft()
            self._running.append(r)
            compute += t.start_s(r.computed) + t.chunk_s(u, r.computed)
            prefills.append((r, u))
            budget -= u
        while budget > 0 and self.waiting and len(self._running) < t.max_num_seqs:
            r = self.waiting[0]
            tokens = self._seq_tokens(r)
            if r.digests is None:
                r.digests = self.cache.digests(tokens, r.cache_salt)
            a = self.cache.allocate(tokens, r.prefill_len, r.cache_salt, digests=r.digests,
                                    hold_tokens=budget, preempted=bool(r.preemptions),
                                    load_async=self._loads_async)
            if a is None:
                break  # FIFO, like vLLM's waiting queue: the head waits for room
            self.waiting.popleft()
            r.alloc = a
            g4 = a.g4_blocks * self.block_size
            r.computed = a.hit_blocks * self.block_size + g4
            if not r.preemptions:
                r.scheduled_at, r.scheduled_clock = start, self.clock
                r.cached_tokens = r.computed
                r.g4_tokens = g4
            # loads outside the step (a short one in it, g4_sync_load_max_s); joins once its blocks are in
            if a.loading:
                begin = max(start, self._g4_free_at)
                r.load_done = self._g4_free_at = begin + t.wall(t.g4_load_s(g4))
                self._loading.append(r)
                continue
            self._running.append(r)
            u = min(r.prefill_len - r.computed, budget)
            compute += t.start_s(r.computed, g4) + t.chunk_s(u, r.computed)
            prefills.append((r, u))
            budget -= u
        return _Step(start, prefills, decodes, compute)

    def _loads_async(self, g4_tokens: int) -> bool:
        """Whether a load of ``g4_tokens`` from G4 runs outside the steps (vLLM's ``load_kv_async``)."""
        t = self.timing
        return t.g4_async_load and t.g4_load_s(g4_tokens) > t.g4_sync_load_max_s

    def _seq_len(self, r: SimRequest) -> int:
        """Tokens that need KV slots in r's next decode step: the prompt and every token sampled so far."""
        return len(r.tokens) + r.n_out

    def _seq_tokens(self, r: SimRequest):
        """r's sequence: its prompt and every token sampled so far (what a preempted request prefills again,
        and what a decode step's blocks hold)."""
        return r.tokens if not r.n_out else _Sequence(r.tokens, r.output, r.n_out)

    def _preempt(self, r: SimRequest) -> SimRequest:
        """vLLM's recompute preemption: free r's blocks (its full blocks stay cached and hittable) and put it
        back at the head of the queue, to prefill its prompt and its output so far when readmitted."""
        self._running.remove(r)
        self.cache.free(r.alloc)
        r.alloc = None
        r.computed = 0
        r.prefill_len = self._seq_len(r)
        r.digests = None  # it prefills more than its prompt now
        r.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(r)
        return r

    def _apply(self, step: _Step, n: int, dt: float) -> None:
        """The results of ``n`` steps of ``dt`` (n > 1 only for decode-only steps)."""
        end = step.start + n * dt
        self.clock += n * step.model_s
        computed = generated = 0
        for r, u in step.prefills:
            r.computed += u
            if r.computed < r.prefill_len:
                continue
            if r.n_out:  # a preempted request recomputed: its next token
                r.n_out += 1
                if r.n_out >= r.max_tokens or r.n_out - len(r.generated) >= self.stream_interval:
                    self._push(r)
                generated += 1
                continue
            self.cache.write_g4(r.alloc, r.tokens)
            r.prefill_s = end - r.scheduled_at
            r.first_token_clock = self.clock
            self.h_ttft.observe(max(0.0, end - r.arrival))
            computed += len(r.tokens) - r.cached_tokens
            # vLLM's prompt token counters, by source, count a request once, with its first token (its
            # PrefillStats, set when first scheduled): not a preempted request's recomputation
            self.stats.prompt_tokens += len(r.tokens)
            self.stats.computed_tokens += len(r.tokens) - r.cached_tokens
            self.stats.cached_tokens += r.cached_tokens - r.g4_tokens
            self.stats.external_tokens += r.g4_tokens
            r.output = self._output_tokens(r)
            r.n_out = 1
            self._push(r)
            generated += 1
        if step.decodes:
            self.h_itl.observe(dt, n * len(step.decodes))
            for r in step.decodes:
                r.n_out += n
                if r.n_out >= r.max_tokens or r.n_out - len(r.generated) >= self.stream_interval:
                    self._push(r)
            generated += n * len(step.decodes)
        if generated:  # vLLM records a step only when it outputs tokens
            self.h_iteration_tokens.observe((computed + generated) // n, n)
        self.steps += n
        if self.step_log is not None:
            self.step_log.append((sum(u for _, u in step.prefills) + len(step.decodes), len(step.decodes), n))
        finished = [r for r in self._running if r.n_out >= r.max_tokens]
        for r in finished:
            self._finish(r, end)
        if finished:
            self._running = [r for r in self._running if not r.done]

    def _push(self, r: SimRequest) -> None:
        chunk = [int(x) for x in r.output[len(r.generated):r.n_out]]
        r.generated.extend(chunk)
        r.out.put_nowait(chunk)

    def _reap(self) -> None:
        """Free the running (and loading) requests aborted since the last step."""
        if any(r.cancelled for r in self._loading):
            for r in self._loading:
                if r.cancelled:
                    self._finish(r)
            self._loading = deque(r for r in self._loading if not r.done)
        if any(r.cancelled for r in self._running):
            for r in self._running:
                if r.cancelled:
                    self._finish(r)
            self._running = [r for r in self._running if not r.done]

    def _output_tokens(self, req: SimRequest) -> np.ndarray:
        """Deterministic 'greedy' output: the same prompt always generates the same tokens."""
        tail = np.asarray(req.tokens[-64:], dtype="<u4").tobytes()
        rng = np.random.default_rng(zlib.crc32(tail) ^ len(req.tokens))
        return rng.integers(0, self.vocab_size, size=req.max_tokens)

    def _finish(self, req: SimRequest, end: float | None = None) -> None:
        if req.done:
            return
        req.done = True
        if req.output is not None and req.n_out > len(req.generated):  # sampled, not streamed yet (aborted)
            req.generated.extend(int(x) for x in req.output[len(req.generated):req.n_out])
        if req.alloc is not None:  # None: preempted and aborted before it was readmitted
            self.cache.free(req.alloc)
        self.stats.generation_tokens += len(req.generated)
        # A request the engine finished: vLLM records its per-request histograms together, at finish
        # (IterationStats.update_from_finished_request); an aborted one (end None) records none
        # (OutputProcessor.abort_requests).
        if req.prefill_s is not None and end is not None:
            self.h_prefill_time.observe(req.prefill_s)
            self.h_queue_time.observe(max(0.0, req.scheduled_at - req.arrival))
            self.h_prefill_kv_computed.observe(len(req.tokens) - req.cached_tokens)
            self.h_prompt_tokens.observe(len(req.tokens))
            self.h_e2e.observe(max(0.0, end - req.arrival))
            self.h_inference.observe(max(0.0, end - req.scheduled_at))
        if req.cancelled:
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_ok += 1
        req.out.put_nowait(None)

    def reset_prefix_cache(self) -> bool:
        ok = self.cache.reset()
        self._publish()
        return ok
