"""``kvgate bench redbook --quick`` end to end: real vLLM CPU servers (with and without kvgate's G4
connector) behind a kvgate gateway, the noisy neighbour on the G4 filesystem, the table and the plot.
Content checks only (no timing thresholds: the machine is shared). Run on the tiny test model: the
checks hold for any model, and the bench's own 152m model took 10.5 of the suite's 34 minutes here (its
settings and defaults are checked in test_redbook_parts.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vllm_server import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not (vllm_python().parent.parent / ".kvgate-ready").exists():  # `make test` builds it
    pytestmark.append(pytest.mark.skip(reason="vLLM env missing: run `make vllm-env`"))

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_the_table_and_writes_the_plot(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "router.cli", "bench", "redbook", "--quick", "--size", "tiny", "--no-progress",
         "--out", str(out), "--g4-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=840,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = [line for line in p.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| benchmark | Redbook | kvgate here |")
    names = [line.split(" | ")[0][2:] for line in table[1:]]
    for want in ("TTFT at the largest context, cold / G4", "G4 growth / cold growth",
                 "throughput, G4 on / off", "noisy neighbour: degradation vs clean G4 run",
                 "junk traffic on the G4 filesystem"):
        assert want in names, names

    png = out / "redbook.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    res = json.loads((out / "redbook.json").read_text())
    for row in res["ttft"]:
        assert row["cold_cached"] == 0  # a fresh prompt: nothing of it anywhere
        assert row["g4_cached"] >= row["tokens"] - 64, row  # every full block but the last loaded from G4
        assert row["cold_s"] > 0 and row["g4_s"] > 0
    runs = res["throughput"]
    assert set(runs) == {"off", "on", "noisy"}
    for r in runs.values():
        assert r["requests"] == 8 and r["total_s"] > 0 and r["prompt_tokens"] > 0
    # second uses came from G4 (the minimal GPU cache cannot keep them), so the G4 runs report cached tokens
    assert runs["on"]["cached_tokens"] > 0 and runs["noisy"]["cached_tokens"] > 0
    assert sum(s["loads"] for s in runs["on"]["g4_stats"]) > 0
    assert res["noise"]["total_MBps"] > 0
    assert not list(tmp_path.glob("kvgate-noise-*")), "the noisy neighbour left its files"
