"""The replayer against one simulated worker: records, summary, table, plot and JSON; the CLI's slices."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench import replay as rp
from bench import replay_cli
from bench.replay_workloads import WorkItem


async def test_replay_summary_table_plot_json(fleet, tmp_path):
    w = fleet.workers[0]
    base = np.arange(100, 180, dtype=np.uint32)
    items = [WorkItem(at=0.0, tokens=base, max_tokens=4), WorkItem(at=0.05, tokens=base, max_tokens=4),
             WorkItem(at=0.1, tokens=np.arange(5000, 5040, dtype=np.uint32), max_tokens=4)]
    res = await rp.replay(items, w.url, "sim-model", name="direct", time_scale=1000, worker_urls=[w.url],
                          ceiling=0.25, progress=True)
    bad = await rp.replay(items[:1], w.url, "no-such-model", name="bad", time_scale=1000, progress=False)
    s = res.summary()
    assert s["ok"] == 3 and s["failed"] == 0
    # second request hit 4 full blocks of the first (80 tokens -> (80-1)//16 = 4 blocks = 64 tokens)
    assert s["cached_tokens"] == 64 and s["prompt_tokens"] == 200
    assert s["hit_rate"] == pytest.approx(64 / 200) and s["worker_hit_rate"] == pytest.approx(64 / 200)
    assert s["ttft_p50_s"] > 0 and s["e2e_mean_s"] >= s["ttft_mean_s"]
    b = bad.summary()
    assert b["failed"] == 1 and "does not exist" in bad.records[0].error and bad.records[0].status == 404
    table = rp.table([s, b], baseline="direct")
    assert "direct" in table and "32.0%" in table and "25.0%" in table and "1.00x" in table
    png = rp.plot([res, bad], tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(rp.write_json([res], tmp_path / "r.json").read_text())
    assert data["runs"][0]["summary"]["cached_tokens"] == 64 and len(data["runs"][0]["records"]) == 3


def test_cli_trace_slice_and_its_ceiling():
    p = argparse.ArgumentParser()
    replay_cli.add_arguments(p)
    args = p.parse_args(["--duration", "120", "--max-prompt-tokens", "20000"])
    items, ceiling = replay_cli.build_items(args)
    assert items and all(len(i.tokens) <= 20000 for i in items) and all(i.at < 120 for i in items)
    assert 0.05 < ceiling < 0.2
    args = p.parse_args(["--workload", "rag", "--limit", "5"])
    items, ceiling = replay_cli.build_items(args)
    assert len(items) == 5 and 0 < ceiling < 1
