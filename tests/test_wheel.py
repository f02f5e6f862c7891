"""`make wheel`: the file a user installs into vLLM's image for kvgate's KV connector (kvgate is not on PyPI,
so `pip install kvgate` finds nothing), and every instruction that names it."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
WHEEL = f"kvgate-{VERSION}-py3-none-any.whl"
# where the set-up instructions for vLLM's image live
GUIDES = ["README.md", "docs/g4.md", "docs/kubernetes.md", "helm/kvgate/README.md",
          "helm/kvgate/templates/NOTES.txt"]


@pytest.mark.slow
def test_make_wheel_builds_what_vllm_needs_to_load_the_connector(tmp_path):
    """The target builds in this environment (the venv `make test` made; not remade here) into ``DIST``, and
    the wheel holds the connector vLLM loads (``cache_tier.connector``) and what it imports, with nothing of
    the tests; its name is the one the guides give."""
    proc = subprocess.run(["make", "-s", "-o", ".venv/.demo-installed", "wheel", f"DIST={tmp_path}",
                           f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheel = tmp_path / WHEEL
    assert wheel.exists(), sorted(p.name for p in tmp_path.iterdir())
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"cache_tier/connector.py", "cache_tier/connector_worker.py", "indexer/hashing.py",
            "indexer/events/wire.py"} <= names
    assert not any(n.startswith("tests/") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: xxhash" in meta  # why the guides install xxhash beside a --no-deps install


def test_the_guides_install_the_built_wheel_not_a_package_from_pypi():
    """Every guide for vLLM's image points at `make wheel` and its file at this version, and none says
    `pip install ... kvgate` by name (no such package is published)."""
    for guide in GUIDES:
        text = (ROOT / guide).read_text()
        assert "make wheel" in text, guide
        assert not re.search(r"pip install (--no-deps )?kvgate\b", text), guide
        names = set(re.findall(r"kvgate-([0-9][^-\s`]*|<version>)-py3-none-any\.whl", text))
        assert names <= {VERSION, "<version>"}, (guide, names)
