"""The simulated engine schedules like vLLM v1: one step loop, FCFS within a per-step token budget
(chunked prefill), decodes sharing steps with prefills, first token at the end of the step that finishes a
prefill. Checked on the engine's own clock (model seconds of steps run) and step counts, never on wall time."""
from __future__ import annotations

import asyncio
import math
from collections import deque
from contextlib import asynccontextmanager

import httpx
import pytest

from bench.sim import virtual
from bench.sim.cache import PrefixCache, external
from bench.sim.engine import SimEngine
from bench.sim.events import BlockRemoved, BlockStored
from bench.sim.fleet import FleetConfig, SimFleet
from bench.sim.timing import DEFAULT_TIMING


@asynccontextmanager
async def engine(budget: int = 8192, num_blocks: int = 20_000, scale: float = 1e4, g4=None, **kw):
    e = SimEngine(PrefixCache(num_blocks, 16, g4=g4), None,
                  DEFAULT_TIMING.with_(time_scale=scale, max_num_batched_tokens=budget, **kw), stream_interval=4)
    e.step_log = deque()
    e.start()
    try:
        yield e
    finally:
        await e.stop()


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i) % 32000 for i in range(n)]


async def drain(*reqs) -> None:
    for r in reqs:
        while await r.out.get() is not None:
            pass


class Recorder:
    """A publisher that keeps each batch with the engine's step count and loop time when it went out."""

    def __init__(self):
        self.engine: SimEngine | None = None
        self.batches: list[tuple[int, float, list]] = []

    def publish(self, events):
        self.batches.append((self.engine.steps, asyncio.get_running_loop().time(), events))

    def gpu_stored(self) -> list[tuple[int, float, BlockStored]]:
        return [(steps, at, ev) for steps, at, evs in self.batches for ev in evs
                if isinstance(ev, BlockStored) and ev.medium == "GPU"]


def recorded(num_blocks: int = 2000, time_scale: float = 1.0, **timing) -> tuple[SimEngine, Recorder]:
    """An engine (block size 16; unscaled by default, for the virtual clock) publishing to a Recorder."""
    pub = Recorder()
    pub.engine = SimEngine(PrefixCache(num_blocks, 16), pub,
                           DEFAULT_TIMING.with_(time_scale=time_scale, **timing))
    return pub.engine, pub


def test_lone_chunked_prefill_stays_calibrated():
    t = DEFAULT_TIMING
    assert t.max_num_batched_tokens == 8192
    # 16 steps of 8192 tokens add 16 x decode_s to the 32 s reference: well within a few percent
    assert t.lone_prefill_s(130_000) == pytest.approx(32.0, rel=0.01)
    assert t.lone_prefill_s(130_000) - t.prefill_s(130_000) == pytest.approx(16 * t.decode_s)
    # chunking does not change the compute: the attention terms of the chunks add up to the whole
    chunks = sum(t.chunk_s(8192 if c + 8192 <= 130_000 else 130_000 - c, c) for c in range(0, 130_000, 8192))
    assert chunks == pytest.approx(t.chunk_s(130_000, 0), rel=1e-9)


async def test_a_long_prefill_is_chunked_and_its_first_token_ends_the_last_chunk():
    async with engine(budget=1000) as e:
        r = e.submit(prompt(4500, 1), 3)
        await drain(r)
        assert [s[0] for s in list(e.step_log)[:5]] == [1000, 1000, 1000, 1000, 500]
        assert len(r.generated) == 3 and e.steps == 5 + 2
        t = e.timing
        expected = t.start_s() + sum(t.chunk_s(u, c) for u, c in zip([1000] * 4 + [500], range(0, 4500, 1000)))
        assert r.first_token_clock - r.scheduled_clock == pytest.approx(expected + 5 * t.decode_s)


async def test_a_short_request_behind_a_long_one_shares_its_last_step():
    async with engine() as e:
        long = e.submit(prompt(20_000, 2), 2)
        short = e.submit(prompt(100, 3), 2)
        await drain(long, short)
        # 8192 + 8192 + 3616 tokens of the long prompt; the short one fits in the last step's 4576 left
        assert [s[0] for s in list(e.step_log)[:3]] == [8192, 8192, 3616 + 100]
        assert short.first_token_clock == long.first_token_clock
        serial = e.timing.lone_prefill_s(20_000) + e.timing.lone_prefill_s(100)
        assert short.first_token_clock < serial  # FCFS: it never overtakes, but it does not queue for a lane
        assert short.scheduled_clock > 0  # no budget left for it in the first two steps


