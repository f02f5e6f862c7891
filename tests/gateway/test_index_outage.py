"""A slow or absent index never fails a request: it is routed load-aware and cache-blind, counted in
kvgate_routing_degraded_total, and cache-aware again once the index answers (real redis-server; CLIENT
PAUSE makes it slow on demand)."""
from __future__ import annotations

import asyncio

import httpx
import redis.asyncio as aioredis

from router.config import IndexConfig
from tests.gateway.test_proxy import chat_body


async def test_paused_redis_degrades_routing_without_failing_requests(fleet, start_gateway, redis_url):
    fleet.add("a")
    fleet.add("b")
    # The breaker stays open briefly, so the test recovers fast.
    gw = start_gateway(fleet, index=IndexConfig(backend="redis", redis_url=redis_url, breaker_open_s=0.3))
    admin = aioredis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "ok"})
            assert r.status_code == 200 and gw.state.decisions.get("ok").index_error is None
            await admin.execute_command("CLIENT", "PAUSE", 2000, "ALL")
            for i in range(5):
                r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(),
                                 headers={"x-request-id": f"d{i}"})
                assert r.status_code == 200
                assert gw.state.decisions.get(f"d{i}").index_error
            metrics = (await c.get(gw.url + "/metrics")).text
            assert 'kvgate_routing_degraded_total{reason="timeout"}' in metrics
            assert 'kvgate_routing_degraded_total{reason="breaker_open"}' in metrics
            await admin.execute_command("CLIENT", "UNPAUSE")
            await asyncio.sleep(0.4)
            r = await c.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "back"})
            assert r.status_code == 200 and gw.state.decisions.get("back").index_error is None
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
