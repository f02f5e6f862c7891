"""The prefill gate (router/admission.py): the gateway keeps a worker's queue one step of prompt tokens
deep and sends the shortest held prompt first. Unit tests on the gate and the load tracker (no servers),
then the order a fake vLLM worker (tests/support/fake_worker.py: it holds each stream's first token for a
set time, as a prefill would) receives requests in through a real gateway."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from router.admission import PrefillGate, gate_budget, gate_orders
from router.config import RoutingConfig
from router.load import ActiveSequences
from tests.gateway.conftest import MODEL
from tests.gateway.test_proxy import wait_until


async def held(gate: PrefillGate, n: int) -> None:
    for _ in range(100):
        if len(gate) == n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{len(gate)} held, expected {n}")


def test_the_budget_is_one_step_unless_set():
    assert gate_budget(RoutingConfig(), 2048) == 2048
    assert gate_budget(RoutingConfig(prefill_gate_tokens=700), 2048) == 700
    assert gate_budget(RoutingConfig(prefill_gate_tokens=5000), 2048) == 2048  # never past one step


def test_the_gate_holds_only_where_a_steps_prefill_ends_within_its_wait():
    assert gate_orders(2048, 1500.0, 5.0)  # 1.4 s: the AMX CPU servers of sessions 22-27
    assert not gate_orders(2048, 134.0, 5.0)  # 15 s: session 28's AVX2 host, where the gate cost kv its lead
    assert gate_orders(2048, 134.0, 30.0)  # a longer wait keeps it
    assert not gate_orders(2048, 0.0, 5.0)


async def test_a_worker_prefilling_nothing_admits_at_once_and_a_full_step_holds():
    a, g = ActiveSequences(), PrefillGate()
    first = a.add(uncached=3000, work=3000.0, predicted_s=1.0, streamed=True)
    assert await g.admit(a, first, budget=2048, max_wait_s=5.0) == 0.0  # nothing prefilling: any size goes
    small = a.add(uncached=10, work=10.0, predicted_s=0.1, streamed=True)
    task = asyncio.create_task(g.admit(a, small, budget=2048, max_wait_s=5.0))
    await held(g, 1)
    assert small.gated and a.view().prefill_requests == 2  # held, and priced as queue ahead of later ones
    a.first_token(first)
    g.wake()
    assert await asyncio.wait_for(task, 1.0) > 0.0
    assert not small.gated and len(g) == 0


async def test_the_shortest_held_prompt_goes_first_and_prompts_that_fit_the_budget_go_together():
    a, g = ActiveSequences(), PrefillGate()
    running = a.add(uncached=900, work=900.0, predicted_s=1.0, streamed=True)
    await g.admit(a, running, 1000, 5.0)
    order: list[str] = []
    seqs = {}

    async def client(name: str, uncached: int):
        seqs[name] = seq = a.add(uncached=uncached, work=float(uncached), predicted_s=1.0, streamed=True)
        await g.admit(a, seq, 1000, 5.0)
        order.append(name)

    long = asyncio.create_task(client("long", 950))
    await held(g, 1)  # 900 + 950 > 1000
    short = asyncio.create_task(client("short", 50))
    await asyncio.wait_for(short, 1.0)  # 900 + 50 fit, and nothing shorter waits: it goes at once
    mid = asyncio.create_task(client("mid", 120))
    await held(g, 2)  # 900 + 50 + 120 > 1000
    a.first_token(running)
    g.wake()
    await asyncio.wait_for(mid, 1.0)  # 50 + 120 fit; the long one sent before it does not (50 + 120 + 950)
    assert order == ["short", "mid"] and len(g) == 1
    a.first_token(seqs["short"])
    g.wake()
    await asyncio.sleep(0.01)
    assert order == ["short", "mid"]  # 120 + 950 > 1000: still held
    a.finish(seqs["mid"])
    g.wake()
    await asyncio.wait_for(long, 1.0)
    assert order == ["short", "mid", "long"]


async def test_a_held_request_goes_after_max_wait_and_a_cancelled_one_leaves_the_queue():
    a, g = ActiveSequences(), PrefillGate()
    await g.admit(a, a.add(uncached=5000, work=5000.0, predicted_s=9.0, streamed=True), 100, 5.0)
    late = a.add(uncached=200, work=200.0, predicted_s=1.0, streamed=True)
    added = late.sent_at
    waited = await asyncio.wait_for(g.admit(a, late, 100, max_wait_s=0.05), 1.0)  # not a rate limit
    assert waited >= 0.05 and not late.gated and len(g) == 0
    assert late.sent_at == pytest.approx(added + waited)  # it reached the worker after its wait (router/cost.py)
    gone = a.add(uncached=200, work=200.0, predicted_s=1.0, streamed=True)
    task = asyncio.create_task(g.admit(a, gone, 100, 5.0))
    await held(g, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(g) == 0 and not gone.gated


async def test_a_response_without_a_first_token_stops_blocking_at_its_deadline():
    """A non-streamed response shows no first token: it counts as prefilling until twice its predicted
    TTFT (router/load.py), and the gate wakes then by itself."""
    a, g = ActiveSequences(), PrefillGate()
    plain = a.add(uncached=3000, work=3000.0, predicted_s=0.05, streamed=False)
    await g.admit(a, plain, 2048, 5.0)
    nxt = a.add(uncached=3000, work=3000.0, predicted_s=0.05, streamed=True)
    waited = await asyncio.wait_for(g.admit(a, nxt, 2048, 5.0), 2.0)
    assert 0.05 < waited < 1.0


async def _one_sent_one_held(a: ActiveSequences, g: PrefillGate, first: int, second: int):
    """A request of ``first`` uncached tokens sent (a step's budget of 2,048), then one of ``second`` held
    behind it: both sequences and the held one's admission task."""
    sent = a.add(uncached=first, work=float(first), predicted_s=1.0, streamed=True)
    await g.admit(a, sent, 2048, 5.0)
    later = a.add(uncached=second, work=float(second), predicted_s=1.0, streamed=True)
    task = asyncio.create_task(g.admit(a, later, 2048, 5.0))
    await held(g, 1)
    return sent, later, task


async def test_held_requests_are_not_taken_for_ones_vllm_runs():
    """vLLM's waiting gauge counts only what was sent: a held request is neither admitted at a scrape (its
    KV is not in the usage) nor taken for a running prefill."""
    a, g = ActiveSequences(), PrefillGate()
    sent, later, task = await _one_sent_one_held(a, g, 3000, 500)
    a.mark_scrape(waiting=0.0)  # vLLM runs the one it has
    assert sent.admitted and not later.admitted
    v = a.view(running=1.0, waiting=0.0)
    assert v.unadmitted_tokens == 500 and v.decodes == 0 and v.unknown_waiting == 0
    task.cancel()


async def test_a_released_request_reaches_vllm_after_those_sent_while_it_was_held():
    """A request held at the gate reaches vLLM after a shorter one sent past it: at the next scrape vLLM's
    waiting gauge (one waiting) means the shorter one runs, not the held one that the gateway planned
    first (vLLM admits in arrival order). Before, the held request kept its planning place and was taken
    for the running one: its prompt read as already in the KV usage, the other's as demand."""
    a, g = ActiveSequences(), PrefillGate()
    first, long, long_task = await _one_sent_one_held(a, g, 2000, 1500)
    short = a.add(uncached=40, work=40.0, predicted_s=1.0, streamed=True)
    await g.admit(a, short, 2048, 5.0)  # it fits beside the first one's prefill: sent past the long one
    await held(g, 1)
    a.first_token(first)
    g.wake()  # the first prefill ended: the long one goes
    await long_task
    a.mark_scrape(waiting=1.0)  # vLLM runs one of the two it was sent: the one that reached it first
    assert short.admitted and not long.admitted
    assert a.view(running=2.0, waiting=1.0).unadmitted_tokens == 1500


def _stream_body(words: int) -> dict:
    text = " ".join(f"word{i}" for i in range(words))
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 4}


