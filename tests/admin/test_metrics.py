"""``/metrics`` scraped over HTTP after real traffic and parsed by prometheus-client's own parser."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.admin.conftest import BLOCK, MODEL, until
from tests.admin.test_workers import prompt

STAGES = ("tokenize", "hash", "lookup", "decide")


def scrape(env) -> dict[str, list]:
    r = env.anon.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert all(name.startswith("kvgate_") for name in fams), sorted(fams)
    return fams


def value(fams, family: str, sample: str | None = None, **labels) -> float:
    """Sum of the samples of ``family`` (named ``sample``, default the family's own) matching ``labels``."""
    fam = fams[family]
    name = sample or fam.name
    return sum(s.value for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_after_traffic(admin_env):
    env = admin_env(2)
    hot = prompt(41, 4)
    env.publish("w1", hot)
    env.publish("w2", prompt(42, 3), medium="CPU")
    env.publish("w2", prompt(43, 2), medium="STORAGE")
    body = {"model": MODEL, "prompt": hot, "max_tokens": 4}

    rids = []
    for _ in range(3):
        r = env.anon.post("/v1/completions", json=body)
        assert r.status_code == 200
        rids.append(r.headers["x-request-id"])
    # Two streamed requests (the gateway measures TTFT on streams).
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    for _ in range(2):
        with env.anon.stream("POST", "/v1/completions", json=streamed) as r:
            assert r.status_code == 200
            chunks = list(r.iter_lines())
            assert chunks[-2:] == ["data: [DONE]", ""] or chunks[-1] == "data: [DONE]"
        rids.append(r.headers["x-request-id"])
    # One request to a failing worker holding the prefix: retried once on the other.
    retry_prompt = prompt(44, 4)
    env.publish("w2", retry_prompt)
    env.workers["w2"].state.mode = "error500"
    r = env.anon.post("/v1/completions", json={"model": MODEL, "prompt": retry_prompt, "max_tokens": 2})
    assert r.status_code == 200
    rids.append(r.headers["x-request-id"])
    env.workers["w2"].state.mode = "ok"
    decisions = [env.state.decisions.get(rid) for rid in rids]
    assert [d.chosen for d in decisions] == ["w1"] * 6
    assert decisions[-1].attempts == ["w2", "w1"]

    fams = scrape(env)
    n = len(rids)
    # Requests by model, worker, policy, outcome.
    assert value(fams, "kvgate_requests", "kvgate_requests_total", model=MODEL, worker="w1", policy="kv",
                 outcome="ok") == n
    assert value(fams, "kvgate_requests", "kvgate_requests_total") == n
    # Routing overhead histogram, one observation per request and stage.
    for stage in STAGES:
        assert value(fams, "kvgate_routing_overhead_seconds", "kvgate_routing_overhead_seconds_count",
                     stage=stage) == n
        assert value(fams, "kvgate_routing_overhead_seconds", "kvgate_routing_overhead_seconds_sum",
                     stage=stage) > 0
    # Predicted vs delivered cached tokens equal what the decisions recorded.
    predicted = sum(d.predicted_cached_tokens for d in decisions)
    delivered = sum(d.delivered_cached_tokens or 0 for d in decisions)
    # The five hot requests predicted their 4-block prefix on w1; the retried one is accounted on w1 too,
    # which did not hold its prefix.
    assert predicted == 5 * 4 * BLOCK
    assert value(fams, "kvgate_predicted_cached_tokens", "kvgate_predicted_cached_tokens_total",
                 model=MODEL) == predicted
    assert value(fams, "kvgate_delivered_cached_tokens", "kvgate_delivered_cached_tokens_total",
                 model=MODEL) == delivered
    assert delivered == 4 * 4 * BLOCK  # the fake worker had the hot prefix from the 2nd request on
    assert value(fams, "kvgate_prompt_tokens", "kvgate_prompt_tokens_total", model=MODEL) == sum(
        d.prompt_tokens for d in decisions if d.prompt_tokens)
    assert 0 < value(fams, "kvgate_cache_hit_rate", model=MODEL) < 1
    # TTFT seen by the gateway: the two streams.
    assert value(fams, "kvgate_ttft_seconds", "kvgate_ttft_seconds_count", model=MODEL, worker="w1") == 2
    # Nothing in flight after the responses.
    assert value(fams, "kvgate_inflight_requests", worker="w1") == 0
    assert value(fams, "kvgate_inflight_requests", worker="w2") == 0
    # Index size per tier.
    assert value(fams, "kvgate_index_blocks", model=MODEL, tier="GPU") == 8
    assert value(fams, "kvgate_index_blocks", model=MODEL, tier="CPU") == 3
    assert value(fams, "kvgate_index_blocks", model=MODEL, tier="G4") == 2
    # KV events per worker, as the ingestor counted them.
    statuses = env.state.ingestor.statuses()
    for w in ("w1", "w2"):
        assert value(fams, "kvgate_events_applied", "kvgate_events_applied_total", worker=w) == \
            statuses[w]["applied"] > 0
        assert value(fams, "kvgate_events_dropped", "kvgate_events_dropped_total", worker=w) == 0
        assert "kvgate_events_replays" in fams
    # Worker health, retries, prefetch orders.
    assert value(fams, "kvgate_worker_healthy", worker="w1") == 1
    assert value(fams, "kvgate_retries", "kvgate_retries_total", model=MODEL, reason="upstream_500") == 1
    assert "kvgate_prefetch_orders" in fams

    # Admin gauges: events connected, draining.
    assert value(fams, "kvgate_events_connected", worker="w1") == 1
    assert value(fams, "kvgate_worker_draining", worker="w2") == 0
    assert env.http.post("/admin/workers/w2/drain").status_code == 200
    assert value(scrape(env), "kvgate_worker_draining", worker="w2") == 1

    # A worker failing its health checks shows as 0.
    env.workers["w2"].state.mode = "unhealthy"
    until(lambda: not env.state.registry.get("w2").healthy, what="w2 unhealthy")
    fams = scrape(env)
    assert value(fams, "kvgate_worker_healthy", worker="w2") == 0
    assert value(fams, "kvgate_worker_healthy", worker="w1") == 1


def test_malformed_events_are_counted_as_dropped(admin_env):
    env = admin_env(1)
    env.publish("w1", prompt(51, 2))
    env.workers["w1"].pub.publish([], raw_payload=b"\xc1 not msgpack")
    until(lambda: env.state.ingestor.statuses()["w1"]["dropped"] == 1, what="the bad batch dropped")
    fams = scrape(env)
    assert value(fams, "kvgate_events_dropped", "kvgate_events_dropped_total", worker="w1") == 1
    w1 = env.http.get("/admin/workers/w1").json()
    assert w1["events"]["dropped"] == 1 and w1["healthy"] is True


def test_openapi_documents_the_admin_api(admin_env):
    env = admin_env(1)
    spec = httpx.get(env.url + "/openapi.json", timeout=30, trust_env=False).json()
    paths = spec["paths"]
    expected = {
        ("/admin/workers", "get"): "WorkerList", ("/admin/workers", "post"): "WorkerOut",
        ("/admin/workers/{name}", "delete"): "WorkerRemoved",
        ("/admin/workers/{name}/drain", "post"): "WorkerOut",
        ("/admin/index", "get"): "IndexStats", ("/admin/index/{model}", "delete"): "Flushed",
        ("/admin/explain", "post"): "Explanation", ("/admin/blocks/{model}/{block_hash}", "get"): "BlockOut",
        ("/admin/decisions", "get"): "DecisionList", ("/admin/g4", "get"): "G4Stats",
    }
    for (path, method), schema in expected.items():
        op = paths[path][method]
        ok = next(v for k, v in op["responses"].items() if k.startswith("2"))
        assert ok["content"]["application/json"]["schema"]["$ref"].endswith("/" + schema), (path, method)
    assert "ExplainRequest" in spec["components"]["schemas"]
    assert "CandidateOut" in spec["components"]["schemas"]
    # Errors: the OpenAI shape every error is answered in, 422 included (FastAPI's own 422 body was
    # declared, which this gateway never sends), and the statuses each route answers besides.
    comps = spec["components"]["schemas"]
    assert "HTTPValidationError" not in comps
    detail = comps["ErrorBody"]["properties"]["error"]["$ref"].rsplit("/", 1)[1]
    assert set(comps[detail]["properties"]) == {"message", "type", "param", "code"}
    for path, ops in paths.items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if status[0] in "45":
                    assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody"), \
                        (path, method, status)
            if path.startswith("/admin"):
                assert {"401", "403"} <= set(op["responses"]), (path, method)
    for (path, method), statuses in {
        ("/admin/workers", "post"): {"400", "409", "422"}, ("/admin/workers/{name}", "get"): {"404"},
        ("/admin/index/{model}", "delete"): {"409", "503"}, ("/admin/explain", "post"): {"400", "404", "503"},
        ("/admin/blocks/{model}/{block_hash}", "get"): {"400", "503"}, ("/admin/g4/{model}/gc", "post"):
            {"400", "409", "503"},
    }.items():
        assert statuses <= set(paths[path][method]["responses"]), (path, method)
    bad = env.http.post("/admin/workers", json={"url": "not a url"})  # a real 422 has the declared shape
    assert bad.status_code == 422 and set(bad.json()) == {"error"}
    assert set(bad.json()["error"]) == set(comps[detail]["properties"])


def test_tokenize_cache_metrics(admin_env):
    """Two text prompts over one long document: the second reuses the first's ids, and /metrics says so.
    Deferred tokenization is off: the fake worker announces no blocks, so the document would be encoded
    only as far as its first stage (that path has its own tests in tests/gateway/test_tokenize.py)."""
    env = admin_env(1, tokenizer={"defer_tail_bytes": 0})
    doc = "The gateway keeps every tokenized text with its block hashes. " * 200
    fams0 = scrape(env)
    rids = []
    for q in ("What does it keep?", "Why does it keep it?"):
        r = env.anon.post("/v1/completions", json={"model": MODEL, "prompt": doc + q, "max_tokens": 2})
        assert r.status_code == 200
        rids.append(r.headers["x-request-id"])
    first, second = (env.state.decisions.get(rid) for rid in rids)
    assert first.reused_bytes == 0 and second.reused_bytes >= len(doc) - 256 and second.new_bytes < 300
    fams = scrape(env)

    def grew(name: str) -> float:
        return (value(fams, f"kvgate_tokenize_cache_{name}", f"kvgate_tokenize_cache_{name}_total", model=MODEL)
                - value(fams0, f"kvgate_tokenize_cache_{name}", f"kvgate_tokenize_cache_{name}_total", model=MODEL))

    assert grew("hits") >= 1 and grew("misses") >= 1
    assert grew("reused_bytes") >= len(doc) - 256
    assert value(fams, "kvgate_tokenize_cache_bytes", model=MODEL) > 2 * len(doc)
    assert 0 < value(fams, "kvgate_tokenize_cache_hit_ratio", model=MODEL) <= 1
    assert value(fams, "kvgate_tokenize_cache_mismatches", "kvgate_tokenize_cache_mismatches_total",
                 model=MODEL) == 0
    # small chats: the repeated system prompt comes from the segment memo, the new message is encoded
    for q in ("first question", "second question"):
        r = env.anon.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": q}]})
        assert r.status_code == 200
    fams2 = scrape(env)
    assert value(fams2, "kvgate_tokenize_cache_segment_reused_chars",
                 "kvgate_tokenize_cache_segment_reused_chars_total", model=MODEL) > len("You are a terse assistant.")
    assert value(fams2, "kvgate_tokenize_cache_segment_encoded_chars",
                 "kvgate_tokenize_cache_segment_encoded_chars_total", model=MODEL) >= len("second question")
    assert value(fams2, "kvgate_tokenize_cache_segment_bytes", model=MODEL) > 0


def test_event_loop_lag_shows_a_stall(admin_env):
    """``kvgate_event_loop_lag_seconds``: a 0.4 s block of the gateway's event loop (a stand-in for a
    blocking call in a handler) is seen as one late timer of at least 0.25 s; an idle loop's timers are not
    late by that much."""
    import time

    env = admin_env(1, loop_lag_interval_s=0.05)
    until(lambda: value(scrape(env), "kvgate_event_loop_lag_seconds", "kvgate_event_loop_lag_seconds_count") >= 5,
          what="lag samples")

    def late(fams) -> float:  # samples above 0.25 s
        return (value(fams, "kvgate_event_loop_lag_seconds", "kvgate_event_loop_lag_seconds_count")
                - value(fams, "kvgate_event_loop_lag_seconds", "kvgate_event_loop_lag_seconds_bucket", le="0.25"))

    before = late(scrape(env))

    async def block():
        time.sleep(0.4)

    env.call(block())
    until(lambda: late(scrape(env)) >= before + 1, what="the stall counted")
    assert value(scrape(env), "kvgate_event_loop_lag_seconds", "kvgate_event_loop_lag_seconds_sum") >= 0.3


def test_a_removed_workers_series_leave_metrics(admin_env):
    """Every metric labelled by worker drops a removed worker's series (only the in-flight gauge did: with
    Kubernetes discovery, a name per pod, the others grew with every rollout)."""
    env = admin_env(2)
    hot = prompt(51, 4)
    env.publish("w1", hot)
    streamed = {"model": MODEL, "prompt": hot, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
    for _ in range(2):
        with env.anon.stream("POST", "/v1/completions", json=streamed) as r:
            assert r.status_code == 200
            list(r.iter_lines())

    def labelled_w1(fams) -> set[str]:
        return {f.name for f in fams.values() for s in f.samples if s.labels.get("worker") == "w1"}

    before = labelled_w1(scrape(env))
    assert {"kvgate_requests", "kvgate_ttft_seconds"} <= before, before
    assert env.http.delete("/admin/workers/w1").status_code == 200
    assert labelled_w1(scrape(env)) == set()