async def test_decodes_keep_streaming_during_a_long_prefill():
    async with engine() as e:
        d = e.submit(prompt(32, 40), 10_000)
        while d.n_out == 0:
            await asyncio.sleep(0.001)
        before = d.n_out
        e.step_log.clear()
        long = e.submit(prompt(60_000, 41), 1)
        await drain(long)
        # 60000 = 7 x 8191 + 2663 (each step gives the decode its token first): 8 steps, each with a token
        assert d.n_out - before >= 8
        e.abort(d)
        chunks = [s for s in e.step_log if s[0] > 1]
        assert [s[0] for s in chunks] == [8192] * 7 + [60_000 - 7 * 8191 + 1]
        assert all(s[1] == 1 for s in chunks)


async def test_first_tokens_come_in_arrival_order():
    async with engine(budget=2048) as e:
        reqs = [e.submit(prompt(n, 10 + i), 2) for i, n in enumerate([3000, 100, 5000, 50, 1500])]
        await drain(*reqs)
        firsts = [r.first_token_clock for r in reqs]
        assert firsts == sorted(firsts)
        assert all(s[0] <= 2048 for s in e.step_log)


async def test_a_hundred_short_requests_run_together_as_on_vllm_on_a_96_gb_gpu():
    # vLLM 0.32's API server runs up to 1024 sequences on a GPU of 70 GiB or more that is not an A100
    # (EngineArgs.get_batch_defaults), like the timing model's reference RTX PRO 6000: 100 short requests
    # submitted together are all admitted in the first step and get their first token in it
    async with engine() as e:
        reqs = [e.submit(prompt(32, 200 + i), 50) for i in range(100)]
        while any(r.n_out == 0 for r in reqs):
            await asyncio.sleep(0.001)
        assert e.running == 100 and e.num_waiting == 0
        assert len({r.first_token_clock for r in reqs}) == 1
        for r in reqs:
            e.abort(r)
        await drain(*reqs)


async def test_max_num_seqs_caps_the_running_requests():
    async with engine(max_num_seqs=64) as e:
        reqs = [e.submit(prompt(32, 300 + i), 3) for i in range(100)]
        await drain(*reqs)
        firsts = sorted({r.first_token_clock for r in reqs})
        assert len(firsts) == 2 and sum(r.first_token_clock == firsts[0] for r in reqs) == 64


async def test_running_decodes_slow_a_prefill():
    async def ttft_with(decoders: int) -> float:
        async with engine(budget=512) as e:
            bg = [e.submit(prompt(32, 100 + i), 2000) for i in range(decoders)]
            while any(r.n_out == 0 for r in bg):
                await asyncio.sleep(0.001)
            r = e.submit(prompt(4096, 5), 1)
            await drain(r)
            for b in bg:
                e.abort(b)
            return r.first_token_clock - r.scheduled_clock

    idle, busy = await ttft_with(0), await ttft_with(32)
    # 32 decodes take 32 tokens of each step's budget (more steps) and cost decode_s_per_seq each
    assert busy > 1.3 * idle


async def test_iteration_tokens_and_latency_histograms_count_like_vllm():
    async with engine(budget=1000) as e:
        a, b = e.submit(prompt(2500, 20), 6), e.submit(prompt(300, 21), 6)
        await drain(a, b)
        assert all(s[0] <= 1000 for s in e.step_log)
        # vLLM counts a prompt's computed tokens in the step of its first token, plus each step's outputs
        assert e.h_iteration_tokens.sum == 2500 + 300 + 12
        steps_with_output = sum(n for tokens, decodes, n in e.step_log if decodes) + 1  # the first tokens' step
        assert e.h_iteration_tokens.count == steps_with_output
        assert e.h_ttft.count == 2 and e.h_itl.count == 2 * 5
        assert e.h_prefill_time.count == e.h_queue_time.count == 2
        assert e.h_prefill_kv_computed.sum == 2800


async def test_decode_runs_stream_every_interval_and_an_arrival_joins_at_the_next_step():
    async with engine(scale=50) as e:
        r = e.submit(prompt(64, 30), 40)
        first = await r.out.get()
        assert len(first) == 1
        chunk = await r.out.get()
        assert len(chunk) == 4  # stream_interval
        late = e.submit(prompt(64, 31), 2)
        await drain(late)
        assert not r.done  # it joined r's decode batch instead of waiting for r's end
        await drain(r)
        assert len(r.generated) == 40 and e.stats.generation_tokens == 42
        assert sum(n for *_, n in e.step_log) == e.steps


