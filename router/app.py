"""The FastAPI application factory. Everything the app needs lives on ``app.state.kv``
(:class:`router.state.GatewayState`), started and stopped by the lifespan."""
from __future__ import annotations

import contextlib

from fastapi import FastAPI

from router.admin import install as install_admin
from router.config import Settings
from router.errors import install_handlers
from router.proxy import DataPlane, build_router
from router.state import GatewayState


def create_app(settings: Settings | None = None, *, index=None, prefetcher=None, ingestor=None,
               with_events: bool = True) -> FastAPI:
    """A gateway app. ``index`` overrides the configured backend (tests pass a MemoryIndex or RedisIndex);
    ``with_events=False`` runs without KV event ingestion."""
    settings = settings or Settings()
    state = GatewayState(settings, index=index, prefetcher=prefetcher, ingestor=ingestor,
                         with_events=with_events)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvgate", version="0.1.0", lifespan=lifespan,
                  description="KV-cache-aware OpenAI-compatible gateway for vLLM fleets")
    app.state.kv = state
    install_handlers(app)
    app.include_router(build_router())
    install_admin(app)
    app.add_middleware(DataPlane, dp=state.datapath)
    return app
