"""The Responses and Messages APIs through kvgate, on the two real vLLM servers (Responses store on):
tokens equal vLLM's own, chained responses never miss their owner (also through a second gateway
process on the same Redis), later turns of a conversation hit the cache and the gateway predicts exactly
what vLLM delivers, and the parity probes of both APIs pass.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from router.apis import MESSAGES, RESPONSES, fit_template, template_traits
from router.apis import messages as msg_api
from router.apis import responses as resp_api
from tests.e2e.conftest import E2E_MODEL_NAME as MODEL
from tests.e2e.conftest import e2e_report
from tests.support.procs import free_port, stop
from tests.support.vllm_server import unique_prompt

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def _plan(gw, body: dict, api: str, history=None):
    """The gateway's decision for ``body`` (kv policy, nothing sent)."""
    from router.policies import create_policy

    local = gw.state.tokenizers.for_model(MODEL)
    view = fit_template(local, resp_api.chat_view(body, history) if api == RESPONSES
                        else msg_api.chat_view(body, *template_traits(local)))
    kv = create_policy(gw.state.settings.routing, "kv")
    return gw.call(gw.state.router.plan(MODEL, body, {}, f"/v1/{api}", policy=kv, view=view, api=api))


# 1 ------------------------------------------------------------------------------------------------------
def test_tokens_equal_vllms_own_and_parity_passes(kvgate, vllm_servers):
    """kvgate's tokens of Responses and Messages bodies equal the tokens vLLM renders for them (its
    /v1/responses/render and /v1/messages/render), and both API parity probes pass on real vLLM."""
    gw = kvgate("kv")
    for w in gw.state.registry.workers():
        apis = w.parity["apis"]
        assert apis[RESPONSES]["status"] == "ok" and apis[MESSAGES]["status"] == "ok", json.dumps(apis)
        assert apis[MESSAGES]["worker_tokens"] == apis[MESSAGES]["kvgate_tokens"]
    t = _tag()
    fn = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    responses = [
        {"model": MODEL, "input": f"{t} plain string input"},
        {"model": MODEL, "instructions": f"{t} be brief", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "answer", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "developer", "content": "dev"}, {"role": "user", "content": "next"}], "tools": [fn]},
        {"model": MODEL, "input": [{"role": "user", "content": f"{t} continue this"},
                                   {"type": "message", "role": "assistant", "id": "m", "status": "incomplete",
                                    "content": [{"type": "output_text", "text": "partial", "annotations": []}]}]},
    ]
    messages = [
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"{t} hi"}]},
        {"model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": f"{t} sys"}], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": "r"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "tu1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                          "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                                         {"type": "text", "text": "go"}]},
            {"role": "system", "content": "inline system"}, {"role": "user", "content": "again"}]},
    ]
    url = vllm_servers[0].url
    for api, bodies in ((RESPONSES, responses), (MESSAGES, messages)):
        for body in bodies:
            r = httpx.post(f"{url}/v1/{api}/render", json=body, timeout=60)
            assert r.status_code == 200, r.text
            d = _plan(gw, body, api)
            assert d.tokenizer == "local" and d.tokenize_error is None
            assert d.num_tokens == len(r.json()["token_ids"]), (api, body)
            assert d.hashes == gw.hashes(r.json()["token_ids"]), (api, body)


# 2 ------------------------------------------------------------------------------------------------------
def _responses(url: str, body: dict) -> tuple[int, dict, dict]:
    """POST /v1/responses (streamed or not): status, the final response object, headers."""
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=300) as r:
        if not body.get("stream"):
            r.read()
            return r.status_code, (r.json() if r.status_code < 500 else {}), dict(r.headers)
        final: dict = {}
        for line in r.iter_lines():
            if line.startswith("data:"):
                ev = json.loads(line[5:])
                if ev.get("type") in ("response.completed", "response.incomplete"):
                    final = ev["response"]
        return r.status_code, final, dict(r.headers)


