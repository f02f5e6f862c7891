"""``/admin/index``: per-model index statistics, and flushing one worker's or one model's entries."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Query, Request

from indexer.events.state import entries_per_tier
from indexer.index.base import LeaseLost, Tier
from router.admin import schemas
from router.admin.common import index_stats, ingestor_statuses, kv_state, not_found
from router.errors import APIError, error_responses
from router.worker import index_names

log = logging.getLogger("kvgate.admin")
router = APIRouter(prefix="/index", tags=["admin: index"])


def _model_stats(state, model: str, st: dict, events: dict) -> schemas.ModelIndexStats:
    applied = dropped = replays = 0
    for w in state.registry.workers():
        if w.base_model() == model or model in w.models:
            for name in index_names(w):  # the server's stream, or each rank's
                ev = events.get(name) or {}
                applied += int(ev.get("applied", 0) or 0)
                dropped += int(ev.get("dropped", 0) or 0)
                replays += int(ev.get("replays", 0) or 0)
    return schemas.ModelIndexStats(
        model=model, blocks=int(st.get("blocks", 0)), entries_per_tier=entries_per_tier(st),
        g4_blocks=int(st.get("g4_blocks", 0)), workers=st.get("workers") or {},
        redis_used_memory=st.get("redis_used_memory"), events_applied=applied, events_dropped=dropped,
        events_replays=replays,
    )


def _known_models(state, stats: dict) -> list[str]:
    names = set(stats)
    for w in state.registry.workers():
        if w.base_model():
            names.add(w.base_model())
    return sorted(names)


@router.get("", response_model=schemas.IndexStats,
            responses=error_responses(503), summary="Index statistics for every model")
async def all_stats(request: Request) -> schemas.IndexStats:
    state = kv_state(request)
    stats, events = await index_stats(state), ingestor_statuses(state)
    return schemas.IndexStats(
        backend=getattr(state.index, "name", type(state.index).__name__),
        models=[_model_stats(state, m, stats.get(m) or {}, events) for m in _known_models(state, stats)],
    )


@router.get("/{model:path}/stats", response_model=schemas.ModelIndexStats,
            responses=error_responses(404, 503), summary="One model's statistics")
async def model_stats(model: str, request: Request) -> schemas.ModelIndexStats:
    state = kv_state(request)
    stats = await index_stats(state, model)
    if model not in stats and model not in _known_models(state, {}):
        not_found(f"the index knows no model {model!r}", "model")
    return _model_stats(state, model, stats.get(model) or {}, ingestor_statuses(state))


@router.delete("/{model:path}/workers/{worker}", response_model=schemas.Flushed,
               responses=error_responses(409, 503),
               summary="Drop one worker's entries for a model (all tiers, or ?tier=GPU|CPU)")
async def flush_worker(model: str, worker: str, request: Request,
                       tier: Tier | None = Query(None, description="only this tier")) -> schemas.Flushed:
    state = kv_state(request)
    removed = await _guard(state.index.clear_worker(model, worker, tier))
    log.info("admin: flushed %d entries of worker %s for %s", removed, worker, model)
    return schemas.Flushed(model=model, worker=worker, removed=int(removed))


@router.delete("/{model:path}", response_model=schemas.Flushed,
               responses=error_responses(409, 503), summary="Drop every entry of a model, G4 too")
async def flush_model(model: str, request: Request) -> schemas.Flushed:
    state = kv_state(request)
    removed = await _guard(state.index.clear_model(model))
    log.info("admin: flushed %d entries of model %s", removed, model)
    return schemas.Flushed(model=model, removed=int(removed))


async def _guard(coro):
    try:
        return await coro
    except LeaseLost as exc:  # another gateway writes this worker's entries: its state would push them back
        raise APIError(409, f"another gateway holds this worker's lease and writes its entries ({exc}); flush "
                            "it there", code="worker_lease_held") from None
    except Exception as exc:
        raise APIError(503, f"the index is unavailable: {type(exc).__name__}: {exc}",
                       code="index_unavailable") from None
