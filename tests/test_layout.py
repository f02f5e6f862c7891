"""The README's layout table against the tree, and no module left behind where it used to live."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_rows() -> list[tuple[list[str], list[str]]]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("| folder | what it holds |"):]
    rows = []
    for line in block.splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, second = line.strip("|").split("|", 1)
        rows.append((re.findall(r"`([^`]+)`", first), re.findall(r"`([^`]+)`", second)))
    return rows


def tracked_top_dirs() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()
    return {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}


def test_every_top_level_folder_is_in_the_layout_table_and_every_entry_exists():
    named = set()
    for folders, parts in table_rows():
        for folder in folders:
            assert (ROOT / folder).exists(), folder
            named.add(folder.rstrip("/").split("/")[0])
        base = ROOT / folders[0].rstrip("/")
        for part in parts:  # files and folders named inside the row: relative to the row, or to the root
            if not re.fullmatch(r"[\w*.-]+(/[\w*.-]+)*/?", part) or not ("/" in part or part.endswith(".py")):
                continue
            rel = part.rstrip("/")
            assert list(base.glob(rel)) or list(ROOT.glob(rel)), f"{part} (row {folders[0]})"
    assert tracked_top_dirs() - {"helm"} <= named, tracked_top_dirs() - named
    assert "helm/kvgate" in {f for fs, _ in table_rows() for f in fs}


def test_moved_modules_left_no_shim_behind():
    for old in ("router/calc.py", "router/commands/calc.py", "indexer/events/vllm_format.py"):
        assert not (ROOT / old).exists(), old
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml", "Dockerfile"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout.split()
    stale = re.compile(r"router\.calc\b|router/calc\.py|router\.commands\.calc|indexer\.events\.vllm_format|"
                       r"indexer/events/vllm_format|from indexer\.events import vllm_format")
    hits = [f for f in tracked if f != "tests/test_layout.py" and stale.search((ROOT / f).read_text())]
    assert hits == []
