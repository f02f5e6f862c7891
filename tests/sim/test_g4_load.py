"""G4 loads in the simulated engine, as vLLM runs them with an async-loading KV connector: the request waits
for its blocks outside the step loop (WAITING_FOR_REMOTE_KVS), so the load adds to its own TTFT only; the
worker's G4 reads are served one after another at its bandwidth; other requests keep their steps; the loaded
blocks are cached, and announced, only once the load is done.

Checked on the engine's own clock (model seconds of steps run), on lower bounds of scaled wall time (a sleep
never ends early), and on the virtual clock of ``bench.sim.virtual``; never on wall-time upper bounds."""
from __future__ import annotations

import argparse
import asyncio

import numpy as np

from bench.replay_workloads import WorkItem
from bench.sim import cli as sim_cli
from bench.sim import virtual
from bench.sim.cache import PrefixCache, SharedG4Store
from bench.sim.engine import SimEngine
from bench.sim.events import BlockStored
from bench.sim.timing import DEFAULT_TIMING
from tests.sim import test_scheduler as sched
from tests.sim.test_scheduler import Recorder, drain, prompt

B = 16
SCALE = 1e3


def on_g4(store: SharedG4Store, tokens: list[int]) -> int:
    """Put ``tokens``' full blocks on the shared store (as another worker that computed them would);
    returns the tokens a lookup can load (never the last one)."""
    other = PrefixCache(len(tokens) // B + 8, B, g4=store)
    a = other.allocate(tokens, len(tokens))
    other.write_g4(a, tokens)
    return (len(tokens) - 1) // B * B


def engine(store: SharedG4Store, **timing):
    return sched.engine(scale=SCALE, g4=store, **timing)


async def load_beside_a_cold_prompt(**timing):
    """A 100K-token prompt whose blocks are on G4, submitted with a short cold one beside it; the engine
    (its timing), the two requests and the tokens the first can load."""
    store = SharedG4Store()
    big = prompt(100_000, 1)
    g4_tokens = on_g4(store, big)
    async with engine(store, **timing) as e:
        loaded = e.submit(big, 1)
        cold = e.submit(prompt(200, 2), 1)
        await drain(loaded, cold)
    return e, loaded, cold, g4_tokens


async def test_a_g4_load_does_not_stall_the_requests_beside_it():
    e, loaded, cold, g4_tokens = await load_beside_a_cold_prompt()
    t = e.timing
    load_s = t.g4_load_s(g4_tokens)
    assert loaded.cached_tokens == g4_tokens and load_s > 0.3
    # the short cold prompt computed in its own step, without waiting for the 100K-token load
    assert cold.first_token_clock - cold.scheduled_clock < load_s
    assert cold.prefill_s < loaded.prefill_s
    # the loaded request paid its load (wall x scale: a sleep never ends early), far less than recomputing
    assert loaded.prefill_s * SCALE >= load_s
    assert t.g4_load_s(g4_tokens) + t.prefill_s(100_000 - g4_tokens, g4_tokens) < t.prefill_s(100_000) / 10


async def test_a_synchronous_load_stalls_its_step():
    e, loaded, cold, g4_tokens = await load_beside_a_cold_prompt(g4_async_load=False)
    # batched with the load: its first token waits for the whole step
    assert cold.first_token_clock - cold.scheduled_clock >= e.timing.g4_load_s(g4_tokens)


async def test_a_load_within_the_sync_limit_runs_in_the_step_a_longer_one_outside():
    """kvgate's connector in ``load_async: auto``: a short load stalls its step, a long one does not."""
    for limit, in_step in ((60.0, True), (0.01, False)):
        e, loaded, cold, g4_tokens = await load_beside_a_cold_prompt(g4_sync_load_max_s=limit)
        load_s = e.timing.g4_load_s(g4_tokens)
        assert 0.01 < load_s < 60.0 and loaded.cached_tokens == g4_tokens
        assert (cold.first_token_clock - cold.scheduled_clock >= load_s) is in_step, (limit, load_s)


def test_kvgate_sim_takes_the_sync_load_limit_from_its_command_line():
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    assert sim_cli.timing_from_args(p.parse_args([])).g4_sync_load_max_s == 0.0
    args = p.parse_args(["--g4", "--g4-sync-load-max-s", "0.02"])
    assert sim_cli.fleet_config_from_args(args).timing.g4_sync_load_max_s == 0.02


async def test_g4_loads_on_one_worker_share_its_bandwidth():
    store = SharedG4Store()
    p1, p2 = prompt(50_000, 3), prompt(50_000, 4)
    g1, g2 = on_g4(store, p1), on_g4(store, p2)
    async with engine(store) as e:
        r1, r2 = e.submit(p1, 1), e.submit(p2, 1)
        await drain(r1, r2)
    t = e.timing
    # the second load starts when the first ends
    assert r2.prefill_s * SCALE >= t.g4_load_s(g1) + t.g4_load_s(g2)
    assert r1.first_token_clock <= r2.first_token_clock


async def test_a_request_aborted_during_its_load_frees_its_blocks():
    store = SharedG4Store()
    big = prompt(100_000, 5)
    on_g4(store, big)
    async with engine(store, g4_read_bytes_per_s=1e6) as e:  # a very slow tier: the load outlasts the abort
        r = e.submit(big, 1)
        while r.alloc is None:
            await asyncio.sleep(0.0001)
        assert e.num_waiting == 1 and e.running == 0
        e.abort(r)
        nxt = e.submit(prompt(100, 6), 1)
        await drain(nxt)
        assert r.done and e.num_waiting == 0
        assert e.cache.num_free == e.cache.usable


async def _half_on_g4(*, burst: bool = False, followup: bool = False, abort: bool = False):
    """On the virtual clock (model seconds): a 2000-token prompt whose first 64 blocks are on G4, loaded at
    1 MB/s (76 s) outside the steps; with ``abort`` it is aborted during its load; with ``burst`` the same
    prompt again while that load is in flight, with ``followup`` once more after the first request's end.
    The engine, its publisher and the requests."""
    store = SharedG4Store()
    big = prompt(2000, 7)
    on_g4(store, big[:64 * B])
    pub = Recorder()
    e = pub.engine = SimEngine(PrefixCache(1000, B, g4=store), pub,
                               DEFAULT_TIMING.with_(time_scale=1.0, g4_read_bytes_per_s=1e6))
    e.start()
    try:
        reqs = [e.submit(big, 1)]
        while reqs[0].alloc is None:
            await asyncio.sleep(0.001)
        assert e.num_waiting == 1 and e.running == 0  # loading
        if abort:
            e.abort(reqs[0])
        if burst:
            reqs.append(e.submit(big, 1))
        await drain(*reqs)
        if followup:
            reqs.append(e.submit(big, 1))
            await drain(reqs[-1])
    finally:
        await e.stop()
    return e, pub, reqs


def test_a_request_behind_an_async_load_of_its_prefix_loads_it_too():
    # vLLM caches an async load's blocks only when the load is done (allocate_slots with delay_cache_blocks,
    # then _update_waiting_for_remote_kv), and computes nothing of the request before: a second request with
    # the same prompt, admitted while the load is in flight, finds none of it in the local prefix cache and
    # loads the same blocks from G4 itself, after the first load (one G4 read at a time per worker)
    e, _, (first, second) = virtual.run(_half_on_g4(burst=True))
    assert first.cached_tokens == first.g4_tokens == 64 * B
    assert second.cached_tokens == second.g4_tokens == 64 * B
    assert e.cache.hits == 0 and e.cache.external_hits == 2 * 64 * B  # vllm:(external_)prefix_cache_hits
    load_s = e.timing.g4_load_s(64 * B)
    assert second.prefill_s >= 2 * load_s > first.prefill_s >= load_s
    # once the first has run, its whole prompt is cached: a third finds it locally
    e, _, reqs = virtual.run(_half_on_g4(followup=True))
    assert reqs[-1].cached_tokens == (2000 - 1) // B * B and reqs[-1].g4_tokens == 0


def test_a_request_aborted_during_its_load_leaves_nothing_cached():
    # vLLM frees a request aborted in WAITING_FOR_REMOTE_KVS without caching its blocks: the next request
    # with the same prompt loads them from G4 again, and no BlockStored went out for the aborted one
    e, pub, (aborted, again) = virtual.run(_half_on_g4(abort=True, burst=True))
    assert aborted.n_out == 0 and again.g4_tokens == again.cached_tokens == 64 * B
    assert {h for _, _, ev in pub.gpu_stored() for h in ev.block_hashes} == set(again.alloc.hashes)


def test_an_async_loads_blocks_are_announced_after_the_step_that_follows_the_load():
    # vLLM publishes a step's KV events after it: the loaded blocks' BlockStored goes out with the step
    # where the request joins once its load is done (cached first, then its first chunk's blocks), never at
    # admission
    e, pub, (r,) = virtual.run(_half_on_g4())
    stored = pub.gpu_stored()
    h = r.alloc.hashes
    assert [(steps, ev.block_hashes, ev.parent_block_hash) for steps, _, ev in stored] == [
        (1, h[:64], None), (1, h[64:125], h[63])]
    assert stored[0][1] >= r.load_done
    assert not any(isinstance(ev, BlockStored) and ev.medium == "GPU"
                   for steps, _, evs in pub.batches if steps == 0 for ev in evs)


def _sessions(n: int, turns: int, first: int, per_turn: int, gap_s: float, seed: int = 3) -> list[WorkItem]:
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        hist = rng.integers(0, 32000, first).astype(np.uint32)
        for k in range(turns):
            out.append(WorkItem(at=s * 0.7 + k * gap_s, tokens=hist.copy(), max_tokens=16, session=f"s{s}"))
            hist = np.concatenate([hist, rng.integers(0, 32000, per_turn).astype(np.uint32)])
    return sorted(out, key=lambda w: w.at)


def test_g4_lowers_the_ttft_of_sessions_whose_history_was_evicted():
    # 12 long sessions on 2 workers that hold about one history each: their next turns find their history
    # evicted locally, and (with G4) on the shared store
    items = _sessions(12, 3, first=20_000, per_turn=500, gap_s=30.0)
    off = virtual.summary(virtual.run(virtual.replay_engines(items, workers=2, num_blocks=2_000, g4=False)))
    on = virtual.summary(virtual.run(virtual.replay_engines(items, workers=2, num_blocks=2_000, g4=True)))
    assert on["hit_rate"] > off["hit_rate"] + 0.4, (on, off)
    assert on["ttft_mean_s"] < 0.5 * off["ttft_mean_s"], (on, off)
