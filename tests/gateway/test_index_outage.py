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


async def test_one_request_meets_an_index_outage_once(fleet, start_gateway):
    """A long new prompt is encoded in stages, each probing the index for how far a cached prefix reaches.
    With the index down the probe's failure left nothing to reuse, and the plan looked up again: two
    lookup timeouts of latency, two degraded requests counted and two breaker failures for one request."""
    from tests.gateway.conftest import MODEL

    fleet.add("a")
    gw = start_gateway(fleet)
    calls = []

    async def down(*a, **kw):
        calls.append(1)
        raise ConnectionError("redis down")

    gw.state.index.lookup = down
    doc = " ".join(f"section {i} of the operations manual covers topic {i * 7} in depth" for i in range(400))
    d = gw.call(gw.state.router.plan(MODEL, {"model": MODEL, "prompt": doc + " Q?"}, {}, "/v1/completions"))
    assert d.index_error
    assert (len(calls), gw.state.index_guard.degraded, gw.state.index_guard.breaker.count) == (1, 1, 1)
