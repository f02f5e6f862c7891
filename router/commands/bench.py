"""``kvgate bench <name>``: benchmarks on real vLLM servers. Each one is a module exposing
``add_arguments`` and ``run``, imported only when it runs (as the top-level commands are)."""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "redbook": ("bench.redbook", "the Redbook's three G4 benchmarks at this machine's scale, beside its"
                " figures"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    for name, (module, help_) in BENCHES.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_))


def run(args) -> int:
    return int(importlib.import_module(BENCHES[args.bench][0]).run(args) or 0)
