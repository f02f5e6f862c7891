"""The Redis index's Lua scripts, kept as package resources in ``indexer/index/lua/``.

A script's first line may name shared snippets (``-- include: locals split``); they are the files
``_<name>.lua`` and are prepended in that order. Sources are read once and cached.
"""
from __future__ import annotations

from functools import cache
from importlib.resources import files

_INCLUDE = "-- include:"


@cache
def source(name: str) -> str:
    """The full source of ``lua/<name>.lua`` with its includes."""
    text = files("indexer.index").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")
    first, _, rest = text.partition("\n")
    if not first.startswith(_INCLUDE):
        return text
    parts = [files("indexer.index").joinpath("lua", f"_{inc}.lua").read_text(encoding="utf-8")
             for inc in first[len(_INCLUDE):].split()]
    return "\n".join(parts) + "\n" + rest
