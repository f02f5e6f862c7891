"""The Responses and Messages routes' own answers: errors in each API's shape (never a 500), response
owners that are unknown, gone or down, per-API cache blindness, and schemathesis over their OpenAPI
description. The workers are the fake ones (tests/support/fake_worker.py: they serve these APIs only as far
as one test needs, so what a worker would answer is not under test here; real vLLM is, in
tests/e2e/test_apis_vllm.py): these cases are the gateway's, answered before or without a worker, and fuzzing
them needs speed.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from router.apis import MESSAGES, RESPONSES
from tests.gateway.conftest import MODEL
from tests.gateway.test_proxy import wait_until

LONG = " ".join(f"the cache block prefix number {i} is long" for i in range(40))


def openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if code is not None:
        assert err["code"] == code, err
    return err


def anthropic_error(r: httpx.Response, status: int, type_: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type_ and body["error"]["message"], body
    return body["error"]


def test_unknown_response_ids_are_404_in_openai_shape(fleet, start_gateway):
    fleet.add("a")
    gw = start_gateway(fleet)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        err = openai_error(c.post("/v1/responses", json={"model": MODEL, "input": "x",
                                                         "previous_response_id": "resp_nope"}),
                           404, "response_not_found")
        assert "resp_nope" in err["message"] and err["param"] == "previous_response_id"
        openai_error(c.get("/v1/responses/resp_nope"), 404, "response_not_found")
        openai_error(c.post("/v1/responses/resp_nope/cancel"), 404, "response_not_found")
        openai_error(c.delete("/v1/responses/resp_nope"), 404, "response_not_found")
        openai_error(c.post("/v1/responses", json={"model": MODEL, "previous_response_id": 7}), 400)
        openai_error(c.post("/v1/responses", content=b"{not json", headers={"content-type": "application/json"}),
                     400, "invalid_json")
        openai_error(c.post("/v1/responses", json={"input": "x"}), 400, "missing_model")
    assert fleet.states[0].requests == []  # nothing forwarded (the worker was asked if it holds the id)
    assert fleet.states[0].lookups[:4] == ["resp_nope"] * 4


def test_owner_gone_is_410_and_owner_down_is_503(fleet, start_gateway):
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet)
    gw.call(gw.state.owners.put("resp_ghost", {"worker": "ghost", "model": MODEL, "parent": None, "delta": None}))
    gw.call(gw.state.owners.put("resp_b", {"worker": "b", "model": MODEL, "parent": None, "delta": None}))
    # b answers its health checks with 503 (setting the flag alone raced the 0.2 s health loop under load:
    # b was healthy again by the third request, which went there and got the fake's 404)
    fleet.states[1].mode = "unhealthy"
    gw.state.registry.get("b").healthy = False
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for r in (c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_ghost"}),
                  c.get("/v1/responses/resp_ghost")):
            err = openai_error(r, 410, "response_owner_gone")
            assert "ghost" in err["message"] and "resp_ghost" in err["message"]
        err = openai_error(c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_b"}),
                           503, "response_owner_unavailable")
        assert "`b`" in err["message"]
    assert all(st.requests == [] for st in fleet.states)  # never sent to another worker


def test_a_follow_up_for_a_model_its_owner_does_not_serve_is_a_400_not_a_retryable_503(fleet, start_gateway):
    """A chain's state lives on its owner alone, so a follow-up for a model that worker does not serve can
    never be answered: 400 ``model_mismatch`` (a 503 told clients to retry for ever). Naming the chain's own
    model, or none, still goes to the owner."""
    fleet.add("a")
    fleet.add("b").model = "other"
    gw = start_gateway(fleet)
    gw.call(gw.state.owners.put("resp_a", {"worker": "a", "model": MODEL, "parent": None, "delta": []}))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        err = openai_error(c.post("/v1/responses", json={"model": "other", "input": "x",
                                                         "previous_response_id": "resp_a"}), 400, "model_mismatch")
        assert err["param"] == "model" and "resp_a" in err["message"]
        r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_a"})
        assert r.headers.get("x-kvgate-worker") == "a"
    assert fleet.states[1].requests == []


def test_a_draining_owner_still_serves_its_stored_responses_but_takes_no_follow_up(fleet, start_gateway):
    """Drain lets the work in flight on a worker finish: a background response there is collected with a
    GET (or cancelled, or deleted), which must still reach it (they got a 503, and once the worker was
    removed the result was gone). A follow-up is new work: it still gets the 503."""
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet)
    gw.call(gw.state.owners.put("resp_bg", {"worker": "b", "model": MODEL, "parent": None, "delta": None}))
    gw.call(gw.state.registry.drain("b"))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for r in (c.get("/v1/responses/resp_bg"), c.post("/v1/responses/resp_bg/cancel")):
            assert r.status_code == 404 and r.headers["x-kvgate-worker"] == "b"  # the fake's own answer
        openai_error(c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_bg"}),
                     503, "response_owner_unavailable")
    assert fleet.states[0].requests == []


def test_an_owner_failing_health_checks_still_answers_for_its_stored_responses(fleet, start_gateway):
    """A failing /health (timed out on a loaded CPU server, or a 503) takes a worker out of routing but says
    nothing of the responses it stores: their GET, cancel and delete still go to it (a cancel during a long
    generation on real vLLM got a 503 while vLLM was up). A follow-up is new work: 503. An owner whose
    process is seen gone (connections refused) fails them too: 503."""
    fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet)
    reg = gw.state.registry
    gw.call(gw.state.owners.put("resp_bg", {"worker": "b", "model": MODEL, "parent": None, "delta": None}))
    fleet.states[1].mode = "unhealthy"
    gw.call(wait_until(lambda: not reg.get("b").healthy))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for r in (c.get("/v1/responses/resp_bg"), c.post("/v1/responses/resp_bg/cancel"),
                  c.delete("/v1/responses/resp_bg")):
            assert r.status_code == 404 and r.headers["x-kvgate-worker"] == "b"  # the fake's own answer
        openai_error(c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_bg"}),
                     503, "response_owner_unavailable")
        reg.get("b").down = True  # its port refused connections (router/registry.py _down)
        for r in (c.get("/v1/responses/resp_bg"), c.post("/v1/responses/resp_bg/cancel")):
            openai_error(r, 503, "response_owner_unavailable")
    assert fleet.states[0].requests == []


def test_a_stored_responses_get_does_not_wait_at_the_prefill_gate(fleet, start_gateway):
    """Only prefills are ordered at the prefill gate (router/admission.py). A stored response's GET, cancel
    or delete has nothing to prefill, yet it waited behind a prompt longer than a step's budget for up to
    ``prefill_gate_max_wait_s`` (5 s), and each one pulled the worker's mean request size, which prices the
    waiting requests other gateways sent, toward 0 (both found by a review)."""
    fleet.add("a")
    fleet.states[0].first_token_delay_s = 3.0  # the long prompt prefills for 3 s
    gw = start_gateway(fleet)
    gw.state.settings.routing.prefill_gate_tokens = 512  # one step's budget: the prompt below is longer
    a = gw.state.registry.get("a")
    gw.call(gw.state.owners.put("resp_bg", {"worker": "a", "model": MODEL, "parent": None, "delta": None}))
    long = {"model": MODEL, "prompt": list(range(2000)), "max_tokens": 2, "stream": True}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=gw.url, timeout=30) as c:
        prefilling = pool.submit(httpx.post, gw.url + "/v1/completions", json=long, timeout=30)
        gw.call(wait_until(lambda: a.inflight == 1))
        mean = a.active.mean_work, a.active.mean_tokens
        for r in (c.get("/v1/responses/resp_bg"), c.post("/v1/responses/resp_bg/cancel")):
            assert r.status_code == 404 and r.headers["x-kvgate-worker"] == "a"  # the fake's own answer
        assert not prefilling.done()  # the long prompt still prefills
        assert (a.active.mean_work, a.active.mean_tokens) == mean
        assert prefilling.result().status_code == 200
        owned = [d for d in c.get("/admin/decisions").json()["decisions"] if "resp_bg" in d["path"]]
    assert len(owned) == 2 and all(d["gate_wait_ms"] == 0 for d in owned), owned


def test_malformed_messages_are_400_in_anthropic_shape(fleet, start_gateway):
    fleet.add("a")
    gw = start_gateway(fleet, max_body_bytes=10_000)
    ok = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        anthropic_error(c.post("/v1/messages", content=b"{oops", headers={"content-type": "application/json"}),
                        400, "invalid_request_error")
        for bad in ({**ok, "messages": "hi"}, {k: v for k, v in ok.items() if k != "max_tokens"},
                    {**ok, "max_tokens": "4"}, {**ok, "messages": [{"role": "robot", "content": "x"}]},
                    {**ok, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
                    {**ok, "system": 3}, {**ok, "model": ""}, [ok]):
            anthropic_error(c.post("/v1/messages", json=bad), 400, "invalid_request_error")
        anthropic_error(c.post("/v1/messages", json={**ok, "model": "other"}), 404, "not_found_error")
        anthropic_error(c.post("/v1/messages", json={**ok, "messages": [{"role": "user", "content": "x" * 20_000}]}),
                        413, "request_too_large")
        anthropic_error(c.post("/v1/messages/count_tokens", json={"messages": []}), 400, "invalid_request_error")
    assert fleet.states[0].requests == []


def test_a_worker_blind_for_one_api_keeps_its_cache_for_the_other(fleet, start_gateway):
    """A failed Messages parity probe makes routing count no cached blocks on that worker for Messages;
    Responses requests still see them."""
    fleet.add("a")
    gw = start_gateway(fleet, pending=True)
    w = gw.state.registry.get("a")
    from router.apis import messages as msg_api
    from router.apis import responses as resp_api

    body_r = {"model": MODEL, "input": LONG}
    body_m = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": LONG}]}
    views = {RESPONSES: resp_api.chat_view(body_r), MESSAGES: msg_api.chat_view(body_m)}
    bodies = {RESPONSES: body_r, MESSAGES: body_m}

    def plan(api):
        return gw.call(gw.state.router.plan(MODEL, bodies[api], {}, f"/v1/{api}", view=views[api], api=api))

    for api in (RESPONSES, MESSAGES):
        d = plan(api)
        gw.state.pending.record(d.namespace, d.hashes, "a")
        assert d.num_blocks > 2 and plan(api).best.cached_tokens > 0
    w.parity = {"status": "ok", "apis": {MESSAGES: {"status": "cache-blind"}, RESPONSES: {"status": "ok"}}}
    assert plan(MESSAGES).best.cached_tokens == 0
    assert plan(RESPONSES).best.cached_tokens > 0


def test_a_non_streamed_messages_answer_counts_towards_the_workers_answer_length(fleet, start_gateway):
    """The load tracker learns how long a worker's answers are from their usage (router/load.py: requests in
    flight are then expected to answer as long, not ``max_tokens``). A non-streamed Messages answer's
    ``output_tokens`` count as a chat answer's do: its lease was released before the API's hooks read them.
    The fake worker answers ``/v1/messages`` here (``messages=True``), with usage only."""
    fleet.add("a", messages=True, words=5)
    gw = start_gateway(fleet)
    tracker = gw.state.registry.get("a").active
    assert tracker.mean_completion is None
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 4096,
                                         "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 5, r.text
    assert r.headers["x-kvgate-worker"] == "a" and fleet.states[0].requests[-1]["kind"] == "messages"
    assert tracker.mean_completion == 5


def test_a_template_that_fails_its_messages_check_is_routed_on_load(fleet, start_gateway, monkeypatch):
    """Which template traits vLLM's Messages serving uses is read from the model's chat templates; a template
    that raised there other than jinja2's TemplateError (a filter on an undefined variable) made every
    /v1/messages request of the model a 500. It is routed on load instead (vLLM judges the request). The
    failing template is a stand-in: the traits check is made to raise."""
    import router.apis.routes as routes

    def broken(local):
        raise TypeError("Object of type Undefined is not JSON serializable")

    monkeypatch.setattr(routes, "template_traits", broken)
    fleet.add("a", messages=True, words=5)
    gw = start_gateway(fleet)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/messages", json={"model": MODEL, "max_tokens": 16,
                                         "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "a", r.text


# schemathesis --------------------------------------------------------------------------------------------
def error_shape(ctx, response, case):
    """The gateway's own errors (no ``x-kvgate-worker``: nothing was forwarded) keep the API's shape."""
    if response.status_code < 400 or "x-kvgate-worker" in response.headers:
        return None
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert body.get("type") == "error" and isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body["error"]["message"], str) and "code" in body["error"], body
    return None


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_never_a_server_error(fleet, start_gateway, mode):
    """Bodies that fit the OpenAPI description of the Responses and Messages routes, and bodies that do
    not: never a 500, and the gateway's own errors in each API's shape. (Through Hypothesis directly:
    schemathesis' pytest plugin does not load under this pytest.)"""
    fleet.add("a")
    gw = start_gateway(fleet)
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json").include(
        path_regex=r"^/v1/(responses|messages)")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) == 6, [o.label for o in ops]
    calls = 0

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        nonlocal calls
        case = data.draw(st.sampled_from(ops).flatmap(lambda op: op.as_strategy(mode)))
        response = case.call(base_url=gw.url, timeout=30)
        calls += 1
        case.validate_response(response, checks=[not_a_server_error, error_shape])

    run()
    assert calls >= 60
