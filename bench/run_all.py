"""``make bench``: the CPU-only benchmarks, one after another, each printing its own ratios.

The real-vLLM (bench_vllm_policies, bench_g4_ttft) and fleet (side_by_side) benchmarks take tens of
minutes and are run by their own commands (docs/BENCHMARKS.md). ``--quick`` gives smoke-sized runs.
"""
from __future__ import annotations

import subprocess
import sys

# module -> whether it takes --quick
BENCHES = {"bench.bench_index": True, "bench.bench_gateway": True, "bench.bench_admin": True,
           "bench.bench_g4_store": False, "bench.bench_caches": True}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    rc = 0
    quick = "--quick" in args
    for mod, takes_quick in BENCHES.items():
        cmd = [sys.executable, "-m", mod] + (["--quick"] if quick and takes_quick else [])
        print(f"\n=== {' '.join(cmd[1:])}", flush=True)
        rc |= subprocess.call(cmd)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
