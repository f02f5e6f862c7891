"""``/admin/g4``: the G4 store's namespaces, blocks, bytes and GC state; block file metadata for
``/admin/blocks``.

The store module (``cache_tier.store``) is imported lazily: it needs torch (the ``g4`` extra), which a
gateway-only install may lack; then the endpoint says so instead of failing. Directory scans run in a
worker thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import os

from fastapi import APIRouter, Query, Request

from router.admin import schemas
from router.admin.common import kv_state
from router.errors import APIError, error_responses

log = logging.getLogger("kvgate.admin")
router = APIRouter(prefix="/g4", tags=["admin: g4"])


def _store_module():
    try:
        from cache_tier import store
    except ImportError as exc:  # torch missing (install kvgate[g4]) or the store not built in
        return None, f"the G4 store module is unavailable: {exc}"
    return store, None


def _namespaces(root: str, model: str | None = None) -> list[tuple[str, dict]]:
    store, _ = _store_module()
    if store is None or not os.path.isdir(root):
        return []
    out = []
    for ns_dir, ns in store.open_namespaces(root):
        if model is None or ns.get("model") == model:
            out.append((ns_dir, ns))
    return sorted(out)


def _namespace_stats(ns_dir: str, ns: dict, capacity: int | None, store) -> dict:
    blocks = size = 0
    oldest = newest = None
    st = store.store_for_dir(ns_dir, scan=False, capacity_bytes=capacity)
    for _, nbytes, mtime in st.scan():
        blocks += 1
        size += nbytes
        oldest = mtime if oldest is None else min(oldest, mtime)
        newest = mtime if newest is None else max(newest, mtime)
    return {
        "directory": ns_dir, "model": ns.get("model"), "dtype": ns.get("dtype"),
        "block_size": ns.get("block_size"), "num_layers": len(ns.get("layer_shapes") or []),
        "tp_rank": ns.get("tp_rank"), "tp_size": ns.get("tp_size"), "kv_layout": ns.get("kv_layout"),
        "file_bytes": st.file_bytes, "blocks": blocks, "bytes": size,
        "oldest_mtime": oldest, "newest_mtime": newest,
    }


def _collect(root: str, capacity: int | None) -> dict:
    store, why = _store_module()
    if store is None:
        return {"configured": True, "path": root, "capacity_bytes": capacity, "available": False,
                "reason": why}
    if not os.path.isdir(root):
        return {"configured": True, "path": root, "capacity_bytes": capacity, "available": False,
                "reason": f"{root} is not a directory on this gateway's host"}
    namespaces = [_namespace_stats(d, ns, capacity, store) for d, ns in _namespaces(root)]
    used = sum(n["bytes"] for n in namespaces)
    # Each namespace's GC keeps it under capacity (evicting down to the low watermark, LRU by mtime).
    gc = {"capacity_bytes": capacity, "used_bytes": used,
          "over_capacity": [n["directory"] for n in namespaces
                            if capacity is not None and n["bytes"] > capacity],
          "fill": (max((n["bytes"] for n in namespaces), default=0) / capacity) if capacity else None}
    return {"configured": True, "path": root, "capacity_bytes": capacity, "available": True,
            "blocks": sum(n["blocks"] for n in namespaces), "bytes": used, "namespaces": namespaces, "gc": gc}


@router.get("", response_model=schemas.G4Stats, summary="G4 store namespaces, blocks, bytes and GC state")
async def g4_stats(request: Request) -> schemas.G4Stats:
    state = kv_state(request)
    cfg = state.settings.g4
    if not cfg.path:
        return schemas.G4Stats(configured=False, reason="no G4 store is configured (g4.path)")
    return schemas.G4Stats(**await asyncio.to_thread(_collect, cfg.path, cfg.capacity_bytes))


def _file_metadata(root: str, model: str, h: int) -> dict | None:
    store, _ = _store_module()
    if store is None:
        return None
    for ns_dir, ns in _namespaces(root, model):
        st = store.store_for_dir(ns_dir, scan=False)
        path = st.path(h)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            continue
        try:
            header = st.header(h)
        except (OSError, ValueError) as exc:
            header = {"error": f"unreadable header: {exc}"}
        header.pop("token_ids", None)
        if isinstance(header.get("magic"), bytes):
            header["magic"] = header["magic"].decode("latin-1")
        return {"path": path, "size_bytes": info.st_size, "mtime": info.st_mtime, "namespace": ns_dir,
                **header}
    return None


async def g4_file_metadata(state, model: str, h: int) -> dict | None:
    """The block's G4 file (path, size, mtime, header) when a store is configured and holds it."""
    root = state.settings.g4.path
    if not root:
        return None
    try:
        return await asyncio.to_thread(_file_metadata, root, model, h)
    except Exception as exc:  # a damaged store must not break the blocks endpoint
        log.warning("admin: reading G4 metadata of %016x failed: %s", h, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _maintenance(state):
    """(root, cache_tier.inventory) or a clear 409 saying why G4 maintenance cannot run here. The root is
    checked in a thread: on a hung shared mount a stat blocks, and on the loop it stalled every request."""
    root = state.settings.g4.path
    if not root:
        raise APIError(409, "no G4 store is configured (g4.path)", code="g4_not_configured")
    try:
        from cache_tier import inventory
    except ImportError as exc:
        raise APIError(409, f"the G4 store module is unavailable on this gateway: {exc}",
                       code="g4_unavailable") from None
    if not await asyncio.to_thread(os.path.isdir, root):
        raise APIError(409, f"{root} is not a directory on this gateway's host", code="g4_unavailable")
    return root, inventory


async def _finish(coro, what: str):
    """A maintenance run whose index (Redis down, a timeout) or store (a failed mount) fails answers 503
    saying so, not a 500. A GC that removed files before the index failed leaves their entries in the
    index (a request planned on them recomputes those blocks)."""
    try:
        return await coro
    except Exception as exc:
        raise APIError(503, f"G4 {what} did not complete (the index or the G4 store is unavailable): "
                            f"{type(exc).__name__}: {exc}", code="g4_maintenance_failed") from None


@router.post("/{model:path}/rebuild", response_model=schemas.G4Maintenance,
             responses=error_responses(409, 503),
             summary="Record every block of the model found on G4 in the index (after an index loss)")
async def rebuild(model: str, request: Request) -> schemas.G4Maintenance:
    state = kv_state(request)
    root, inventory = await _maintenance(state)
    n = await _finish(inventory.rebuild_index(state.index, model, root), "rebuild")
    log.info("admin: G4 rebuild of %s: %d blocks", model, n)
    return schemas.G4Maintenance(model=model, blocks=n)


@router.post("/{model:path}/gc", response_model=schemas.G4Maintenance,
             responses=error_responses(400, 409, 503),
             summary="Run the G4 LRU GC for a model now and drop the evicted blocks from the index")
async def gc(model: str, request: Request,
             capacity_bytes: int | None = Query(None, ge=0, description="default: g4.capacity_bytes"),
             ) -> schemas.G4Maintenance:
    state = kv_state(request)
    root, inventory = await _maintenance(state)
    cap = capacity_bytes if capacity_bytes is not None else state.settings.g4.capacity_bytes
    if cap is None:
        raise APIError(400, "no capacity: pass capacity_bytes or configure g4.capacity_bytes",
                       param="capacity_bytes")
    evicted = await _finish(inventory.gc_store(state.index, model, root, cap), "GC")
    log.info("admin: G4 GC of %s to %d bytes: %d evicted", model, cap, len(evicted))
    return schemas.G4Maintenance(model=model, evicted=len(evicted), capacity_bytes=cap)
