"""The ``kvgate`` command. Each subcommand lives in its own module exposing ``add_arguments`` and ``run``,
so the CLI stays a thin dispatcher and heavy imports happen only for the command that runs."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "serve": ("router.commands.serve", "run the gateway"),
    "calc": ("sizing.cli", "KV-cache sizing calculator"),
    "sim": ("bench.sim.cli", "run a simulated vLLM fleet"),
    "replay": ("bench.replay_cli", "replay a trace or synthetic workload against an endpoint"),
    "demo": ("bench.demo", "simulated fleet + gateway + trace replay, kv vs round_robin"),
    "bench": ("router.commands.bench", "benchmarks on real vLLM servers (redbook: G4 beside the Redbook)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-aware gateway for vLLM fleets")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
