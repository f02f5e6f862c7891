"""``/admin/workers``: list the fleet with health, load, events and cached blocks; add, remove, drain."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from router.admin import schemas
from router.admin.common import index_stats_or_error, ingestor_statuses, kv_state, not_found
from router.config import WorkerConfig
from router.errors import APIError, error_responses
from indexer.events.state import local_g4_member
from router.registry import DuplicateWorker
from router.worker import index_names

log = logging.getLogger("kvgate.admin")
router = APIRouter(prefix="/workers", tags=["admin: workers"])


def worker_out(state, w, stats: dict, events: dict) -> schemas.WorkerOut:
    """One worker as the admin API shows it; ``stats`` is the index's per-model stats, ``events`` the
    ingestor's statuses (both fetched once per call, not once per worker)."""
    cached: dict[str, int] = {}
    for model in {w.base_model(), *w.models} - {None}:
        for name in index_names(w) if w.dp_rank is None else [w.name]:  # a server adds up its ranks
            per_worker = (stats.get(model) or {}).get("workers", {})
            for tier, n in (per_worker.get(name) or {}).items():
                cached[tier] = cached.get(tier, 0) + int(n)
            local = sum(int(n) for n in (per_worker.get(local_g4_member(name)) or {}).values())
            if local:
                cached["G4_LOCAL"] = cached.get("G4_LOCAL", 0) + local
    ev = events.get(w.name)
    parity = getattr(w, "parity", None)
    view = w.view()
    return schemas.WorkerOut(
        name=w.name, url=w.url, healthy=w.healthy, draining=w.draining, model=w.base_model(),
        models=sorted(w.models), block_size=w.block_size,
        events=schemas.EventsStatus(**ev) if isinstance(ev, dict) else None,
        load=schemas.WorkerLoadOut(
            running=w.load.running, waiting=w.load.waiting, kv_usage=w.load.kv_usage,
            kv_usage_known=w.load.usage_known, rejected_samples=w.metrics_rejected, inflight=w.inflight,
            pending_tokens=round(view.prefill_work), prefill_tokens_per_s=state.router.cost.prefill_speed(w),
            prefill_ratio=w.prefill_ratio, prefill_samples=w.prefill_samples, ttft_samples=w.ttft_samples,
            pending_requests=view.prefill_requests, gated_requests=view.gated_requests, decodes=view.decodes,
            engine=w.engine.to_dict(),
            prediction=w.prediction.to_dict(), eviction=w.eviction.to_dict(), ttft_fit=w.ttft_fit.to_dict()),
        cached_blocks=cached, parity=parity if isinstance(parity, dict) else None,
        cache_blind=bool(getattr(w, "cache_blind", False)),
        chat_cache_blind=bool(getattr(w, "chat_cache_blind", False)),
        restarts=w.restarts, last_error=w.last_error, dp_rank=w.dp_rank,
        ranks=[worker_out(state, t, stats, events) for t in w.ranks] if w.dp_rank is None else [],
        skipped_sources=list(w.skipped_sources) if w.dp_rank is None else [],
        prefetch_url=w.prefetch_url, g4_tier=w.g4_tier,
    )


@router.get("", response_model=schemas.WorkerList, summary="Every worker with health, load, events, cache")
async def list_workers(request: Request) -> schemas.WorkerList:
    state = kv_state(request)
    (stats, error), events = await index_stats_or_error(state), ingestor_statuses(state)
    return schemas.WorkerList(workers=[worker_out(state, w, stats, events)
                                       for w in sorted(state.registry.workers(), key=lambda w: w.name)],
                              index_error=error)


@router.get("/{name}", response_model=schemas.WorkerOut, responses=error_responses(404), summary="One worker")
async def get_worker(name: str, request: Request) -> schemas.WorkerOut:
    state = kv_state(request)
    w = state.registry.get(name) or not_found(f"no worker named {name!r}", "name")
    return worker_out(state, w, (await index_stats_or_error(state))[0], ingestor_statuses(state))


@router.post("", response_model=schemas.WorkerOut, status_code=201, responses=error_responses(400, 409),
             summary="Add a worker at run time (probed at once; routable when healthy)")
async def add_worker(spec: schemas.AddWorker, request: Request) -> schemas.WorkerOut:
    state = kv_state(request)
    cfg = WorkerConfig(**spec.model_dump())
    try:
        w = await state.registry.add(cfg)
    except DuplicateWorker as exc:  # the same name, or the same server under another name
        raise APIError(409, str(exc), param=exc.param, code="worker_exists") from None
    log.info("admin: added worker %s (%s)", w.name, w.url)
    return worker_out(state, w, (await index_stats_or_error(state))[0], ingestor_statuses(state))


@router.delete("/{name}", response_model=schemas.WorkerRemoved, responses=error_responses(404),
               summary="Remove a worker: stop routing to it, unsubscribe its events, drop its index entries")
async def remove_worker(name: str, request: Request) -> schemas.WorkerRemoved:
    state = kv_state(request)
    try:
        await state.registry.remove(name)
    except KeyError:
        not_found(f"no worker named {name!r}", "name")
    log.info("admin: removed worker %s", name)
    return schemas.WorkerRemoved(removed=name)


@router.post("/{name}/drain", response_model=schemas.WorkerOut, responses=error_responses(404),
             summary="Drain a worker: no new requests, in-flight ones finish")
async def drain_worker(name: str, request: Request) -> schemas.WorkerOut:
    return await _set_draining(request, name, True)


@router.post("/{name}/parity", response_model=schemas.ParityOut, responses=error_responses(404, 409),
             summary="Run the parity check now (router/parity.py: one probe request to the worker); "
                     "answers within health_timeout_s, at once with no-events for a worker without KV events")
async def parity(name: str, request: Request) -> schemas.ParityOut:
    state = kv_state(request)
    w = state.registry.get(name) or not_found(f"no worker named {name!r}", "name")
    model = w.base_model()
    if model is None:
        raise APIError(409, f"worker {name} serves no model yet", param="name", code="worker_not_ready")
    target = w.probe_target()  # one rank of a data-parallel server, pinned
    result = await state.parity.check(target.name, w.url, model, timeout_s=state.settings.health_timeout_s,
                                      headers=target.pin({}))
    w.parity = result.to_dict()  # as the registration-time check records it
    log.info("admin: parity of %s: %s", name, result.status)
    return schemas.ParityOut(**w.parity)


@router.post("/{name}/undrain", response_model=schemas.WorkerOut,
             responses=error_responses(404), summary="Route to a drained worker again")
async def undrain_worker(name: str, request: Request) -> schemas.WorkerOut:
    return await _set_draining(request, name, False)


async def _set_draining(request: Request, name: str, draining: bool) -> schemas.WorkerOut:
    state = kv_state(request)
    try:
        w = await state.registry.drain(name, draining)
    except KeyError:
        not_found(f"no worker named {name!r}", "name")
    log.info("admin: worker %s draining=%s", name, draining)
    return worker_out(state, w, (await index_stats_or_error(state))[0], ingestor_statuses(state))
