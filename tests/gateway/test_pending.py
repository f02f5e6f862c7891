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


def test_a_deferred_prompts_text_is_kept_while_in_flight_and_bounded():
    """The text of a prompt recorded by its start only: :meth:`PendingBlocks.shares` answers, per worker,
    the longest start it shares with a new prompt of the same key; it settles, expires, is bounded by bytes
    and goes with its worker."""
    p = PendingBlocks(ttl_s=10.0, settle_s=1.0, max_text_bytes=3000)
    doc = b"d" * 900 + b"x" * 100
    t1, t2 = doc + b" first question", doc[:500] + b" other"
    key = (None, None, (1,))
    p.record("m", [1, 2], "a", now=0.0, text=(key, t1))
    p.record("m", [], "b", now=0.0, text=(key, t2))  # no new blocks: the text is still kept
    q = doc + b" second question"
    assert p.shares("m", key, q, now=1.0) == {"a": (1001, t1), "b": (500, t2)}
    assert p.shares("m", (None, "salt", (1,)), q, now=1.0) == {}  # another salt: other blocks
    assert p.shares("other-model", key, q, now=1.0) == {}
    assert p.text_bytes == len(t1) + len(t2)
    p.settle("m", [1, 2], "a", now=2.0, text=(key, t1))  # first token at 2 s: kept settle_s more
    p.settle("m", [], "a", now=2.0, text=(key, t2))  # t2 was sent to b, not a: b's copy stays
    assert set(p.shares("m", key, q, now=2.9)) == {"a", "b"}
    assert set(p.shares("m", key, q, now=3.1)) == {"b"}
    assert p.text_bytes == len(t2)
    assert p.shares("m", key, q, now=10.1) == {} and p.text_bytes == 0  # the TTL
    big = b"y" * 1600
    p.record("m", [], "a", now=20.0, text=(key, big))
    p.record("m", [], "b", now=20.0, text=(key, b"y" * 1599))  # 3199 > 3000: the oldest goes
    assert p.text_bytes == 1599 and set(p.shares("m", key, big, now=20.0)) == {"b"}
    p.record("m", [], "a", now=20.0, text=(key, b"z" * 3001))  # larger than the bound: not kept
    assert p.text_bytes == 1599
    p.forget_worker("b")
    assert p.text_bytes == 0 and p.shares("m", key, big, now=20.0) == {}
    off = PendingBlocks(ttl_s=0)
    off.record("m", [], "a", text=(key, t1))
    assert off.shares("m", key, q) == {}


async def test_a_second_question_over_a_document_in_flight_is_predicted_as_delivered(fleet, start_gateway):
    """Two questions over one long new document, the second sent while the first is still being prefilled
    (the fake workers take 1.5 s to a first token and announce nothing). The first prompt's tail was
    deferred (nobody held it), so its record covers only its start; the gateway keeps its text, and the
    second goes to the same worker with the cached tokens it predicts equal to what the worker reports."""
    import asyncio

    from tests.gateway.test_tokenize import _document

    for name in ("a", "b"):
        fleet.add(name, first_token_delay_s=1.5)
    gw = start_gateway(fleet, pending=True)
    doc = _document(5, 8_000)
    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.create_task(c.post(gw.url + "/v1/completions", headers={"x-request-id": "q1"}, json={
            "model": "tiny", "prompt": doc + "\nQuestion: what is kept?", "max_tokens": 4}))
        await asyncio.sleep(0.5)
        r2 = await c.post(gw.url + "/v1/completions", json={
            "model": "tiny", "prompt": doc + "\nQuestion: which tier?", "max_tokens": 4})
        r1 = await first
    assert r1.status_code == r2.status_code == 200
    d1 = gw.state.decisions.get("q1")
    assert d1.new_bytes < len(doc) / 2  # the first prompt was deferred: its start only was encoded
    delivered = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r2.headers["x-kvgate-worker"] == r1.headers["x-kvgate-worker"]
    assert delivered > len(doc) / 8 and int(r2.headers["x-kvgate-cached-tokens"]) == delivered


async def test_a_worker_that_failed_the_prompt_is_not_credited_with_it(fleet, start_gateway):
    """The gateway records a prompt as sent before the worker answers (a non-streaming answer comes only
    when it is done). A worker that answered 500 computed nothing: the retry's worker holds the prompt and
    the follow-up goes there, predicted as delivered; the failed one is not credited."""
    bad = fleet.add("a", mode="error500")
    fleet.add("b")
    gw = start_gateway(fleet, pending=True)
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(4):  # ties rotate: one of these tries "a" first
            body = chat_body(f"{i} " + LONG)
            r1 = await c.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": f"r{i}"})
            assert r1.status_code == 200 and r1.headers["x-kvgate-worker"] == "b"
            if gw.state.decisions.get(f"r{i}").attempts == ["a", "b"]:
                break
        else:
            raise AssertionError("no request tried the failing worker first")
        bad.mode = "ok"
        follow = dict(body, messages=body["messages"] + [
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and one more question"}])
        r2 = await c.post(gw.url + "/v1/chat/completions", json=follow, headers={"x-request-id": "f"})
        seen = (await c.get(gw.url + "/admin/decisions/f")).json()
    assert r2.status_code == 200 and r2.headers["x-kvgate-worker"] == "b"
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(r2.headers["x-kvgate-cached-tokens"]) == cached
    assert {c["worker"]: c["cached_tokens"] for c in seen["candidates"]} == {"a": 0, "b": cached}
