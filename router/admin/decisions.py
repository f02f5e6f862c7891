"""``/admin/decisions``: the last N routing decisions (bounded ring), prediction beside delivery."""
from __future__ import annotations

from fastapi import APIRouter, Query, Request

from router.admin import schemas
from router.admin.common import kv_state, not_found
from router.errors import error_responses

router = APIRouter(prefix="/decisions", tags=["admin: decisions"])


@router.get("", response_model=schemas.DecisionList, summary="The latest routing decisions, newest first")
async def recent(request: Request,
                 limit: int = Query(50, ge=1, le=100_000, description="at most this many"),
                 model: str | None = Query(None, description="only this model")) -> schemas.DecisionList:
    state = kv_state(request)
    log = state.decisions
    items = log.recent()
    if model is not None:
        items = [d for d in items if d.model == model]
    items = items[:limit]
    return schemas.DecisionList(count=len(items), capacity=state.settings.routing.decisions_kept,
                                decisions=[schemas.DecisionOut(**d.to_dict()) for d in items])


@router.get("/{request_id}", response_model=schemas.DecisionOut,
            responses=error_responses(404), summary="One decision by request id")
async def one(request_id: str, request: Request) -> schemas.DecisionOut:
    d = kv_state(request).decisions.get(request_id) or not_found(
        f"no recent decision for request {request_id!r}", "request_id")
    return schemas.DecisionOut(**d.to_dict())
