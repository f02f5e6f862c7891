"""A follow-up turn sent before the first turn's KV events reach the index still goes to the worker that
has the prefix (router/pending.py). The fake workers here publish no KV events at all, so only the
gateway's own record of what it forwarded can put the second request on the same worker."""
from __future__ import annotations

import httpx

from router.pending import PendingBlocks
from tests.gateway.test_proxy import LONG, chat_body


def test_pending_blocks_leading_run_ttl_and_bounds():
    p = PendingBlocks(ttl_s=10.0, max_entries=5)
    p.record("m", [1, 2, 3], "a", now=0.0)
    assert p.leading("m", [1, 2, 3, 4], now=1.0) == ("a", 3)
    assert p.leading("other-model", [1, 2, 3], now=1.0) == (None, 0)
    assert p.leading("m", [1, 2, 3], now=11.0) == (None, 0)  # expired
    p.record("m", [1, 2], "b", now=2.0)  # the latest forward wins
    assert p.leading("m", [1, 2, 3], now=3.0) == ("b", 2)
    p.record("m", [7, 8, 9], "c", now=3.0)  # 6 entries > 5: the oldest goes
    assert len(p) == 5
    p.forget_worker("c")
    assert p.leading("m", [7, 8], now=4.0) == (None, 0)
    off = PendingBlocks(ttl_s=0)
    off.record("m", [1], "a")
    assert off.leading("m", [1]) == (None, 0)


async def _route_twice(gw) -> tuple[str, str, int]:
    first = chat_body(LONG)
    follow = chat_body(LONG)
    follow["messages"] = first["messages"] + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and one more question"}]
    async with httpx.AsyncClient(timeout=30) as c:
        r1 = await c.post(gw.url + "/v1/chat/completions", json=first)
        r2 = await c.post(gw.url + "/v1/chat/completions", json=follow)
    assert r1.status_code == r2.status_code == 200
    assert int(r1.headers["x-kvgate-cached-tokens"]) == 0
    return r1.headers["x-kvgate-worker"], r2.headers["x-kvgate-worker"], int(r2.headers["x-kvgate-cached-tokens"])


async def test_follow_up_goes_where_the_prefix_was_sent(fleet, start_gateway):
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet)
    w1, w2, cached = await _route_twice(gw)
    assert w2 == w1 and cached > 0


async def test_without_pending_blocks_ties_rotate(fleet, start_gateway):
    """The same two requests with the record turned off: nothing is indexed, so the tie rotates to the
    other worker (this is what the record fixes)."""
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet)
    gw.state.pending.ttl_s = 0
    w1, w2, cached = await _route_twice(gw)
    assert w2 != w1 and cached == 0