def _second_gateway(gw, vllm_servers, redis_url, tmp_path):
    """``kvgate serve`` in its own process, on the same Redis and workers."""
    port = free_port()
    cfg = {"port": port, "host": "127.0.0.1", "index": {"backend": "redis", "redis_url": redis_url},
           "workers": [s.worker_config() for s in vllm_servers],
           "models": {MODEL: {"tokenizer": str(gw.state.settings.models[MODEL].tokenizer)}},
           "health_interval_s": 0.5, "routing": {"parity_check": False}}
    path = tmp_path / "kvgate2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", str(path)], cwd=ROOT,
                            stdout=open(tmp_path / "kvgate2.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError((tmp_path / "kvgate2.log").read_text()[-3000:])
        try:
            r = httpx.get(base + "/ready", timeout=2)
            if r.status_code == 200 and r.json().get("healthy_workers") == len(vllm_servers):
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop(proc)
    raise AssertionError("second gateway not ready: " + (tmp_path / "kvgate2.log").read_text()[-3000:])


def test_chained_responses_never_miss_their_owner(kvgate, vllm_servers, redis_url, tmp_path):
    """N stored responses, each followed up twice (streamed and not) with ``previous_response_id``, read
    back by id, through kvgate and then through a second gateway process behind the same Redis: 0 fail.
    A background response is cancelled by id on its worker."""
    gw = kvgate("kv")
    n, failures, owners = 6, [], {}
    ids = []
    for i in range(n):
        status, resp, h = _responses(gw.url, {"model": MODEL, "input": unique_prompt(40), "store": True,
                                              "max_output_tokens": 4, "temperature": 0.0, "stream": i % 2 == 1})
        assert status == 200 and resp.get("id"), resp
        ids.append(resp["id"])
        owners[resp["id"]] = h["x-kvgate-worker"]
    assert len(set(owners.values())) == 2, owners  # the chains start on both workers

    proc, second = _second_gateway(gw, vllm_servers, redis_url, tmp_path)
    try:
        followups = 0
        for rid in ids:
            for base, stream in ((gw.url, False), (gw.url, True), (second, False), (second, True)):
                status, resp, h = _responses(base, {"model": MODEL, "input": "and then?", "max_output_tokens": 4,
                                                    "previous_response_id": rid, "stream": stream,
                                                    "temperature": 0.0})
                followups += 1
                if status != 200 or h.get("x-kvgate-worker") != owners[rid]:
                    failures.append((base, rid, stream, status, resp))
            for base in (gw.url, second):
                r = httpx.get(f"{base}/v1/responses/{rid}", timeout=60)
                followups += 1
                if r.status_code != 200 or r.json().get("id") != rid:
                    failures.append((base, rid, "GET", r.status_code, r.text[:300]))
        # A long background response, cancelled by id through the other gateway. 3,000 tokens take ~13 s on
        # an idle core; on a loaded one the cancel can still come too late (vLLM then answers 400 "Cannot
        # cancel a synchronous response"): a response that ran to its end is tried again, once.
        for attempt in range(2):
            t0 = time.monotonic()
            status, resp, h = _responses(gw.url, {"model": MODEL, "input": unique_prompt(20), "store": True,
                                                  "background": True, "max_output_tokens": 3000,
                                                  "ignore_eos": True})
            assert status == 200 and resp["status"] in ("queued", "in_progress"), resp
            created_s = time.monotonic() - t0
            r = httpx.post(f"{second}/v1/responses/{resp['id']}/cancel", timeout=60)
            cancel_s = time.monotonic() - t0
            if r.status_code == 200 and r.json().get("status") == "cancelled":
                break
            after = httpx.get(f"{second}/v1/responses/{resp['id']}", timeout=60).json()
            if attempt == 0 and after.get("status") in ("completed", "incomplete") and \
                    (after.get("usage") or {}).get("output_tokens") == 3000:
                continue  # it finished before the cancel reached it
            failures.append((second, resp["id"], "cancel", r.status_code, r.text[:300], after.get("status"),
                             after.get("error"), after.get("incomplete_details"),
                             f"created after {created_s:.1f} s, cancel answered after {cancel_s:.1f} s"))
            break
        followups += 1
    finally:
        stop(proc)
    e2e_report(f"Responses chains through 2 gateways: {len(failures)} of {followups} follow-ups/GETs/cancels failed")
    assert not failures, failures


# 3 ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts(tiny_model_dir):
    from bench.chat_workload import TextMaker

    return TextMaker(tiny_model_dir, seed=int(time.time()))


def _planned(gw, api: str, body: dict):
    """What the gateway would decide for ``body`` now, as its route does (a chain's history included)."""
    history = None
    if body.get("previous_response_id"):
        chain = gw.call(gw.state.owners.chain(body["previous_response_id"], 100))
        history = resp_api.history_of(chain)
        assert history is not None
    return _plan(gw, body, api, history)


def _settle(gw, api: str, body: dict) -> None:
    """Wait until the gateway's predicted hit for ``body`` stops growing: the previous turn's KV events
    (its output blocks included) have reached the index, as they would while a reader reads the answer."""
    prev, deadline = -1, time.monotonic() + 15
    while time.monotonic() < deadline:
        d = _planned(gw, api, body)
        n = d.best.cached_tokens if d.best else 0
        if n == prev and n > 0:
            return
        prev = n
        time.sleep(0.4)


def _answer(api: str, r: httpx.Response, stream: bool) -> tuple[int, str, str | None]:
    """(delivered cached tokens, answer text, response id) from a streamed or unstreamed answer."""
    def text_of(resp: dict) -> str:
        return "".join(p["text"] for item in resp["output"] if item["type"] == "message" for p in item["content"])

    if not stream:
        obj = r.json()
        if api == RESPONSES:
            return obj["usage"]["input_tokens_details"]["cached_tokens"], text_of(obj), obj["id"]
        return obj["usage"]["cache_read_input_tokens"], obj["content"][0]["text"], None
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    if api == RESPONSES:
        final = next(e["response"] for e in events if e["type"] in ("response.completed", "response.incomplete"))
        return final["usage"]["input_tokens_details"]["cached_tokens"], text_of(final), final["id"]
    delta = next(e for e in events if e["type"] == "message_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    return delta["usage"]["cache_read_input_tokens"], text, None


STATELESS = "responses-stateless"


def conversation(gw, mode: str, questions: list[str]) -> list[tuple[int, int, str]]:
    """One conversation through ``gw``, every second turn streamed: (predicted, delivered, worker) per
    turn. Responses turns chain with ``previous_response_id`` (``STATELESS``: resend the history as input
    items, ``store`` off); Messages turns resend the history."""
    out, history, prev_id = [], [], None
    api = RESPONSES if mode == STATELESS else mode
    for k, q in enumerate(questions):
        stream = k % 2 == 1
        if mode == RESPONSES:
            body = {"model": MODEL, "input": q, "store": True, "max_output_tokens": 6, "temperature": 0.0,
                    "stream": stream, **({"previous_response_id": prev_id} if prev_id else {})}
        elif mode == STATELESS:
            history.append({"role": "user", "content": q})
            body = {"model": MODEL, "input": list(history), "store": False, "max_output_tokens": 6,
                    "temperature": 0.0, "stream": stream}
        else:
            history.append({"role": "user", "content": q})
            body = {"model": MODEL, "max_tokens": 6, "temperature": 0.0, "messages": list(history), "stream": stream}
        if k:
            _settle(gw, api, body)
        rid = f"t-{_tag()}"
        r = httpx.post(f"{gw.url}/v1/{api}", json=body, timeout=300, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        delivered, text, prev_id = _answer(api, r, stream)
        d = gw.state.decisions.get(rid)
        deadline = time.monotonic() + 10  # a stream's record is closed just after its last byte is sent
        while d is not None and d.outcome is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d is not None and d.tokenize_error is None and d.delivered_cached_tokens == delivered, d
        if mode == MESSAGES:
            history.append({"role": "assistant", "content": text})
        elif mode == STATELESS:
            history.append({"type": "message", "role": "assistant", "id": f"msg_{k}", "status": "completed",
                            "content": [{"type": "output_text", "text": text, "annotations": []}]})
        out.append((int(r.headers["x-kvgate-cached-tokens"]), delivered, r.headers["x-kvgate-worker"]))
    return out


@pytest.mark.parametrize("api", [RESPONSES, STATELESS, MESSAGES])
def test_multi_turn_conversations_hit_the_cache_and_predictions_are_exact(kvgate, texts, api):
    """4 turns of ~300 new tokens each: under kv every later turn gets vLLM cached tokens, and the
    gateway's predicted cached tokens equal vLLM's delivered ones on every turn. Under round_robin (the
    cache-blind path) the second turn of a stateless conversation lands on the other worker and gets
    none (a chain is pinned to its owner under any policy, see below)."""
    questions = [texts.text(300, tag=_tag()) for _ in range(4)]
    kv = conversation(kvgate("kv"), api, questions)
    assert all(delivered > 0 for _, delivered, _ in kv[1:]), kv
    assert [p for p, _, _ in kv] == [d for _, d, _ in kv], kv
    assert len({w for _, _, w in kv}) == 1, kv
    rr_questions = [texts.text(300, tag=_tag()) for _ in range(4)]
    rr = conversation(kvgate("round_robin"), api, rr_questions) if api != RESPONSES else None
    if rr is not None:
        assert rr[1][1] == 0 and rr[1][2] != rr[0][2], rr
        assert sum(d for _, d, _ in rr) < sum(d for _, d, _ in kv)
    e2e_report(f"{api} 4-turn conversation: kv cached tokens per turn {[d for _, d, _ in kv]} (predicted "
               f"{[p for p, _, _ in kv]})" + (f"; round_robin {[d for _, d, _ in rr]}" if rr else ""))


def test_responses_chain_is_pinned_even_under_round_robin(kvgate):
    """A chain's follow-up goes to its owner whatever the policy: round_robin would alternate."""
    gw = kvgate("round_robin")
    status, resp, h = _responses(gw.url, {"model": MODEL, "input": unique_prompt(40), "max_output_tokens": 2})
    owner = h["x-kvgate-worker"]
    for _ in range(3):
        status, resp, h = _responses(gw.url, {"model": MODEL, "input": "more", "max_output_tokens": 2,
                                              "previous_response_id": resp["id"]})
        assert status == 200 and h["x-kvgate-worker"] == owner, resp


# 4 ------------------------------------------------------------------------------------------------------
def test_owner_gone_is_410_and_unknown_id_is_404(kvgate, vllm_servers):
    """A response whose worker left the fleet is answered 410, naming it, and sent nowhere else; an id
    the gateway never saw is 404; both in the OpenAI error shape. A malformed Messages body is a 400 in
    Anthropic's shape."""
    gw = kvgate("kv")
    status, resp, h = _responses(gw.url, {"model": MODEL, "input": unique_prompt(30), "max_output_tokens": 2})
    owner = h["x-kvgate-worker"]
    r = httpx.post(gw.url + "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    r = httpx.post(gw.url + "/v1/messages", json={"model": MODEL, "messages": "not a list", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    gw.call(gw.state.registry.remove(owner))
    before = len(gw.state.decisions)
    for path in ("/v1/responses", f"/v1/responses/{resp['id']}"):
        if path == "/v1/responses":
            r = httpx.post(gw.url + path, json={"model": MODEL, "input": "x", "previous_response_id": resp["id"]},
                           timeout=30)
        else:
            r = httpx.get(gw.url + path, timeout=30)
        assert r.status_code == 410, r.text
        err = r.json()["error"]
        assert err["code"] == "response_owner_gone" and owner in err["message"] and resp["id"] in err["message"]
    assert len(gw.state.decisions) == before  # nothing was sent anywhere