@pytest.mark.parametrize("gate", [True, False, "slow"])
async def test_the_worker_gets_the_short_prompt_before_a_long_one_sent_earlier(fleet, start_gateway, gate):
    """Three streamed prompts while the worker prefills a first one (the fake worker holds each first token
    0.8 s): with the gate a short prompt sent last reaches the worker before a long one sent before it, and
    its TTFT is the shorter; without it (``prefill_gate: false``), or where a step's prefill at the worker's
    speed outlasts the gate's wait (``slow``: 16 tokens at 1 token/s against 5 s), the worker gets them as
    they came."""
    st = fleet.add("a", first_token_delay_s=0.8)
    routing = RoutingConfig(max_num_batched_tokens=16, pending_ttl_s=0, parity_check=False,
                            prefill_gate=bool(gate), prefill_tokens_per_s=1.0 if gate == "slow" else 10_000.0)
    gw = start_gateway(fleet, routing=routing)
    ttft: dict[str, float] = {}

    async def send(c: httpx.AsyncClient, name: str, words: int) -> None:
        t0 = asyncio.get_running_loop().time()
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=_stream_body(words),
                            headers={"x-request-id": name}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_raw():
                ttft.setdefault(name, asyncio.get_running_loop().time() - t0)

    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.create_task(send(c, "first", 200))
        await wait_until(lambda: len(st.requests) == 1)
        long = asyncio.create_task(send(c, "long", 300))
        await wait_until(lambda: gw.state.decisions.get("long") is not None)
        await asyncio.sleep(0.05)
        short = asyncio.create_task(send(c, "short", 5))
        if gate is True:  # both wait at the gate while "first" prefills, and the admin API says so
            for _ in range(100):
                load = (await c.get(gw.url + "/admin/workers")).json()["workers"][0]["load"]
                if load["gated_requests"] == 2:
                    break
                await asyncio.sleep(0.01)
            assert load["gated_requests"] == 2 and load["pending_requests"] == 3
        await asyncio.gather(first, long, short)
    got = [r["headers"]["x-request-id"] for r in st.requests]
    if gate is True:
        assert got == ["first", "short", "long"]
        assert ttft["short"] < ttft["long"]
        assert gw.state.decisions.get("long").gate_wait_ms > 700  # behind "first" and "short"
        d = gw.state.decisions.get("short").to_dict()
        assert 0 < d["gate_wait_ms"] < d["observed_ttft_ms"]
        async with httpx.AsyncClient(timeout=10) as c:
            text = (await c.get(gw.url + "/metrics")).text
        assert 'kvgate_prefill_gate_wait_seconds_count{worker="a"} 3.0' in text
        assert 'kvgate_prefill_gate_held{worker="a"} 0.0' in text
    else:
        assert got == ["first", "long", "short"]
        assert all(gw.state.decisions.get(n).gate_wait_ms == 0 for n in got)
    assert json.loads(json.dumps(gw.state.decisions.get("short").to_dict()))["chosen"] == "a"