async def test_metrics_export_vllms_scheduler_histograms():
    async with SimFleet(FleetConfig(workers=1, num_blocks=256,
                                    timing=DEFAULT_TIMING.with_(time_scale=1000), stream_interval=4)) as f:
        url = f.workers[0].url
        async with httpx.AsyncClient(timeout=30) as c:
            await c.post(url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 5})
            text = (await c.get(url + "/metrics")).text
    for name in ("vllm:iteration_tokens_total", "vllm:inter_token_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_prefill_time_seconds"):
        assert f"# TYPE {name} histogram" in text
        assert f'{name}_bucket{{engine="0",model_name="sim-model",le="+Inf"}}' in text
    lab = '{engine="0",model_name="sim-model"}'
    assert f"vllm:inter_token_latency_seconds_count{lab} 4.0" in text
    assert f"vllm:time_to_first_token_seconds_count{lab} 1.0" in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",model_name="sim-model",le="8192.0"}' in text
    assert math.isfinite(float(text.split(f"vllm:request_queue_time_seconds_sum{lab} ")[1].split()[0]))


# -- KV blocks: held as vLLM 0.32 holds them -----------------------------------------------------------------
async def test_a_chunked_prompt_holds_blocks_chunk_by_chunk_and_is_admitted_if_its_prompt_fits():
    # 20 blocks x 16 tokens (and the null block): a 300-token prompt (19 blocks) with 100 tokens to generate is
    # admitted (vLLM's gate counts the prompt, not the output), and it holds blocks for the chunks scheduled so far
    async with engine(budget=100, num_blocks=21, scale=1) as e:
        r = e.submit(prompt(300, 50), 12)
        while e.steps < 1:
            await asyncio.sleep(0.001)
        # the step loop plans the next step as soon as one ends: steps done + 1 chunks are held
        held = min(300, 100 * (e.steps + 1))
        assert e.steps < 2 and len(r.alloc.blocks) == math.ceil(held / 16) == 13 and e.cache.num_free == 7
        await drain(r)
        assert len(r.generated) == 12 and e.stats.preemptions == 0


async def test_a_pool_that_runs_out_while_decoding_preempts_the_last_admitted_and_both_complete():
    # 10 blocks x 16 tokens; two 48-token prompts (3 blocks each) are admitted together, and each needs 7
    # blocks by its 60th token: the pool runs out, the second is preempted (its blocks freed, its full
    # blocks still cached) and readmitted when the first ends, recomputing its prompt and its output so far
    async with engine(num_blocks=11) as e:  # and the null block
        a, b = e.submit(prompt(48, 60), 60), e.submit(prompt(48, 61), 60)
        await drain(a, b)
        assert a.preemptions == 0 and b.preemptions >= 1 and e.stats.preemptions == b.preemptions
        for r in (a, b):  # every token delivered once, in order: the same output as an unpreempted run
            assert len(r.generated) == 60 and r.generated == [int(x) for x in r.output]
        assert b.cached_tokens == 0 and e.stats.prompt_tokens == 96  # counted at the first admission
        assert e.cache.num_free == 10


async def test_a_preempted_requests_recompute_is_not_counted_again_in_prompt_or_prefix_cache_counters():
    # vLLM counts a request's prompt tokens by source once, with its first token (PrefillStats set at its
    # first scheduling), and leaves a preempted request's readmission lookup out of vllm:prefix_cache_*
    # (PrefixCacheStats.record: preempted_queries/hits, not exported): the same two-prompt preemption as above
    async with engine(num_blocks=11) as e:  # and the null block
        a, b = e.submit(prompt(48, 60), 60), e.submit(prompt(48, 61), 60)
        await drain(a, b)
        assert b.preemptions >= 1
        assert e.cache.queries == 96 and e.cache.hits == 0
        assert e.stats.prompt_tokens == 96 and e.stats.computed_tokens == 96 and e.stats.cached_tokens == 0


async def test_an_aborted_request_records_no_per_request_histograms():
    # vLLM records a request's queue, prefill, e2e, inference, prompt and computed-token histograms together
    # when the engine finishes it; a client abort (OutputProcessor.abort_requests) records none of them
    async with engine() as e:
        r = e.submit(prompt(64, 70), 10_000)
        while r.n_out == 0:
            await asyncio.sleep(0.001)
        e.abort(r)
        await drain(r)
        for h in (e.h_queue_time, e.h_prefill_time, e.h_prefill_kv_computed, e.h_prompt_tokens, e.h_e2e,
                  e.h_inference):
            assert h.count == 0
        assert e.h_ttft.count == 1  # observed with the first token, as vLLM's


