"""The admin REST API under ``/admin``: one router per area, all behind :func:`require_admin`.

``router.app`` includes :func:`admin_router` once; every route declares a pydantic response model, so the
app's OpenAPI document (``/openapi.json``) describes the whole admin surface.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends

from router.admin.auth import require_admin
from router.errors import error_responses


def admin_router() -> APIRouter:
    from router.admin import blocks, decisions, explain, g4, index, workers

    # every admin route: a missing or wrong token (401), no token configured and a remote client (403)
    root = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)],
                     responses=error_responses(401, 403))
    for area in (workers, index, explain, blocks, decisions, g4):
        root.include_router(area.router)
    return root


def install(app) -> None:
    """Mount the admin API on a gateway app (``router.app.create_app`` calls this) and add its gauges
    (draining, events connected) to the gateway's metrics registry."""
    from router.admin.metrics import AdminCollector

    app.include_router(admin_router())
    state = getattr(app.state, "kv", None)
    metrics = getattr(state, "metrics", None)
    if metrics is not None:
        metrics.registry.register(AdminCollector(state))