def _indexed_prompt(tokenizer_dir, words: int) -> tuple[dict, list[int]]:
    """A streamed chat body and its routable block hashes (the gateway's own tokenizer and block size)."""
    from indexer.hashing import routable_blocks, sequence_hashes
    from router.config import TokenizerConfig
    from router.local_tokenizer import LocalTokenizer
    from tests.gateway.conftest import BLOCK

    body = _stream_body(words)
    toks = LocalTokenizer(tokenizer_dir, TokenizerConfig()).tokenize_chat(body).tokens
    return body, sequence_hashes(toks, BLOCK, max_blocks=routable_blocks(len(toks), BLOCK))


@pytest.mark.parametrize("leaves", ["drain", "remove"])
async def test_a_request_held_for_a_worker_that_drains_goes_to_the_next_one(fleet, start_gateway, tokenizer_dir,
                                                                            leaves):
    """A request waits at the gate of the worker holding its prefix; the worker is drained (or removed)
    meanwhile. The gate
    lets it go at once (not when the prefill there ends) and it is not sent there but to the next
    candidate: it is answered while the worker still prefills, and the decision lists both."""
    from indexer.index.base import Tier

    a = fleet.add("a", first_token_delay_s=3.0)
    b = fleet.add("b")
    routing = RoutingConfig(max_num_batched_tokens=16, pending_ttl_s=0, parity_check=False)
    gw = start_gateway(fleet, routing=routing)
    first_body, first_hashes = _indexed_prompt(tokenizer_dir, 200)
    body, hashes = _indexed_prompt(tokenizer_dir, 300)
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, first_hashes))
    gw.call(gw.state.index.store(MODEL, "a", Tier.GPU, hashes))
    statuses: dict[str, int] = {}

    async def send(c: httpx.AsyncClient, name: str, bd: dict) -> None:
        async with c.stream("POST", gw.url + "/v1/chat/completions", json=bd,
                            headers={"x-request-id": name}) as r:
            statuses[name] = r.status_code
            async for _ in r.aiter_raw():
                pass

    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.create_task(send(c, "first", first_body))
        await wait_until(lambda: len(a.requests) == 1)
        held_task = asyncio.create_task(send(c, "held", body))
        await wait_until(lambda: len(gw.state.registry.get("a").gate) == 1)
        if leaves == "drain":
            r = await c.post(gw.url + "/admin/workers/a/drain")
            assert r.status_code == 200 and r.json()["draining"] is True
        else:
            assert (await c.delete(gw.url + "/admin/workers/a")).status_code == 200
        done, _ = await asyncio.wait({first, held_task}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {held_task}
        await first
    assert statuses == {"first": 200, "held": 200}
    d = gw.state.decisions.get("held")
    assert d.attempts == ["a", "b"] and d.chosen == "b" and d.gate_wait_ms > 0
    assert [x["headers"]["x-request-id"] for x in a.requests] == ["first"]
    assert [x["headers"]["x-request-id"] for x in b.requests] == ["held"]


async def test_a_request_held_for_the_only_worker_that_drains_gets_a_503(fleet, start_gateway):
    """The same with no other worker: the client gets a 503 in the OpenAI error format at once, and the
    drained worker is not sent the held request."""
    a = fleet.add("a", first_token_delay_s=3.0)
    routing = RoutingConfig(max_num_batched_tokens=16, pending_ttl_s=0, parity_check=False)
    gw = start_gateway(fleet, routing=routing)
    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.create_task(c.post(gw.url + "/v1/chat/completions", json=_stream_body(200)))
        await wait_until(lambda: len(a.requests) == 1)
        held_task = asyncio.create_task(c.post(gw.url + "/v1/chat/completions", json=_stream_body(300),
                                               headers={"x-request-id": "held"}))
        await wait_until(lambda: len(gw.state.registry.get("a").gate) == 1)
        assert (await c.post(gw.url + "/admin/workers/a/drain")).status_code == 200
        done, _ = await asyncio.wait({first, held_task}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {held_task}
        r = await held_task
        assert (await first).status_code == 200
    assert r.status_code == 503
    err = r.json()["error"]
    assert "left while the request was held" in err["message"] and err["code"] == "upstream_error"
    assert len(a.requests) == 1 and gw.state.decisions.get("held").outcome == "failed"


async def test_a_request_planned_on_a_held_prompts_blocks_goes_right_after_it():
    """The gate sends the shortest prompt first, but a prompt whose predicted prefix is the blocks of a
    held one (a second question over a document the first is still to compute) must not pass it: it would
    compute the document itself and the first would find it. It takes the held one's place, just behind
    it; an unrelated short prompt still goes first, and the cost model prices the held one as ahead."""
    a, g = ActiveSequences(), PrefillGate()
    running = a.add(uncached=900, work=900.0, predicted_s=1.0, streamed=True)
    await g.admit(a, running, 1000, 5.0)
    order: list[str] = []
    seqs = {}

    async def client(name: str, uncached: int, after=None):
        seqs[name] = seq = a.add(uncached=uncached, work=float(uncached), predicted_s=1.0, streamed=True)
        seq.after = after
        await g.admit(a, seq, 1000, 5.0)
        order.append(name)

    doc = asyncio.create_task(client("doc", 950))
    await held(g, 1)
    other = asyncio.create_task(client("other", 300))
    await held(g, 2)
    assert a.view().gated_behind(40) == (2, 1250, 1250.0)  # a short prompt goes before both
    assert a.view().gated_behind(40, seqs["doc"]) == (0, 0, 0.0)  # one after "doc" goes after both
    follow = asyncio.create_task(client("follow", 40, after=seqs["doc"]))
    await held(g, 3)
    a.finish(running)
    g.wake()  # "other" (300) goes; "doc" does not fit beside it, and "follow" waits behind "doc"
    await asyncio.wait_for(other, 1.0)
    await asyncio.sleep(0.01)
    assert order == ["other"] and len(g) == 2
    a.first_token(seqs["other"])
    g.wake()  # "doc" goes, and "follow" right behind it (950 + 40 fit one step)
    await asyncio.wait_for(asyncio.gather(doc, follow), 1.0)
    assert order == ["other", "doc", "follow"]


def test_the_held_sender_of_a_prompts_blocks_is_found_only_while_held():
    a = ActiveSequences()
    first = a.add(uncached=64, work=64.0, predicted_s=1.0, streamed=True, hashes=[1, 2, 3, 4], block_size=16)
    first.gated = True
    assert a.gated_sender([1, 2, 3, 9], 3) is first  # blocks 0-2 are "first"'s
    assert a.gated_sender([1, 2, 3, 9], 4) is None  # block 3 is not
    first.gated = False  # sent: vLLM computes it before anything sent later
    assert a.gated_sender([1, 2, 3, 9], 3) is None


async def test_a_second_question_over_a_held_document_reaches_the_worker_after_the_first(fleet, start_gateway):
    """Through a real gateway: the worker (fake, each first token after 0.8 s, a prefix cache of what it
    was sent) prefills a first prompt; a question over a new document is held at the gate; a second
    question over it, sent after, is planned on the first's blocks (the pending record) and is the shorter
    prefill. It reaches the worker after the first question, and both are delivered the cached tokens the
    gateway predicted (the second the document, the first none)."""
    from tests.gateway.test_tokenize import _document

    st = fleet.add("a", first_token_delay_s=0.8)
    gw = start_gateway(fleet, routing=RoutingConfig(max_num_batched_tokens=16, parity_check=False), pending=True)
    doc = _document(7, 3_000)
    got: dict[str, httpx.Response] = {}

    async def send(c: httpx.AsyncClient, name: str, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        async with c.stream("POST", gw.url + "/v1/completions", json=body, headers={"x-request-id": name}) as r:
            chunks = [x async for x in r.aiter_lines() if x.startswith("data: {")]
            got[name] = json.loads(chunks[-1][6:])["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with httpx.AsyncClient(timeout=30) as c:
        first = asyncio.create_task(send(c, "first", _document(8, 200)))
        await wait_until(lambda: len(st.requests) == 1)
        q1 = asyncio.create_task(send(c, "q1", doc + "\nQuestion: what is kept?"))
        await wait_until(lambda: len(gw.state.registry.get("a").gate) == 1)
        q2 = asyncio.create_task(send(c, "q2", doc + "\nQuestion: which tier?"))
        await wait_until(lambda: len(gw.state.registry.get("a").gate) == 2)
        await asyncio.gather(first, q1, q2)
    assert [r["headers"]["x-request-id"] for r in st.requests] == ["first", "q1", "q2"]
    d1, d2 = gw.state.decisions.get("q1"), gw.state.decisions.get("q2")
    assert d2.predicted_cached_tokens > len(doc) / 8  # planned on q1's blocks
    assert got == {"first": 0, "q1": d1.predicted_cached_tokens, "q2": d2.predicted_cached_tokens}


async def test_a_held_request_without_a_first_token_counts_as_prefilling_until_it_is_sent():
    """Non-streamed requests (no first token seen: prefilling until twice their predicted TTFT) held at the
    gate longer than that deadline: it ran while they were held, so one wake sent all of them over the
    budget (the first no longer counted outstanding), and meanwhile the load view counted them as decodes
    (found by a review). A held request's deadline starts when it is sent."""
    t = [0.0]
    a, g = ActiveSequences(clock=lambda: t[0]), PrefillGate(clock=lambda: t[0])
    first = a.add(1000, 1000.0, 0.05, streamed=True, tokens=1000)
    assert await g.admit(a, first, 1000, 30.0) == 0.0
    b = a.add(500, 500.0, 0.05, streamed=False, tokens=500)
    c = a.add(600, 600.0, 0.05, streamed=False, tokens=600)
    tasks = [asyncio.create_task(g.admit(a, s, 1000, 30.0)) for s in (b, c)]
    await held(g, 2)
    t[0] = 2.0  # held 2 s: past their 0.1 s deadlines
    v = a.view()
    assert (v.prefill_requests, v.gated_requests, v.decoding) == (3, 2, None)
    a.first_token(first)
    g.wake()  # a step's budget: the shorter goes, the other waits for it
    assert (b.gated, c.gated, g.outstanding(a)) == (False, True, 500)
    assert await tasks[0] == 2.0 and b.deadline == 2.0 + 0.1
    g.release_all()
    await tasks[1]
