"""The README's first command on a fresh machine: ``git clone`` the repository alone, then ``make demo``.

The clone is of the committed HEAD, into an empty temporary directory, with no ``shared/`` beside it and none
of this environment's variables that point at kvgate or its virtualenv. ``make demo`` then does what a new
user's does (a venv inside the clone, ``pip install -e '.[bench]'``, ``kvgate demo``); only the replayed
trace slice is short (``DEMO_ARGS``). pip's own cache and configuration are this machine's, as a user's are.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A short slice of the trace: a few dozen requests per policy, replayed 10x faster.
SHORT = "--duration 20 --time-scale 10 --workers 2 --no-progress"


def _clean_env() -> dict[str, str]:
    """This environment minus the test run's virtualenv and what points Python or kvgate elsewhere."""
    own_bin = str(Path(sys.prefix) / "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != own_bin)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVGATE_", "PYTEST", "VIRTUAL_ENV", "PYTHON")) and k != "VLLM_VENV"}
    env.update(PATH=path, PYTHONNOUSERSITE="1")
    return env


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_make_demo_works_from_a_bare_clone(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.fail(f"{ROOT} is not a git checkout: this test clones the committed HEAD")
    for tool in ("git", "make", "python3"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed; the README's set-up needs it")
    clone = tmp_path / "kvgate"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                   check=True, timeout=300, capture_output=True)
    assert not (tmp_path / "shared").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["kvgate"]
    assert (clone / "bench" / "traces" / "mooncake_conversation_trace.jsonl.xz").is_file()

    proc = subprocess.run(["make", "demo", f"DEMO_ARGS={SHORT}"], cwd=clone, env=_clean_env(),
                          capture_output=True, text=True, timeout=1400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # the clone's own venv and package ran, not this checkout's
    assert (clone / ".venv" / "bin" / "kvgate").exists()
    site = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c",
                           "import bench; print(bench.__file__)"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert site.stdout.strip() == str(clone / "bench" / "__init__.py"), site.stdout + site.stderr
    # the demo's report: both policies replayed the slice with no failures, and the plot was written
    assert "trace requests from 0s to 20s" in out, out[-4000:]
    assert "- policy kv ..." in out and "- policy round_robin ..." in out
    table = out[out.index("- policy round_robin ..."):]
    assert "kv" in table and "round_robin" in table and "1.00x" in table, table[-3000:]
    png = clone / "kvgate-demo" / "demo.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert (clone / "kvgate-demo" / "demo.json").is_file()
