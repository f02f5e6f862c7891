"""Data-parallel workers: a vLLM server started with ``--data-parallel-size N`` fronts N engines behind
one port, each with its own KV cache and its own event stream (rank r on the events port + r), and takes
``X-data-parallel-rank: r`` to pin a request. The gateway subscribes every rank, indexes each under
``<server>@dp<r>``, and sends a request to the rank that holds its prefix, with the header.

The worker is the fake vLLM HTTP surface (tests/support/fake_worker.py) playing a 2-rank server: one
prefix cache and one real ZMQ publisher (bench.sim.vllm_format.EventPublisher, vLLM's wire format) per
rank. Real vLLM with two ranks: tests/e2e_dp/test_vllm_dp.py."""
from __future__ import annotations

import httpx

from bench.sim.vllm_format import EventPublisher
from router.config import IndexConfig
from tests.gateway.conftest import MODEL
from tests.gateway.test_proxy import LONG, chat_body, wait_until

CHAT = "/v1/chat/completions"


def _pubs(n: int) -> list[EventPublisher]:
    return [EventPublisher("tcp://*:0", "tcp://127.0.0.1:0") for _ in range(n)]


def _gateway(start_gateway, fleet, redis_url):
    # The index lookup's deadline is generous: on a shared machine a slow lookup would route cache-blind.
    return start_gateway(fleet, events=True,
                         index=IndexConfig(backend="redis", redis_url=redis_url, lookup_timeout_s=5.0))


def _next_turn(body: dict, i: int = 0) -> dict:
    return dict(body, messages=body["messages"] + [{"role": "assistant", "content": f"reply {i}"},
                                                   {"role": "user", "content": f"and then {i}?"}])


def _local_blocks(gw, body: dict) -> dict[str, int]:
    """What the index says each candidate holds of ``body``'s prompt (the routing view)."""
    d = gw.call(gw.state.router.plan(MODEL, body, {}, CHAT))
    return {c.worker: c.local_blocks for c in d.candidates}


async def test_each_rank_is_indexed_and_pinned(fleet, start_gateway, redis_url):
    """Two conversations warmed directly on rank 0 and rank 1 of worker ``a`` (as another client would)
    reach the index under ``a@dp0`` and ``a@dp1`` only; each follow-up through kvgate goes to its own rank,
    with ``X-data-parallel-rank``, and hits there. Worker ``b`` (one rank) keeps its plain name as its
    index key and gets no header."""
    pubs = _pubs(3)
    try:
        a = fleet.add("a", dp_publishers=pubs[:2])
        b = fleet.add("b", publisher=pubs[2])
        gw = _gateway(start_gateway, fleet, redis_url)
        await wait_until(lambda: set(gw.state.ingestor.statuses()) == {"a@dp0", "a@dp1", "b"}, timeout=30)
        convs = {"a@dp0": chat_body("first topic " + LONG), "a@dp1": chat_body("second topic " + LONG)}
        async with httpx.AsyncClient(timeout=30) as c:
            for target, body in convs.items():  # warm each rank directly, pinned
                r = await c.post(fleet.url(0) + CHAT, json=body,
                                 headers={"X-data-parallel-rank": target[-1]})
                assert r.status_code == 200
            for target, body in convs.items():
                await wait_until(lambda: _local_blocks(gw, body)[target] > 0, timeout=30)
                held = _local_blocks(gw, body)
                other = "a@dp1" if target == "a@dp0" else "a@dp0"
                assert held[other] == 0 and held["b"] == 0, held
            for i, (target, body) in enumerate(convs.items()):
                turn = _next_turn(body, i)
                r = await c.post(gw.url + CHAT, json=turn, headers={"x-request-id": f"dp{i}"})
                assert r.status_code == 200
                assert r.headers["x-kvgate-worker"] == target
                sent = a.requests[-1]
                assert sent["headers"].get("x-data-parallel-rank") == target[-1]
                assert sent["rank"] == int(target[-1])
                delivered = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert 0 < int(r.headers["x-kvgate-cached-tokens"]) <= delivered
                d = (await c.get(gw.url + f"/admin/decisions/dp{i}")).json()
                assert d["chosen"] == target
                assert {x["worker"] for x in d["candidates"]} == {"a@dp0", "a@dp1", "b"}

            # The one-rank worker: its stream keeps the worker's name, and nothing pins a rank there.
            solo = chat_body("third topic " + LONG)
            assert (await c.post(fleet.url(1) + CHAT, json=solo)).status_code == 200
            await wait_until(lambda: _local_blocks(gw, solo)["b"] > 0, timeout=30)
            r = await c.post(gw.url + CHAT, json=_next_turn(solo))
            assert r.headers["x-kvgate-worker"] == "b"
            assert "x-data-parallel-rank" not in b.requests[-1]["headers"]

            workers = {w["name"]: w for w in (await c.get(gw.url + "/admin/workers")).json()["workers"]}
        assert set(workers) == {"a", "b"} and workers["b"]["ranks"] == []
        ranks = {r["name"]: r for r in workers["a"]["ranks"]}
        assert set(ranks) == {"a@dp0", "a@dp1"} and [r["dp_rank"] for r in ranks.values()] == [0, 1]
        assert all(r["events"]["applied"] >= 1 and r["cached_blocks"]["GPU"] > 0 for r in ranks.values())
        assert workers["a"]["cached_blocks"]["GPU"] == sum(r["cached_blocks"]["GPU"] for r in ranks.values())
    finally:
        for p in pubs:
            p.close()


