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
    assert p.leading("m", [1, 2, 3, 4], "a", now=1.0) == 3
    assert p.leading("m", [1, 2, 3, 4], "b", now=1.0) == 0  # sent to a, not b
    assert p.leading("other-model", [1, 2, 3], "a", now=1.0) == 0
    assert p.leading("m", [1, 2, 3], "a", now=11.0) == 0  # expired
    p.record("m", [1, 2], "b", now=2.0)  # both were sent the prefix: both hold it
    assert p.leading("m", [1, 2, 3], "b", now=3.0) == 2
    assert p.leading("m", [1, 2, 3], "a", now=3.0) == 3
    p.record("m", [7, 8, 9], "c", now=3.0)  # 8 entries > 5: the oldest go (a's, then b's first)
    assert len(p) == 5
    assert p.leading("m", [7, 8, 9], "c", now=4.0) == 3
    assert p.leading("m", [1, 2, 3], "a", now=4.0) == 0
    p.forget_worker("c")
    assert p.leading("m", [7, 8], "c", now=4.0) == 0
    off = PendingBlocks(ttl_s=0)
    off.record("m", [1], "a")
    assert off.leading("m", [1], "a") == 0


def test_pending_records_only_new_blocks_and_extends_the_index_run():
    """A forward records the blocks past what the worker was known to hold; a lookup continues the index's
    run with them, and any live entry proves the run before it (hashes are chained)."""
    p = PendingBlocks(ttl_s=10.0)
    prompt = list(range(100, 140))
    p.record("m", prompt, "a", start=30, now=0.0)
    assert len(p) == 10
    assert p.leading("m", prompt, "a", start=30, now=1.0) == 40
    assert p.leading("m", prompt, "a", start=10, now=1.0) == 10  # the index run ends before what was sent
    follow = prompt[:35] + [999, 998]  # diverges after block 35
    assert p.leading("m", follow, "a", start=30, now=1.0) == 35


def test_a_computed_prompt_leaves_the_record_soon_after_its_first_token():
    """Once the worker has computed the prompt (its first token came) its events follow, and the index,
    which also sees the blocks evicted, is the truth: the record no longer claims them after settle_s."""
    p = PendingBlocks(ttl_s=30.0, settle_s=2.0)
    prompt = list(range(100, 140))
    p.record("m", prompt, "a", start=10, now=0.0)
    p.settle("m", prompt, "a", start=10, now=5.0)  # first token at 5 s
    assert p.leading("m", prompt, "a", start=10, now=6.9) == 40
    assert p.leading("m", prompt, "a", start=10, now=7.1) == 10  # evicted since? the index says
    p.record("m", prompt, "b", start=0, now=0.0)
    p.settle("m", prompt[:20], "b", now=1.0)  # another prompt's first token settles only its own blocks
    assert p.leading("m", prompt, "b", now=4.0) == 0  # block 0 settled: nothing proves the run
    p.settle("m", [1, 2], "c", now=1.0)  # nothing recorded there: nothing to do


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
    gw = start_gateway(fleet, pending=True)
    w1, w2, cached = await _route_twice(gw)
    assert w2 == w1 and cached > 0


async def test_the_record_ends_soon_after_the_prompt_was_computed(fleet, start_gateway):
    """The same two requests, the follow-up sent after the first answer's record settled (settle_s after
    its first token): the fake worker announced nothing, so the gateway no longer claims the prefix
    there (on real vLLM the index would hold it, or know it was evicted)."""
    import asyncio

    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet, pending=True, routing={"pending_settle_s": 0.3})
    first = chat_body(LONG)
    async with httpx.AsyncClient(timeout=30) as c:
        r1 = await c.post(gw.url + "/v1/chat/completions", json=first)
        await asyncio.sleep(0.6)
        r2 = await c.post(gw.url + "/v1/chat/completions", json=first)
    assert r1.status_code == r2.status_code == 200
    assert int(r2.headers["x-kvgate-cached-tokens"]) == 0 and r2.headers["x-kvgate-worker"] != r1.headers["x-kvgate-worker"]


async def test_without_pending_blocks_ties_rotate(fleet, start_gateway):
    """The same two requests with the record turned off: nothing is indexed, so the tie rotates to the
    other worker (this is what the record fixes)."""
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet, pending=False)
    w1, w2, cached = await _route_twice(gw)
    assert w2 != w1 and cached == 0
