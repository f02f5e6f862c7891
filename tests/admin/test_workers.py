"""``/admin/workers`` on a live gateway: listing, run-time add/remove, drain, bad inputs."""
from __future__ import annotations

import threading

import httpx

from indexer.hashing import sequence_hashes
from tests.admin.conftest import BLOCK, MODEL, LiveWorker, until


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """Token ids of ``blocks`` full blocks plus one token (vLLM never serves a prompt's last token from
    cache, so all ``blocks`` are routable)."""
    return [(seed * 7919 + i * 31) % 900 + 10 for i in range(blocks * BLOCK + 1)]


def complete(env, tokens, **kw) -> httpx.Response:
    r = env.anon.post("/v1/completions", json={"model": MODEL, "prompt": tokens, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r


def served_by(env, r: httpx.Response) -> str:
    rid = r.headers["x-request-id"]
    return env.state.decisions.get(rid).chosen


def test_list_workers_shows_health_model_events_and_cache(admin_env):
    env = admin_env(2)
    env.publish("w1", prompt(1, 3))
    env.publish("w1", prompt(2, 2), medium="CPU")
    r = env.http.get("/admin/workers")
    assert r.status_code == 200
    ws = {w["name"]: w for w in r.json()["workers"]}
    assert set(ws) == {"w1", "w2"}
    w1 = ws["w1"]
    assert w1["healthy"] is True and w1["draining"] is False
    assert w1["model"] == MODEL and w1["models"] == [MODEL]
    assert w1["block_size"] == BLOCK
    assert w1["url"] == env.workers["w1"].url
    assert w1["events"]["connected"] is True
    assert w1["events"]["last_seq"] == 1
    assert w1["events"]["gaps"] == 0
    assert w1["cached_blocks"] == {"GPU": 3, "CPU": 2}
    assert ws["w2"]["cached_blocks"] in ({}, {"GPU": 0, "CPU": 0})
    assert w1["load"]["kv_usage"] == 0.25  # the fake worker's vllm:kv_cache_usage_perc
    one = env.http.get("/admin/workers/w1").json()
    assert one["cached_blocks"] == {"GPU": 3, "CPU": 2}


def test_add_worker_at_run_time_then_remove(admin_env, admin_tokenizer_dir):
    env = admin_env(1)
    extra = LiveWorker("w9", admin_tokenizer_dir)
    try:
        r = env.http.post("/admin/workers", json={"url": extra.url, "name": "w9",
                                                  "events_endpoint": extra.events_endpoint,
                                                  "replay_endpoint": extra.replay_endpoint})
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "w9"
        env.workers["w9"] = extra
        env.wait_healthy("w9")
        env.wait_subscribed("w9")
        # Its events reach the index, and a request whose prefix it holds goes there.
        toks = prompt(9, 4)
        env.publish("w9", toks)
        assert served_by(env, complete(env, toks)) == "w9"
        assert env.http.get("/admin/workers/w9").json()["cached_blocks"]["GPU"] == 4

        # Same name again: 409.
        dup = env.http.post("/admin/workers", json={"url": extra.url, "name": "w9"})
        assert dup.status_code == 409 and dup.json()["error"]["param"] == "name"
        # The same server under another name would be counted twice: 409 too.
        dup = env.http.post("/admin/workers", json={"url": extra.url + "/", "name": "w9-again"})
        assert dup.status_code == 409 and dup.json()["error"]["param"] == "url", dup.text
        assert "w9-again" not in {w["name"] for w in env.http.get("/admin/workers").json()["workers"]}
        # A data-parallel rank's name (<server>@dp<r>: its event stream and index key) is reserved: a worker
        # named so took over the rank's stream and shared its index entries
        dup = env.http.post("/admin/workers", json={"url": "http://127.0.0.1:9", "name": "w9@dp1"})
        assert dup.status_code == 409 and dup.json()["error"]["param"] == "name", dup.text
        # URLs the data path cannot use are refused up front: a port that is no number (the probe raised a
        # ValueError: a 500, and the worker stayed registered), a non-ASCII host (the request line is
        # Latin-1), https (workers are spoken to in plain HTTP)
        for url in ("http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://\u65e5\u672c:8000",
                    "https://127.0.0.1:8000"):
            r = env.http.post("/admin/workers", json={"url": url, "name": "w-bad"})
            assert r.status_code == 422, (url, r.status_code, r.text)
        assert "w-bad" not in {w["name"] for w in env.http.get("/admin/workers").json()["workers"]}

        r = env.http.delete("/admin/workers/w9")
        assert r.status_code == 200 and r.json() == {"removed": "w9"}
        assert "w9" not in {w["name"] for w in env.http.get("/admin/workers").json()["workers"]}
        # Its index entries went with it, and no request goes there any more.
        lookup = env.call(env.state.index.lookup(MODEL, sequence_hashes(toks, BLOCK)))
        assert lookup.match("w9").gpu == 0
        assert served_by(env, complete(env, toks)) == "w1"
        assert env.http.get("/admin/workers/w9").status_code == 404
        assert env.http.delete("/admin/workers/w9").status_code == 404
    finally:
        extra.stop()


def test_drain_stops_new_requests_and_lets_inflight_finish(admin_env):
    env = admin_env(2, worker_kw={"w1": {"first_token_delay_s": 4.0}})
    toks = prompt(3, 4)
    env.publish("w1", toks)  # w1 holds the prefix: it is the one the policy wants
    result: dict = {}

    def slow_request():
        result["r"] = env.anon.post("/v1/completions", json={"model": MODEL, "prompt": toks, "max_tokens": 4})

    t = threading.Thread(target=slow_request)
    t.start()
    until(lambda: env.state.registry.get("w1").inflight == 1, what="request in flight on w1")
    r = env.http.post("/admin/workers/w1/drain")
    assert r.status_code == 200 and r.json()["draining"] is True
    assert r.json()["load"]["inflight"] == 1
    t.join(60)
    assert result["r"].status_code == 200  # the in-flight request finished on w1
    assert served_by(env, result["r"]) == "w1"
    # New requests avoid w1 although it holds the prefix.
    for _ in range(3):
        assert served_by(env, complete(env, toks)) == "w2"
    listed = {w["name"]: w for w in env.http.get("/admin/workers").json()["workers"]}
    assert listed["w1"]["draining"] is True and listed["w1"]["load"]["inflight"] == 0
    r = env.http.post("/admin/workers/w1/undrain")
    assert r.status_code == 200 and r.json()["draining"] is False
    env.workers["w1"].state.first_token_delay_s = 0
    assert served_by(env, complete(env, toks)) == "w1"


def test_worker_bad_inputs(admin_env):
    env = admin_env(1)
    cases = [
        ({"url": "not a url"}, "url"),
        ({"url": "ftp://host:1"}, "url"),
        ({"name": "x"}, "url"),
        ({"url": "http://127.0.0.1:1", "events_endpoint": "http://x"}, "events_endpoint"),
        ({"url": "http://127.0.0.1:1", "bogus": 1}, "bogus"),
        ({"url": "http://127.0.0.1:1", "name": "a/b"}, "name"),
        ({"url": "http://127.0.0.1:1", "name": ""}, "name"),
        ({"url": "http://127.0.0.1:1", "prefetch_url": "tcp://127.0.0.1:8200"}, "prefetch_url"),
        ({"url": "http://127.0.0.1:1", "max_num_batched_tokens": 8}, "max_num_batched_tokens"),
    ]
    for body, param in cases:
        r = env.http.post("/admin/workers", json=body)
        assert r.status_code == 422, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    # Unreachable: accepted, shown unhealthy with the reason, never routed to.
    from tests.support.procs import free_port

    r = env.http.post("/admin/workers", json={"url": f"http://127.0.0.1:{free_port()}", "name": "ghost",
                                              "prefetch_url": "http://127.0.0.1:8201/", "g4_tier": "fs-b",
                                              "max_num_batched_tokens": 4096})  # a workers: entry's keys
    assert r.status_code == 201 and r.json()["healthy"] is False and r.json()["last_error"]
    ghost = env.http.get("/admin/workers/ghost").json()  # its own connector endpoint and G4 tier
    assert ghost["prefetch_url"] == "http://127.0.0.1:8201" and ghost["g4_tier"] == "fs-b"
    assert served_by(env, complete(env, prompt(4, 1))) == "w1"
    assert env.http.delete("/admin/workers/ghost").status_code == 200
    r = env.http.post("/admin/workers", content=b"{not json", headers={"content-type": "application/json"})
    err = r.json()["error"]  # as the data routes answer it (FastAPI's 422 named a character offset as param)
    assert r.status_code == 400 and err["code"] == "invalid_json" and err["param"] is None, r.text
    for method, path in (("POST", "/admin/workers/nope/drain"), ("GET", "/admin/workers/nope"),
                         ("DELETE", "/admin/workers/nope")):
        r = env.http.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def _engine_for_probe(env, worker: str, tokens_of=lambda toks: toks):
    """Play the engine: when the parity probe (a text completion starting "probe <nonce>") reaches the fake
    worker, publish the blocks vLLM would (``tokens_of`` lets a test publish something else, as an engine
    that hashes or tokenizes differently would)."""
    st = env.workers[worker].state

    def run():
        def probe():
            return next((r for r in st.requests if isinstance(r["body"].get("prompt"), str)
                         and r["body"]["prompt"].startswith("probe ")), None)

        req = until(probe, what="the parity probe at the worker")
        r = httpx.post(env.workers[worker].url + "/tokenize",
                       json={"model": MODEL, "prompt": req["body"]["prompt"]}, timeout=30, trust_env=False)
        env.workers[worker].publish(tokens_of(r.json()["tokens"]))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_parity_check(admin_env):
    env = admin_env(2)
    assert env.http.get("/admin/workers/w1").json()["parity"] is None
    t = _engine_for_probe(env, "w1")
    r = env.http.post("/admin/workers/w1/parity")
    t.join(30)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["status"] == "ok", res
    assert res["expected_blocks"] == res["matched_blocks"] >= 4
    assert res["kvgate_tokens"] == res["worker_tokens"] > 0
    w1 = env.http.get("/admin/workers/w1").json()
    assert w1["parity"]["status"] == "ok" and w1["cache_blind"] is False
    # The probe went to w1 only, straight (no routing decision was recorded for it).
    assert len(env.workers["w2"].state.requests) == 0
    assert len(env.state.decisions) == 0

    # An engine whose blocks differ from what the gateway computes: cache-blind, and routing ignores it.
    t = _engine_for_probe(env, "w2", tokens_of=lambda toks: [x + 1 for x in toks])
    r = env.http.post("/admin/workers/w2/parity")
    t.join(30)
    res = r.json()
    assert res["status"] == "cache-blind" and res["matched_blocks"] == 0, res
    listed = {w["name"]: w for w in env.http.get("/admin/workers").json()["workers"]}
    assert listed["w2"]["cache_blind"] is True and listed["w1"]["cache_blind"] is False
    from tests.admin.test_metrics import scrape, value

    fams = scrape(env)
    assert value(fams, "kvgate_worker_cache_blind", worker="w2") == 1
    assert value(fams, "kvgate_worker_cache_blind", worker="w1") == 0
    assert env.http.post("/admin/workers/nope/parity").status_code == 404


# The tiny tokenizer's template (tests/support/tiny_tokenizer.py) with a space after each role instead of
# a newline: the same tokenizer, other chat tokens -- what a worker started with its own --chat-template is.
OTHER_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_parity_catches_a_worker_with_another_chat_template(admin_env):
    """w2 renders chat with its own template: its completions parity is ok (same tokenizer, same blocks),
    but the chat probe's token ids differ from the worker's /tokenize, so the admin API marks it chat
    cache-blind and shows where the ids part; w1, with the model's template, is ok for both."""
    from tests.admin.test_metrics import scrape, value

    env = admin_env(2, worker_kw={"w2": {"chat_template": OTHER_TEMPLATE}})
    for name in ("w1", "w2"):
        t = _engine_for_probe(env, name)
        r = env.http.post(f"/admin/workers/{name}/parity")
        t.join(30)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    listed = {w["name"]: w for w in env.http.get("/admin/workers").json()["workers"]}
    ok, other = listed["w1"], listed["w2"]
    assert ok["parity"]["chat"]["status"] == "ok" and ok["chat_cache_blind"] is False, ok["parity"]
    assert ok["parity"]["chat"]["kvgate_tokens"] == ok["parity"]["chat"]["worker_tokens"] > 20
    chat = other["parity"]["chat"]
    assert chat["status"] == "cache-blind" and other["chat_cache_blind"] is True, chat
    assert other["cache_blind"] is False  # completions routing stays cache-aware
    first = chat["first_mismatch"]
    # Both renderings start "<|im_start|>system" and part right after the role: newline vs space.
    hf = env.state.tokenizers.for_model(MODEL).hf
    assert first["index"] == len(hf("<|im_start|>system", add_special_tokens=False)["input_ids"]) > 0
    assert first["kvgate_token"] != first["worker_token"]
    assert first["kvgate_text"].startswith("\n") and first["worker_text"].startswith(" ")
    assert f"from token {first['index']} on" in chat["reason"]
    fams = scrape(env)
    assert value(fams, "kvgate_worker_chat_cache_blind", worker="w2") == 1
    assert value(fams, "kvgate_worker_chat_cache_blind", worker="w1") == 0
    assert value(fams, "kvgate_worker_cache_blind", worker="w2") == 0


def test_a_chat_cache_blind_worker_gets_no_predicted_hit_for_chat_but_keeps_it_for_completions(admin_env):
    """After the chat probe catches w2's other template, the index's blocks on w2 no longer count for a
    chat request; for a completion on the same tokens they still do."""
    env = admin_env(2, worker_kw={"w2": {"chat_template": OTHER_TEMPLATE}})
    t = _engine_for_probe(env, "w2")
    assert env.http.post("/admin/workers/w2/parity").json()["chat"]["status"] == "cache-blind"
    t.join(30)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "tell me about caches " * 40}]}
    toks = list(env.call(env.state.tokenizers.tokenize(MODEL, "chat", chat, size=0)).tokens)
    env.publish("w2", toks)

    def local(body, path):
        ex = env.http.post("/admin/explain", json={"body": body, "path": path}).json()
        return next(c for c in ex["candidates"] if c["worker"] == "w2")["local_blocks"]

    assert local(chat, "/v1/chat/completions") == 0
    completion = {"model": MODEL, "prompt": toks, "max_tokens": 1}
    assert local(completion, "/v1/completions") == len(toks[:-1]) // BLOCK > 0


def test_parity_of_a_worker_without_events_and_of_a_hanging_one(admin_env, admin_tokenizer_dir):
    """No event source: "no-events" at once, no probe sent. A worker that never answers the probe: the
    answer still comes, unverified, bounded by health_timeout_s (the request's own timeout is 30 s)."""
    from tests.admin.conftest import LiveWorker

    env = admin_env(1, health_timeout_s=1.0)
    quiet = LiveWorker("quiet", admin_tokenizer_dir)
    try:
        r = env.http.post("/admin/workers", json={"url": quiet.url, "name": "quiet"})  # no events endpoint
        assert r.status_code == 201, r.text
        env.wait_healthy("quiet")
        r = env.http.post("/admin/workers/quiet/parity", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "no-events", r.text
        assert quiet.state.requests == [] and r.json()["attempts"] == 0
        env.workers["w1"].state.first_token_delay_s = 20  # the probe's answer would take 20 s
        r = env.http.post("/admin/workers/w1/parity", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "unverified", r.text
        assert "within 1 s" in r.json()["reason"]
    finally:
        env.workers["w1"].state.first_token_delay_s = 0
        quiet.stop()