async def test_rank_load_comes_from_its_engine_series(fleet, start_gateway, redis_url):
    """vLLM labels each rank's gauges ``engine="r"``: a long queue on rank 0 sends a new prompt to rank 1."""
    pubs = _pubs(2)
    try:
        fleet.add("a", dp_publishers=pubs, dp_waiting=[40, 0])
        gw = _gateway(start_gateway, fleet, redis_url)
        reg = gw.state.registry
        await wait_until(lambda: (t := reg.target("a@dp0")) is not None and t.load.waiting == 40, timeout=30)
        assert reg.target("a@dp1").load.waiting == 0 and reg.get("a").load.waiting == 40
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(gw.url + CHAT, json=chat_body("fresh " + LONG))
        assert r.headers["x-kvgate-worker"] == "a@dp1"
    finally:
        for p in pubs:
            p.close()


async def test_odd_sources_never_take_the_good_ranks_out(fleet, start_gateway, redis_url):
    """``/kv_event_sources`` with a rank whose endpoint cannot be subscribed, one without an endpoint and
    a key that is no rank: the registry raises nothing, lists what it left out, and rank 0's stream still
    drives routing; the ranks without a stream stay routable by load."""
    pub = _pubs(1)[0]
    try:
        good = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "", "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint}
        a = fleet.add("a", dp_publishers=[pub, None, None], sources={
            "0": good, "1": {"enable_kv_cache_events": True, "endpoint": "bogus://nowhere"},
            "2": {"enable_kv_cache_events": True, "endpoint": None}, "engine": 5})
        gw = _gateway(start_gateway, fleet, redis_url)
        reg = gw.state.registry
        await wait_until(lambda: (w := reg.get("a")) is not None and w.healthy and len(w.ranks) == 3,
                         timeout=30)
        w = reg.get("a")
        assert {(s["rank"], s["reason"]) for s in w.skipped_sources} == {(2, "no endpoint"),
                                                                       ("engine", "not a data-parallel rank")}
        await wait_until(lambda: gw.state.ingestor.statuses().get("a@dp0", {}).get("connected"), timeout=30)
        body = chat_body("odd topic " + LONG)
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.post(fleet.url(0) + CHAT, json=body, headers={"X-data-parallel-rank": "0"})
                    ).status_code == 200
            await wait_until(lambda: _local_blocks(gw, body)["a@dp0"] > 0, timeout=30)
            r = await c.post(gw.url + CHAT, json=_next_turn(body))
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "a@dp0"
            assert a.requests[-1]["headers"]["x-data-parallel-rank"] == "0"
            assert {t.name for t in reg.candidates(MODEL)} == {"a@dp0", "a@dp1", "a@dp2"}
            listed = (await c.get(gw.url + "/admin/workers/a")).json()
        assert [r["name"] for r in listed["ranks"]] == ["a@dp0", "a@dp1", "a@dp2"]
        assert len(listed["skipped_sources"]) == 2
    finally:
        pub.close()


