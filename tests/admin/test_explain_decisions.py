"""``/admin/explain`` (the plan without sending) against the choice the proxy then makes, and
``/admin/decisions`` with predictions beside vLLM's delivered ``cached_tokens``."""
from __future__ import annotations

import httpx
import pytest

from indexer.hashing import sequence_hashes
from tests.admin.conftest import BLOCK, MODEL
from tests.admin.test_workers import prompt


def worker_tokens(env, worker: str, body: dict) -> list[int]:
    """What the worker itself tokenizes the request to (vLLM's /tokenize), i.e. what it would cache."""
    r = httpx.post(env.workers[worker].url + "/tokenize", json=body, timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()["tokens"]


def sent_counts(env) -> dict[str, int]:
    return {n: len(w.state.requests) for n, w in env.workers.items()}


def explain(env, body: dict, **wrapper) -> dict:
    r = env.http.post("/admin/explain", json={"body": body, **wrapper})
    assert r.status_code == 200, r.text
    return r.json()


def send(env, path: str, body: dict) -> tuple[httpx.Response, str]:
    r = env.anon.post(path, json=body)
    assert r.status_code == 200, r.text
    return r, env.state.decisions.get(r.headers["x-request-id"]).chosen


def test_explain_token_ids_matches_the_real_choice(admin_env):
    env = admin_env(3)
    toks = prompt(11, 4)
    hashes = env.publish("w2", toks)
    body = {"model": MODEL, "prompt": toks, "max_tokens": 4}
    before = sent_counts(env)
    ex = explain(env, body)
    assert sent_counts(env) == before  # explain sent nothing to any worker
    assert ex["chosen"] == "w2"
    assert ex["path"] == "/v1/completions" and ex["policy"] == "kv"
    assert ex["num_tokens"] == len(toks) and ex["block_size"] == BLOCK
    assert ex["hashes"] == [str(h) for h in hashes]
    assert ex["hashes_hex"] == [f"{h:016x}" for h in hashes]
    cands = {c["worker"]: c for c in ex["candidates"]}
    assert set(cands) == {"w1", "w2", "w3"}
    assert ex["candidates"][0]["worker"] == "w2"
    assert cands["w2"]["gpu_blocks"] == 4 and cands["w2"]["local_blocks"] == 4
    assert cands["w2"]["cached_tokens"] == 4 * BLOCK
    assert cands["w1"]["local_blocks"] == 0 and cands["w1"]["uncached_tokens"] == len(toks)
    assert cands["w2"]["predicted_ttft_ms"] < cands["w1"]["predicted_ttft_ms"]
    for c in cands.values():
        assert c["predicted_ttft_ms"] == c["queue_ms"] + c["prefill_ms"] + c["g4_load_ms"]
    # The ordering key is shown, lowest first; the idle workers pay for recomputing w2's 4 blocks.
    scores = [c["score_ms"] for c in ex["candidates"]]
    assert scores == sorted(scores)
    redo = cands["w1"]["prefill_work"] - cands["w2"]["prefill_work"]
    assert redo > 4 * BLOCK  # the recomputed blocks' work, their context included
    redo_ms = redo / cands["w1"]["prefill_tokens_per_s"] * 1000.0
    terms = cands["w1"]["terms_ms"]
    assert terms["ttft"] == pytest.approx(cands["w1"]["predicted_ttft_ms"], abs=1e-3)
    assert terms["recompute"] == pytest.approx(redo_ms, abs=1e-3)
    # w2 is the holder: leaving it also costs the future turns' recomputation and a share of its TTFT
    # (hysteresis: routing.future_turns, routing.stay_margin)
    stay = 3.0 * redo_ms + 0.3 * cands["w2"]["predicted_ttft_ms"]
    assert terms["continuity"] == pytest.approx(stay, abs=1e-3) and terms["footprint"] == 0
    assert cands["w1"]["score_ms"] == pytest.approx(sum(terms.values()), abs=1e-2)
    assert cands["w2"]["terms_ms"]["continuity"] == 0 and cands["w2"]["terms_ms"]["recompute"] == 0
    assert set(ex["timings_ms"]) >= {"tokenize", "hash", "lookup", "decide"}
    # The same request, sent: the proxy makes the same choice.
    _, chosen = send(env, "/v1/completions", body)
    assert chosen == ex["chosen"]
    # The verbatim form gives the same answer.
    r = env.http.post("/admin/explain/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["chosen"] == "w2" and r.json()["hashes"] == ex["hashes"]


def test_explain_chat_and_text_prompt_match_the_real_choice(admin_env):
    env = admin_env(2)
    chat = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": "You are a cache block prefix gateway. " * 6},
        {"role": "user", "content": "route the stream request to the worker with the long prefix " * 3}]}
    toks = worker_tokens(env, "w1", chat | {"add_generation_prompt": True})
    assert len(toks) > 3 * BLOCK
    env.publish("w1", toks)
    ex = explain(env, chat)  # path inferred from "messages"
    assert ex["path"] == "/v1/chat/completions"
    assert ex["chosen"] == "w1"
    assert ex["num_tokens"] == len(toks)  # the gateway's tokens are the worker's
    n = (len(toks) - 1) // BLOCK
    assert ex["hashes"] == [str(h) for h in sequence_hashes(toks, BLOCK)[:n]]
    assert {c["worker"]: c["local_blocks"] for c in ex["candidates"]}["w1"] == n
    _, chosen = send(env, "/v1/chat/completions", chat)
    assert chosen == ex["chosen"] == "w1"

    text = {"model": MODEL, "max_tokens": 4,
            "prompt": "the cache block of the prefix is on the worker that had the request " * 4}
    env.publish("w2", worker_tokens(env, "w2", text))
    ex = explain(env, text, path="/v1/completions")
    assert ex["chosen"] == "w2"
    _, chosen = send(env, "/v1/completions", text)
    assert chosen == ex["chosen"]


