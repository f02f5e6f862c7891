"""Small helpers the admin routers share: reaching the gateway state, 404s, defensive reads."""
from __future__ import annotations

import logging
from typing import NoReturn

from fastapi import Request

from router.errors import APIError

log = logging.getLogger("kvgate.admin")


def kv_state(request: Request):
    return request.app.state.kv


def not_found(message: str, param: str | None = None) -> NoReturn:
    raise APIError(404, message, param=param, code="not_found")


async def index_stats(state, model: str | None = None) -> dict:
    """The index's per-model stats; an unreachable index answers 503, never a 500."""
    try:
        return await state.index.stats(model) or {}
    except Exception as exc:  # Redis down, timeouts: the operator must see why
        log.warning("admin: index stats failed: %s", exc)
        raise APIError(503, f"the index is unavailable: {type(exc).__name__}: {exc}",
                       code="index_unavailable") from None


def ingestor_statuses(state) -> dict[str, dict]:
    ing = getattr(state, "ingestor", None)
    if ing is None:
        return {}
    try:
        return dict(ing.statuses())
    except Exception as exc:  # a status read must not break the admin API
        log.warning("admin: ingestor statuses failed: %s", exc)
        return {}


async def index_stats_or_error(state) -> tuple[dict, str | None]:
    """Stats for views that stay useful without the index (the worker list): ({}, reason) on failure."""
    try:
        return await state.index.stats() or {}, None
    except Exception as exc:
        log.warning("admin: index stats failed: %s", exc)
        return {}, f"the index is unavailable: {type(exc).__name__}: {exc}"
