"""A response the gateway has no owner record of is looked up on the fleet (router/apis/routes.py
``_locate``). vLLM keeps a stored response in the one server that made it; the gateway learns the owner
from the responses passing through it. With ``kvgate serve --workers N`` on the in-memory store each process
has its own records, so a GET, cancel or delete of a response, or a follow-up with ``previous_response_id``,
reaching a process that did not serve it was a 404 ``response_not_found`` (as after a gateway restart, or a
record lost from Redis) while the worker still held the response. Now the workers are asked
(``GET /v1/responses/{id}``: vLLM answers 404 where it does not hold it): the one holding it is the owner,
recorded, and the request goes there. The workers are the fake ones (tests/support/fake_worker.py: its
``stored`` responses answer that GET)."""
from __future__ import annotations

import time

import httpx
import pytest

from router.config import IndexConfig
from tests.gateway.conftest import MODEL
from tests.gateway.test_apis_gateway import openai_error


def stored(rid: str, model: str = MODEL) -> dict:
    return {"id": rid, "object": "response", "model": model, "status": "completed",
            "output": [{"type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "earlier"}]}]}


def owner_of(gw, rid: str) -> dict | None:
    return gw.call(gw.state.owners.get(rid))


def follow_up(prev: str, input: str = "x", **kw) -> dict:
    return {"model": MODEL, "input": input, "previous_response_id": prev, **kw}


def test_a_get_by_id_without_a_record_reaches_the_worker_that_holds_it_and_keeps_it(fleet, start_gateway):
    fleet.add("a")
    b = fleet.add("b")
    b.stored["resp_x"] = stored("resp_x")
    gw = start_gateway(fleet)
    assert owner_of(gw, "resp_x") is None
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.get("/v1/responses/resp_x")
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b", r.text
        assert r.json()["id"] == "resp_x"
        assert owner_of(gw, "resp_x") == {"worker": "b", "model": MODEL, "parent": None, "delta": None}
        asked_a, asked_b = len(fleet.states[0].lookups), len(b.lookups)
        assert asked_b == 2  # asked, then the client's GET forwarded
        # the record is kept: the next GET goes straight to b, nobody else is asked
        r = c.get("/v1/responses/resp_x")
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b"
        assert len(fleet.states[0].lookups) == asked_a and len(b.lookups) == 3
        # a DELETE confirmed by the owner forgets it; asked again, no worker holds it any more
        r = c.delete("/v1/responses/resp_x")
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b"
        assert owner_of(gw, "resp_x") is None
        openai_error(c.get("/v1/responses/resp_x"), 404, "response_not_found")


def test_a_follow_up_without_a_record_is_pinned_to_the_worker_that_holds_it(fleet, start_gateway):
    """The located record has no history (no parent, no turn): the follow-up is pinned to the owner and
    routed on load, never a 500; the chain goes on from there, and a follow-up naming no model continues
    with the stored response's."""
    fleet.add("a", responses=True)
    b = fleet.add("b", responses=True)
    b.stored["resp_y"] = stored("resp_y")
    gw = start_gateway(fleet)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        r = c.post("/v1/responses", json=follow_up("resp_y", "and then?"))
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b", r.text
        assert b.requests[-1]["body"]["previous_response_id"] == "resp_y"
        assert owner_of(gw, "resp_y")["worker"] == "b"
        nxt = r.json()["id"]
        assert owner_of(gw, nxt)["parent"] == "resp_y"
        # the chain [nxt, resp_y] cannot be rebuilt (resp_y's turn is unknown): still pinned, no 500
        r = c.post("/v1/responses", json=follow_up(nxt, "more"))
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b", r.text
        b.stored["resp_z"] = stored("resp_z")
        r = c.post("/v1/responses", json={"input": "no model named", "previous_response_id": "resp_z"})
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "b", r.text
        assert b.requests[-1]["body"]["previous_response_id"] == "resp_z"
    assert fleet.states[0].requests == []


def test_an_id_no_worker_holds_is_404_and_every_worker_was_asked(fleet, start_gateway):
    a, b = fleet.add("a"), fleet.add("b")
    gw = start_gateway(fleet)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for r in (c.get("/v1/responses/resp_nope"), c.post("/v1/responses/resp_nope/cancel"),
                  c.delete("/v1/responses/resp_nope"),
                  c.post("/v1/responses", json=follow_up("resp_nope")),
                  # ids vLLM could never have made: asked with the id quoted, or not asked at all
                  c.get("/v1/responses/a%20b%3F%23c"), c.get("/v1/responses/" + "r" * 600),
                  c.post("/v1/responses", json=follow_up("x/../y\r\nz"))):
            openai_error(r, 404, "response_not_found")
        assert a.lookups[:4] == b.lookups[:4] == ["resp_nope"] * 4
        assert "a b?#c" in a.lookups and not any(len(i) > 512 for i in a.lookups)
        # a worker seen gone (its port refused connections) holds nothing any more: it is not asked
        gw.state.registry.get("b").down = True
        n = len(b.lookups)
        openai_error(c.get("/v1/responses/resp_other"), 404, "response_not_found")
        assert len(b.lookups) == n and a.lookups[-1] == "resp_other"
    assert a.requests == [] and b.requests == []  # nothing was forwarded


def test_a_worker_whose_port_refuses_connections_holds_nothing(fleet, start_gateway):
    """Nothing listens where a worker was (its process gone, not yet seen down by the health checks, which
    are far apart here): no process, no stored response. The id is a 404, not a 503."""
    a = fleet.add("a")
    fleet.add("b")
    gw = start_gateway(fleet, health_interval_s=60)
    fleet.servers[1].stop()
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        openai_error(c.get("/v1/responses/resp_nope"), 404, "response_not_found")
    assert not gw.state.registry.get("b").down and a.lookups == ["resp_nope"]


def test_a_follow_up_asks_only_the_workers_of_its_model(fleet, start_gateway):
    a, b = fleet.add("a"), fleet.add("b")
    b.model = "other"
    gw = start_gateway(fleet)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        openai_error(c.post("/v1/responses", json=follow_up("resp_q")),
                     404, "response_not_found")
    assert a.lookups == ["resp_q"] and b.lookups == []


@pytest.mark.parametrize("failure", ["error", "timeout"])
def test_a_worker_that_cannot_be_asked_makes_an_unlocated_response_a_503(fleet, start_gateway, failure):
    """Unanswered (a 5xx, or no answer within the control timeout) it may be the owner: 503, retryable, not
    a 404; the owner found elsewhere is served all the same."""
    a, b = fleet.add("a"), fleet.add("b")
    a.stored["resp_a"] = stored("resp_a")
    gw = start_gateway(fleet, health_timeout_s=0.5)
    if failure == "error":
        b.lookup_status = 500
    else:
        b.lookup_delay_s = 3.0
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        t = time.monotonic()
        err = openai_error(c.get("/v1/responses/resp_nope"), 503, "response_owner_unavailable")
        assert time.monotonic() - t < 2.5  # bounded by the control timeout, not the worker
        assert "resp_nope" in err["message"] and "b:" in err["message"]
        err = openai_error(c.post("/v1/responses", json=follow_up("resp_nope")), 503, "response_owner_unavailable")
        assert err["param"] == "previous_response_id"
        assert owner_of(gw, "resp_nope") is None
        r = c.get("/v1/responses/resp_a")
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "a", r.text


def test_two_gateway_processes_on_the_in_memory_store_find_each_others_responses(fleet, start_gateway):
    """``kvgate serve --workers 2`` with the default in-memory store: two gateways, each with its own owner
    records, over the same fleet. A response created through one is fetched, continued and cancelled
    through the other (it was a 404 there), which then keeps its own record."""
    fleet.add("a", responses=True)
    fleet.add("b", responses=True)
    one = start_gateway(fleet, index=IndexConfig(backend="memory"))
    two = start_gateway(fleet, index=IndexConfig(backend="memory"))
    with httpx.Client(base_url=one.url, timeout=30) as c1, httpx.Client(base_url=two.url, timeout=30) as c2:
        r = c1.post("/v1/responses", json={"model": MODEL, "input": "hello"})
        assert r.status_code == 200, r.text
        rid, worker = r.json()["id"], r.headers["x-kvgate-worker"]
        assert owner_of(one, rid)["worker"] == worker and owner_of(two, rid) is None
        r = c2.get(f"/v1/responses/{rid}")
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == worker and r.json()["id"] == rid
        assert owner_of(two, rid)["worker"] == worker
        r = c2.post("/v1/responses", json=follow_up(rid, "and?"))
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == worker, r.text
        nxt = r.json()["id"]
        # back through the first gateway, which has not seen the follow-up
        r = c1.post("/v1/responses", json=follow_up(nxt, "more"))
        assert r.status_code == 200 and r.headers["x-kvgate-worker"] == worker, r.text


async def test_a_data_parallel_owner_is_recorded_as_one_of_its_ranks(fleet, start_gateway, redis_url):
    """A data-parallel server's stored responses live in its API server, which every rank shares: the
    located owner is its first rank, a routing target, so a follow-up is pinned there (the server's own
    name is no candidate: that was a 503)."""
    from tests.gateway.test_dp_ranks import _gateway, _pubs
    from tests.gateway.test_proxy import wait_until

    pubs = _pubs(2)
    try:
        a = fleet.add("a", dp_publishers=pubs, responses=True)
        a.stored["resp_dp"] = stored("resp_dp")
        gw = _gateway(start_gateway, fleet, redis_url)
        await wait_until(lambda: set(gw.state.ingestor.statuses()) == {"a@dp0", "a@dp1"}, timeout=30)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            r = await c.post("/v1/responses", json=follow_up("resp_dp"))
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "a@dp0", r.text
            assert a.requests[-1]["headers"]["x-data-parallel-rank"] == "0"
            r = await c.get("/v1/responses/resp_dp")
            assert r.status_code == 200 and r.headers["x-kvgate-worker"] == "a@dp0", r.text
    finally:
        for p in pubs:
            p.close()


def test_an_id_that_needs_quoting_reaches_its_owner_quoted(fleet, start_gateway):
    """The id in a GET, cancel or delete path arrives decoded; it went to the worker as it was, so an id with
    a space (or CR/LF) made a malformed request line. It is forwarded percent-quoted."""
    a = fleet.add("a")
    a.stored["resp a b"] = stored("resp a b")
    gw = start_gateway(fleet)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for _ in range(2):  # located on the fleet, then from the record
            r = c.get("/v1/responses/resp%20a%20b")
            assert r.status_code == 200 and r.json()["id"] == "resp a b", r.text
