"""``bench.bench_g4_sim`` on a tiny workload: with the fleet's shared G4 store on, kvgate ``kv`` serves more
prompt tokens from cache than with it off, and the gateway's index learns the G4 blocks.

Real parts on loopback, through the benchmark's own harness: a ``kvgate sim`` fleet process, a kvgate gateway
process (in-memory index), the replayer. Only hit rates and counts are asserted, never timings."""
from __future__ import annotations

from bench import bench_g4_sim
from bench.replay_workloads import token_ceiling
from tests.sim.test_replay_gateway import sessions


def test_g4_on_raises_hit_rate(tmp_path):
    # 6 sessions x 3 turns, 2 s of wall time apart at 20x: a loaded machine has written the previous turn to
    # G4 before the next one arrives
    items = sessions(n_sessions=6, turns=3, seed=11, stagger_s=0.3)
    ceiling = token_ceiling(items, 16)
    off, on = bench_g4_sim.targets()[:2]
    # 2 workers of 80 blocks (1,280 tokens): each holds one history at a time, so local caches alone lose
    # almost every session's next turn to the other sessions
    results = bench_g4_sim.compare(items, ceiling=ceiling, workers=2, num_blocks=80, block_size=16,
                                   time_scale=20.0, out=tmp_path, tlist=[off, on], progress=False)
    s_off, s_on = (r.summary() for r in results)
    assert s_off["failed"] == 0 and s_on["failed"] == 0
    assert s_on["hit_rate"] > s_off["hit_rate"] + 0.1, (s_on["hit_rate"], s_off["hit_rate"])
    assert s_on["hit_rate"] <= ceiling + 1e-9
    # the workers' STORAGE events reached the gateway's index and its decisions counted G4 blocks
    g4 = s_on["gateway_g4"]
    assert g4.get("index_g4_blocks", 0) > 0, g4
    assert g4["decisions"] == len(items) and g4["decisions_with_g4"] > 0, g4
    # the gateway prices a block loaded from G4 well below recomputing it, as the simulator runs them (the
    # fleet runs 20x faster than real time, and so must the G4 bandwidth the gateway is told), over every
    # candidate that would load from G4. Whether the chosen worker then does depends on the run's timing
    # (a full suite once chose none: the chosen ones held the history locally), so that is not asserted.
    assert g4["g4_ms_per_block"] < 0.5 * g4["compute_ms_per_block"], g4
    assert "gateway_g4" not in s_off
    # at rest the gateway's index holds exactly the blocks the engines hold, worker by worker: every
    # eviction reached it (an index that lagged would predict hits that are gone)
    for s in (s_off, s_on):
        view = s["index_view"]
        assert len(view["workers"]) == 2 and view["engine_blocks"] > 0, view
        assert all(w["index_gpu"] == w["engine_blocks"] and w["dropped"] == 0 for w in view["workers"].values()), view
    assert "G4 on" in bench_g4_sim.table([s_off, s_on])

