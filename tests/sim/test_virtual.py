"""``bench.sim.virtual``: the engines on a virtual clock, the load figures of a replay (utilisation, the mean
TTFT per window of arrivals), the placement and the sweep command. Asserted on model seconds only."""
from __future__ import annotations

import json

import numpy as np

from bench.replay_workloads import WorkItem
from bench.sim import virtual
from bench.sim.cache import PrefixCache
from bench.sim.engine import SimEngine, SimRequest
from bench.sim.timing import DEFAULT_TIMING


def _items(n: int, gap_s: float, tokens: int = 6_000, seed: int = 5) -> list[WorkItem]:
    rng = np.random.default_rng(seed)
    return [WorkItem(at=i * gap_s, tokens=rng.integers(0, 32000, tokens).astype(np.uint32), max_tokens=8)
            for i in range(n)]


def _replay(items, workers: int) -> virtual.Replay:
    return virtual.run(virtual.replay_engines(items, workers=workers, num_blocks=2_000))


def test_a_replay_reports_how_busy_the_engines_were():
    items = _items(30, 1.0)
    two, one = _replay(items, 2), _replay(items, 1)
    for r in (two, one):
        assert len(r.busy_s) == len(r.utilisation) and r.span_s >= items[-1].at
        assert all(0 <= u <= 1 for u in r.utilisation) and max(r.utilisation) > 0
        # steps carry every prefill's compute, plus their overheads and the decodes
        assert 0 < r.prefill_work_s <= sum(r.busy_s)
        assert 0 < r.prefill_utilisation <= max(r.utilisation)
    # the same work on half the engines: twice the share of their time
    assert one.prefill_work_s == two.prefill_work_s
    assert one.prefill_utilisation > 1.8 * two.prefill_utilisation
    s = virtual.summary(one)
    assert s["util_max"] == max(one.utilisation) and s["prefill_util"] == one.prefill_utilisation


def test_windows_show_a_queue_that_grows_on_an_overloaded_fleet():
    # a prompt every 0.25 s, each 0.4 s of prefill: one engine falls further behind every window
    items = _items(60, 0.25, tokens=8_000)
    one = _replay(items, 1)
    assert DEFAULT_TIMING.prefill_s(len(items[0].tokens)) > 0.35
    w = virtual.windows(one, 5.0)
    assert [x["requests"] for x in w] == [20, 20, 20]
    queues = [x["queue_mean_s"] for x in w]
    assert queues[0] < queues[1] < queues[2]
    # four engines keep up: no window queues, and no backlog left at the last arrival
    four = _replay(items, 4)
    assert max(x["queue_mean_s"] for x in virtual.windows(four, 5.0)) < 0.05
    assert virtual.summary(one)["drain_s"] > 5 > virtual.summary(four)["drain_s"]


def test_placement_counts_the_prefills_waiting_for_their_g4_blocks():
    engines = [SimEngine(PrefixCache(5_000, 16), None) for _ in range(2)]
    # engine 0 holds a 40K-token prompt whose G4 load is in flight: its prefill is still ahead of it
    engines[0]._loading.append(SimRequest(tokens=list(range(40_000)), max_tokens=1))
    assert virtual._place(engines, [7] * 1_000) == 1


def test_the_sweep_prints_and_writes_a_row_per_fleet_size(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert virtual.main(["--duration", "15", "--workers", "3,2", "--window", "5", "--json", str(out)]) == 0
    points = json.loads(out.read_text())
    assert [p["workers"] for p in points] == [3, 2]
    for p in points:
        assert len(p["off_util"]) == p["workers"] and len(p["on_util"]) == p["workers"]
        assert p["on"]["hit_rate"] >= p["off"]["hit_rate"] and p["on"]["hit_rate"] <= p["ceiling"] + 1e-9
        assert [w["start_s"] for w in p["off_windows"]] == [0.0, 5.0, 10.0]
    text = capsys.readouterr().out
    assert "| 3 | 1 |" in text and "| 2 | 1 |" in text
    assert "| trace 0-5 s | trace 5-10 s | trace 10-15 s |" in text


def test_at_a_higher_rate_the_windows_cover_the_same_stretches_of_the_trace(tmp_path):
    out = tmp_path / "sweep.json"
    virtual.main(["--duration", "15", "--workers", "2", "--rate", "1,3", "--window", "5", "--json", str(out)])
    one, three = json.loads(out.read_text())
    assert three["rate"] == 3
    assert [w["requests"] for w in three["off_windows"]] == [w["requests"] for w in one["off_windows"]]
    assert [w["start_s"] for w in three["off_windows"]] == [0.0, 5 / 3, 10 / 3]
    # the same work in less time
    assert three["off"]["span_s"] < one["off"]["span_s"]
    assert three["off"]["prefill_util"] > one["off"]["prefill_util"]


def test_a_replay_places_with_the_placement_it_is_given():
    """``place`` is the seam bench.policy_virtual runs the kv policy's scorers through."""
    items = _items(6, 1.0, tokens=600)
    seen = []

    def last(engines, tokens):
        seen.append(len(tokens))
        return len(engines) - 1

    out = virtual.run(virtual.replay_engines(items, workers=3, num_blocks=2_000, place=last))
    assert [o.worker for o in out] == [2] * 6 and seen == [600] * 6
    assert {o.worker for o in _replay(items, 3)} != {2}  # the default spreads them


def test_the_sglang_router_emulation_follows_its_prefix_and_its_smallest_tree():
    """bench.policy_virtual's peer baseline: a prompt that mostly repeats one sent to a worker goes there;
    one that matches nothing goes to the worker sent the least; a large load imbalance overrides both."""
    from bench.policy_virtual import sglang_cache_aware

    engines = [SimEngine(PrefixCache(2_000, 16), None, DEFAULT_TIMING) for _ in range(3)]
    place = sglang_cache_aware()
    rng = np.random.default_rng(3)
    docs = [[int(x) for x in rng.integers(0, 32000, n)] for n in (800, 400, 200, 300)]
    assert [place(engines, d) for d in docs[:3]] == [0, 1, 2]  # nothing matches: the smallest tree
    assert place(engines, docs[3]) == 2  # 200 tokens sent to 2, the least
    assert place(engines, docs[0][:700] + docs[1][:100]) == 0  # 87% of it was sent to 0
    fresh = [int(x) for x in rng.integers(0, 32000, 800)]
    assert place(engines, docs[2][:64] + fresh) == 1  # 7% matches 2: under the 30% threshold, so 1 (25 blocks)
    engines[2].waiting.extend(SimRequest([1] * 16, 1) for _ in range(100))
    assert place(engines, docs[2]) == 0  # all of it is on 2, but 100 wait there and none on 0