async def test_a_steps_kv_events_are_published_after_the_step_with_its_output():
    # vLLM publishes the events of a step's scheduling (its chunk's blocks cached) in
    # Scheduler.update_from_output, after the forward pass: the first chunk's BlockStored goes out when
    # the first step has run, not when it is planned
    e, pub = recorded(time_scale=1e4, max_num_batched_tokens=1000)
    e.start()
    try:
        await drain(e.submit(prompt(4500, 80), 2))
    finally:
        await e.stop()
    stored = [(steps, len(ev.block_hashes)) for steps, _, ev in pub.gpu_stored()]
    assert stored[:5] == [(1, 62), (2, 63), (3, 62), (4, 63), (5, 31)]


async def _decoding(e: SimEngine, *, then=None):
    """Run a 20-token prompt for 40 tokens on ``e``; ``then(e, r)``: a coroutine run beside it once it has
    its first token. The request."""
    e.start()
    try:
        r = e.submit(prompt(20, 90), 40)
        if then is not None:
            while r.n_out == 0:
                await asyncio.sleep(0.001)
            await then(e, r)
        await drain(r)
    finally:
        await e.stop()
    return r


def test_a_decode_caches_and_announces_a_generated_block_after_the_step_that_fills_it():
    # vLLM's allocate_slots caches min(computed + new, num_tokens) tokens' full blocks in every step, output
    # tokens included, and the step's BlockStored goes out after it (update_from_output): a 20-token prompt's
    # block 1 (its last 4 tokens and the first 12 generated) fills in the step that computes the 12th
    # generated token's KV, the 13th step; block 2 (generated 12-27) in the 29th; the request ends at the 40th
    e, pub = recorded()
    r = virtual.run(_decoding(e))
    seq = prompt(20, 90) + r.generated
    stored = [(steps, ev.token_ids, ev.parent_block_hash) for steps, _, ev in pub.gpu_stored()]
    h = [external(d) for d in e.cache.digests(seq)]
    assert stored == [(1, seq[:16], None), (13, seq[16:32], h[0]), (29, seq[32:48], h[1])]


def test_a_prompt_that_extends_a_running_requests_output_hits_the_blocks_it_generated():
    # while the request still runs, a prompt made of its prompt, its first 16 tokens and more finds the
    # block its output filled already cached: 32 cached tokens, not 16
    async def extend(e, r):
        while len(r.generated) < 16:
            await asyncio.sleep(0.001)
        q = e.submit(prompt(20, 90) + r.generated[:16] + prompt(10, 91), 1)
        await drain(q)
        assert not r.done
        extend.cached = q.cached_tokens

    virtual.run(_decoding(recorded()[0], then=extend))
    assert extend.cached == 32


def test_a_steps_events_keep_vllms_order_running_requests_first():
    # vLLM schedules the running requests in admission order, then the waiting ones, and its events follow:
    # a decode filling a block and, after it, the chunk of a long prompt admitted later, in one batch
    async def long_prompt(e, r):
        await drain(e.submit(prompt(200_000, 92), 1))

    e, pub = recorded(num_blocks=20_000)
    r = virtual.run(_decoding(e, then=long_prompt))
    h = [external(d) for d in e.cache.digests(prompt(20, 90) + r.generated)]
    (batch,) = [evs for _, _, evs in pub.batches
                if any(isinstance(ev, BlockStored) and ev.block_hashes == [h[1]] for ev in evs)]
    assert batch[0].block_hashes == [h[1]] and len(batch) == 2 and len(batch[1].block_hashes) > 500


def test_a_decodes_new_block_evicting_a_cached_one_is_announced_after_that_step():
    # 5 blocks: a 64-token prompt (step 1) leaves 4 cached blocks in the free queue; the decoding request
    # evicts one at admission (step 2), one when its 33rd token needs a third block (its 14th step) and
    # one when its 49th needs a fourth (its 30th): each BlockRemoved goes out after the step that evicted,
    # not at the end of a run of decode steps
    async def main():
        e.start()
        try:
            await drain(e.submit(prompt(64, 93), 1))
        finally:
            await e.stop()
        return await _decoding(e)

    e, pub = recorded(num_blocks=6)
    virtual.run(main())
    removed = [steps for steps, _, evs in pub.batches for ev in evs if isinstance(ev, BlockRemoved)]
    assert removed == [2, 15, 31]


async def test_preemptions_are_exported_as_vllm_num_preemptions():
    async with SimFleet(FleetConfig(workers=1, num_blocks=11, block_size=16,
                                    timing=DEFAULT_TIMING.with_(time_scale=1000), stream_interval=4)) as f:
        url = f.workers[0].url
        async with httpx.AsyncClient(timeout=30) as c:
            await asyncio.gather(*(c.post(url + "/v1/completions",
                                          json={"prompt": list(range(i, i + 48)), "max_tokens": 60})
                                   for i in (0, 1000)))
            text = (await c.get(url + "/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_preemptions_total{"))
    assert float(line.rsplit(" ", 1)[1]) >= 1
