"""Index maintenance from the G4 directory itself, for the gateway's admin hooks.

- :func:`rebuild_index` rebuilds a model's G4 entries after a gateway (or index) restart by scanning the
  store, so blocks written before the restart are routable again.
- :func:`gc_store` runs the LRU GC from the gateway side (when the gateway mounts G4) and removes the
  evicted blocks from the index.

The connector does the same from inside vLLM through its events; these work without any worker running.
Directory scans run in a thread: they never block the event loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from cache_tier.store import FORMAT_VERSION, G4Store, open_namespaces, store_for_dir


def model_namespaces(root: str, model: str, tp_rank: int | None = 0) -> list[str]:
    """Namespace directories of ``model`` for one TP rank (rank 0 stands for the TP group) or all (None),
    in this file format (a directory of an older format is never read by the connector)."""
    return sorted(
        d
        for d, ns in open_namespaces(root)
        if ns.get("model") == model
        and ns.get("format_version") == FORMAT_VERSION
        and (tp_rank is None or ns.get("tp_rank", 0) == tp_rank)
    )


def scan_hashes(root: str, model: str) -> Iterator[int]:
    for d in model_namespaces(root, model):
        yield from store_for_dir(d, scan=False).hashes()


async def rebuild_index(index, model: str, root: str, *, batch: int = 2000) -> int:
    """Record every block of ``model`` found under ``root`` as on G4; returns how many."""
    # every filesystem call off the event loop: on a hung shared mount even a stat blocks
    hashes = await asyncio.to_thread(lambda: list(scan_hashes(root, model)) if os.path.isdir(root) else [])
    for i in range(0, len(hashes), batch):
        await index.store_g4(model, hashes[i : i + batch])
    return len(hashes)


async def gc_store(index, model: str, root: str, capacity_bytes: int) -> list[int]:
    """Bring each of the model's namespaces under ``capacity_bytes`` (LRU by mtime) and tell the index."""
    evicted: list[int] = []

    def run() -> None:
        for d in model_namespaces(root, model, tp_rank=None):
            st: G4Store = store_for_dir(d, capacity_bytes=capacity_bytes)
            out = st.gc()
            if st.ns.tp_rank == 0:  # the index knows blocks by hash, once per TP group
                evicted.extend(out)

    await asyncio.to_thread(run)
    if evicted:
        await index.remove_g4(model, evicted)
    return evicted
