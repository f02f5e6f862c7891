"""The fleet duplication figure the simulator benchmarks report for every router (bench/sim/occupancy.py),
read from real simulated workers: a prompt sent to both workers is resident twice, distinct prompts are not."""
from __future__ import annotations

import asyncio

import httpx

from bench.sim.occupancy import OccupancySampler, duplication


def test_duplication_counts_second_copies():
    assert duplication([[1, 2, 3, 4], [3, 4, 5, 6]]) == {"resident": 8, "distinct": 6, "dup_share": 0.25}
    assert duplication([[], []])["dup_share"] == 0.0


async def _send(url: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200


async def test_sampler_sees_a_prompt_held_by_both_workers(fleet):
    a, b = (w.url for w in fleet.workers)
    sampler = OccupancySampler([a, b, "http://127.0.0.1:9"], timeout_s=2)  # a dead worker is left out
    await _send(a, list(range(100, 164)))
    await _send(b, list(range(200, 264)))
    distinct = await asyncio.to_thread(sampler.sample)
    assert distinct["resident"] > 0 and distinct["dup_share"] == 0.0
    await _send(b, list(range(100, 164)))  # the first prompt now lives on both
    both = await asyncio.to_thread(sampler.sample)
    assert both["resident"] > distinct["resident"] and both["distinct"] == distinct["resident"]
    assert both["dup_share"] > 0.2
    summary = await asyncio.to_thread(sampler.stop)
    assert summary["samples"] == 3 and summary["dup_share_end"] == both["dup_share"]