def test_odd_source_lists_are_read_without_raising():
    """Whatever ``/kv_event_sources`` answers, reading it raises nothing: ranks with a usable endpoint
    get a source (``*`` replaced by the worker's host), others are listed as skipped."""
    from router.config import Settings, WorkerConfig
    from router.registry import WorkerRegistry
    from router.worker import Worker

    reg = WorkerRegistry(Settings(), index=None)
    ok = {"endpoint": "tcp://*:5611", "replay_endpoint": 7, "topic": None}
    cases = {
        "null": (None, [], 1), "list": ([ok], [], 1), "text": ("x", [], 1), "empty": ({}, [], 0),
        "one rank": ({"0": ok}, [], 0),
        "odd values": ({"0": "tcp://*:1", "1": {"endpoint": 5}, "-1": ok, "01x": ok}, ["w@dp0", "w@dp1"], 4),
        "three ranks": ({"1": dict(ok, endpoint="tcp://*:5612"), "0": ok,
                       "2": {"enable_kv_cache_events": False}}, ["w@dp0", "w@dp1", "w@dp2"], 1),
    }
    for what, (data, ranks, skipped) in cases.items():
        w = Worker(name="w", url="http://10.0.0.9:8000", config=WorkerConfig(url="http://10.0.0.9:8000"))
        reg._set_sources(w, data)
        assert [t.name for t in w.ranks] == ranks and len(w.skipped_sources) == skipped, what
        if what == "three ranks":
            assert [s["endpoint"] for s in w.event_sources] == ["tcp://10.0.0.9:5611", "tcp://10.0.0.9:5612"]
            assert w.ranks[2].event_sources == []  # events off: routed by load only
            assert w.ranks[1].pin({"X-Data-Parallel-Rank": "0"}) == {"x-data-parallel-rank": "1"}
            assert reg.target("w@dp1") is w.ranks[1] and reg.get("w@dp1") is w


def test_a_source_list_naming_too_many_ranks_is_read_up_to_the_bound():
    """A malformed or hostile ``/kv_event_sources`` naming thousands of ranks: each rank read became a
    routing target with an event subscription and its own parse of every scrape, each left-out key a line
    of ``skipped_sources``. Only the first ``MAX_DP_RANKS`` entries are read; the rest is one line."""
    from router.config import Settings, WorkerConfig
    from router.registry import MAX_DP_RANKS, WorkerRegistry
    from router.worker import Worker

    reg = WorkerRegistry(Settings(), index=None)
    for data in ({str(r): {"endpoint": f"tcp://*:{5000 + r}"} for r in range(MAX_DP_RANKS + 4000)},
                 {f"x{r}": {} for r in range(MAX_DP_RANKS + 4000)}):
        w = Worker(name="w", url="http://10.0.0.9:8000", config=WorkerConfig(url="http://10.0.0.9:8000"))
        reg._set_sources(w, data)
        assert len(w.ranks) in (0, MAX_DP_RANKS) and len(w.event_sources) <= MAX_DP_RANKS
        assert len(w.skipped_sources) <= MAX_DP_RANKS + 1
        assert w.skipped_sources[-1] == {"rank": None, "reason": f"4000 more entries not read (at most "
                                                                 f"{MAX_DP_RANKS})"}


def test_a_rank_no_longer_listed_loses_its_metric_series():
    """Ranks dropped from ``/kv_event_sources`` (a server restarted with fewer) left the routing targets but
    kept their Prometheus series (and parity verdicts) for good: removing the worker later forgot only the
    ranks it still had."""
    from router.config import Settings, WorkerConfig
    from router.metrics import GatewayMetrics
    from router.registry import WorkerRegistry
    from router.worker import Worker

    metrics = GatewayMetrics()
    reg = WorkerRegistry(Settings(), index=None, metrics=metrics)
    removed = []
    reg.on_removed = removed.append
    w = Worker(name="w", url="http://10.0.0.9:8000", config=WorkerConfig(url="http://10.0.0.9:8000"))
    src = {"endpoint": "tcp://*:5611"}

    def series() -> set[str]:
        return {s.labels["worker"] for fam in metrics.registry.collect() for s in fam.samples
                if "worker" in s.labels}

    reg._set_sources(w, {"0": src, "1": src, "2": src})
    for t in w.ranks:
        metrics.child(metrics.inflight, t.name).set(1)
        metrics.child(metrics.ttft, MODEL, t.name).observe(0.1)
    assert series() == {"w@dp0", "w@dp1", "w@dp2"}
    reg._set_sources(w, {"0": src, "1": src})
    assert series() == {"w@dp0", "w@dp1"} and removed == ["w@dp2"]
    reg._set_sources(w, {"0": src, "1": src})  # listed again: nothing more goes
    assert series() == {"w@dp0", "w@dp1"} and removed == ["w@dp2"]
    reg._set_sources(w, {"0": src})  # one rank: the server is the target, under its own name
    assert series() == set() and removed == ["w@dp2", "w@dp0", "w@dp1"]
