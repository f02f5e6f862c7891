"""The parts of ``kvgate bench redbook`` that need no vLLM: its settings, the workload's shape, the
table and plot from a result, and the noisy neighbour's bounds."""

from __future__ import annotations

import argparse
import os
import time

from bench import redbook, redbook_report
from bench.redbook_noise import NoisyNeighbour
from bench.redbook_runs import workload


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    redbook.add_arguments(p)
    return redbook.settings(p.parse_args(list(argv)))


def test_settings_fill_the_mode_defaults_and_parse_the_connector_extra():
    full, quick = _args(), _args("--quick", "--connector-extra", '{"load_async": false}')
    assert (full.servers, full.max_model_len, full.gpu_blocks, full.concurrency) == (2, 8192, 257, 16)
    assert (quick.servers, quick.max_model_len, quick.gpu_blocks) == (1, 2048, 65)
    assert quick.connector_extra == {"load_async": False} and full.connector_extra == {}
    assert _args("--requests", "10").concurrency == 5


def test_workload_uses_every_unique_prompt_twice_second_pass_after_the_first():
    ps = workload(12, 40, 80, seed=3)
    uniq = {tuple(p) for p in ps}
    assert len(ps) == 12 and len(uniq) == 6
    assert {tuple(p) for p in ps[:6]} == uniq == {tuple(p) for p in ps[6:]}
    other = workload(12, 40, 80, seed=3, variant=1)
    assert [len(p) for p in other] == [len(p) for p in ps]  # the same work ...
    assert not uniq & {tuple(p) for p in other}  # ... sharing nothing


def _result() -> dict:
    run = {"requests": 8, "requests_per_s": 1.0, "total_s": 8.0, "reuse_ceiling_x": 2.0}
    return {
        "args": {"concurrency": 4},
        "ttft": [{"tokens": 512, "cold_s": 1.0, "g4_s": 0.1}, {"tokens": 2016, "cold_s": 5.0, "g4_s": 0.14}],
        "throughput": {"off": run, "on": {**run, "requests_per_s": 1.6, "total_s": 5.0},
                       "noisy": {**run, "requests_per_s": 1.2, "total_s": 6.6}},
        "noise": {"total_MBps": 300.0, "write_MBps": 100.0, "read_MBps": 200.0},
    }


def test_table_and_plot(tmp_path):
    res = _result()
    f = redbook_report.figures(res)
    assert abs(f["growth_share"] - 0.01) < 1e-9 and abs(f["throughput_x"] - 1.6) < 1e-9
    assert abs(f["noisy_degradation"] - 0.25) < 1e-9
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in redbook_report.table(res).splitlines()[2:]}
    assert rows["G4 growth / cold growth"][2] == "1.0%" and rows["G4 growth / cold growth"][4] == "yes |"
    assert rows["throughput, G4 on / off"][2] == "1.60x" and rows["throughput, G4 on / off"][4] == "NO |"
    assert all(len(r) == 5 for r in rows.values())  # no stray column separators
    png = redbook_report.plot(res, tmp_path / "r.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_noisy_neighbour_moves_bytes_within_its_cap_and_cleans_up(tmp_path):
    with NoisyNeighbour(str(tmp_path), writers=1, readers=1, file_mib=4, cap_mib=16, max_s=30) as nn:
        time.sleep(0.5)
        nn.mark()
        time.sleep(1.0)
        used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nn.dir) for f in fs)
    r = nn.result()
    assert r["write_MBps"] > 0 and r["read_MBps"] > 0
    assert used <= 16 << 20 and r["cap_MiB"] == 16
    assert not os.listdir(tmp_path)  # its directory is gone
    assert all(not p.is_alive() for p in nn.procs)