def test_explain_shows_g4_and_load_terms(admin_env):
    env = admin_env(2, worker_kw={"w1": {"waiting": 6}})  # vLLM reports 6 waiting requests on w1
    toks = prompt(21, 4)
    env.publish("w2", toks, medium="STORAGE")
    # The registry scrapes vLLM's gauges periodically: wait until it has seen w1's queue.
    from tests.admin.conftest import until

    until(lambda: env.state.registry.get("w1").load.waiting == 6, what="w1 queue scraped")
    ex = explain(env, {"model": MODEL, "prompt": toks})
    assert ex["g4_blocks"] == 4
    cands = {c["worker"]: c for c in ex["candidates"]}
    for c in cands.values():
        assert c["g4_blocks"] == 4 and c["g4_load_ms"] > 0 and c["local_blocks"] == 0
    assert cands["w1"]["vllm_waiting"] == 6 and cands["w1"]["queue_ms"] > cands["w2"]["queue_ms"]
    assert ex["chosen"] == "w2"
    _, chosen = send(env, "/v1/completions", {"model": MODEL, "prompt": toks, "max_tokens": 2})
    assert chosen == ex["chosen"]


def test_explain_bad_inputs(admin_env):
    env = admin_env(1)
    cases = [
        ({"body": {"prompt": "hi"}}, 400, "model"),
        ({"body": {"model": MODEL, "messages": []}}, 400, "messages"),
        ({"body": {"model": MODEL, "messages": "hello"}}, 400, "messages"),
        ({"body": {"model": MODEL, "prompt": {"a": 1}}}, 400, "prompt"),
        ({"body": {"model": MODEL, "prompt": [1, "x"]}}, 400, "prompt"),
        ({"body": {"model": MODEL}, "path": "/v1/completions"}, 400, "prompt"),
        ({"body": {"model": MODEL, "prompt": "hi"}, "path": "/v1/embeddings"}, 400, "path"),
        ({"body": {"model": "nope", "prompt": "hi"}}, 404, "model"),
        ({"body": {"model": MODEL, "prompt": "hi"}, "extra": 1}, 422, "extra"),
        # The wrapper's own field is named; only FastAPI's leading "body" location is dropped.
        ({"body": [1, 2]}, 422, "body"),
        ({}, 422, "body"),
    ]
    for payload, status, param in cases:
        r = env.http.post("/admin/explain", json=payload)
        assert r.status_code == status, (payload, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (payload, err)
        assert err["message"]
    r = env.http.post("/admin/explain/v1/chat/completions", content=b"[1,2",
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert sum(sent_counts(env).values()) == 0


def test_decisions_carry_prediction_and_delivery(admin_env):
    env = admin_env(2)
    toks = prompt(31, 4)
    body = {"model": MODEL, "prompt": toks, "max_tokens": 4}
    r1, first = send(env, "/v1/completions", body)
    # vLLM would now announce the prompt's blocks; the fake worker has cached them too.
    env.publish(first, toks)
    r2, second = send(env, "/v1/completions", body)
    assert second == first
    r3, _ = send(env, "/v1/completions", {"model": MODEL, "prompt": prompt(32, 2), "max_tokens": 4})

    doc = env.http.get("/admin/decisions", params={"limit": 2}).json()
    assert doc["count"] == 2 and doc["capacity"] == env.state.settings.routing.decisions_kept
    ids = [d["request_id"] for d in doc["decisions"]]
    assert ids == [r3.headers["x-request-id"], r2.headers["x-request-id"]]  # newest first
    d2 = doc["decisions"][1]
    assert d2["chosen"] == first and d2["status"] == 200 and d2["outcome"] == "ok"
    assert d2["predicted_cached_tokens"] == 4 * BLOCK
    assert d2["delivered_cached_tokens"] == 4 * BLOCK  # what the worker's usage reported
    assert d2["prompt_tokens"] == len(toks)
    assert d2["max_tokens"] == 4  # the generation limit, which prices how long the request holds its KV
    d1 = env.http.get(f"/admin/decisions/{r1.headers['x-request-id']}").json()
    assert d1["predicted_cached_tokens"] == 0 and d1["delivered_cached_tokens"] == 0
    assert {c["worker"] for c in d1["candidates"]} == {"w1", "w2"}

    assert len(env.http.get("/admin/decisions").json()["decisions"]) == 3
    assert env.http.get("/admin/decisions", params={"model": "other"}).json()["count"] == 0
    assert env.http.get("/admin/decisions/nope").status_code == 404
    for bad in ("0", "-3", "x"):
        r = env.http.get("/admin/decisions", params={"limit": bad})
        assert r.status_code == 422 and r.json()["error"]["param"].endswith("limit")


def test_explain_does_not_shift_round_robin(admin_env):
    """Round robin (and exact ties under the kv policy) rotate on every plan: explain plans on a copy, so
    it predicts the next request's worker and leaves the rotation alone."""
    env = admin_env(3, routing={"policy": "round_robin"})
    body = {"model": MODEL, "prompt": prompt(71, 2), "max_tokens": 2}
    served = []
    for _ in range(4):
        first, second = explain(env, body)["chosen"], explain(env, body)["chosen"]
        assert first == second
        _, chosen = send(env, "/v1/completions", body)
        assert chosen == first
        served.append(chosen)
    assert len(set(served[:3])) == 3  # the rotation still visits every worker


def test_explain_under_exact_ties_matches(admin_env):
    env = admin_env(3)
    for i in range(4):
        body = {"model": MODEL, "prompt": prompt(80 + i, 2), "max_tokens": 2}  # cached nowhere: a tie
        ex = explain(env, body)
        _, chosen = send(env, "/v1/completions", body)
        assert chosen == ex["chosen"]


def test_observed_ttfts_correct_the_prediction(admin_env):
    """A worker slower to its first token (0.3 s) than the priors predict (milliseconds): after eight
    streamed responses the learnt fit (router/ttft_fit.py) moves every prediction towards what is observed,
    within its 4x bound, and the decision records and /admin/workers show the correction."""
    env = admin_env(1, worker_kw={"w1": {"first_token_delay_s": 0.3}})
    ratios, last = [], None
    for i in range(12):
        r = env.anon.post("/v1/completions", json={"model": MODEL, "prompt": prompt(300 + i, 4),
                                                   "max_tokens": 2, "stream": True})
        assert r.status_code == 200
        last = env.state.decisions.get(r.headers["x-request-id"])
        ratios.append(last.observed_ttft_ms / last.predicted_ttft_ms)
    c = last.candidate("w1")
    assert c.fit_ms > 0 and c.predicted_ttft_ms == pytest.approx(c.model_ttft_ms + c.fit_ms)
    assert ratios[-1] < ratios[0] / 2, ratios
    fit = next(w for w in env.http.get("/admin/workers").json()["workers"] if w["name"] == "w1")["load"]["ttft_fit"]
    assert fit["active"] and fit["samples"] == 12
    doc = env.http.get(f"/admin/decisions/{last.request_id}").json()
    assert doc["candidates"][0]["fit_ms"] == pytest.approx(c.fit_ms)
