"""Schemathesis over the gateway's own /openapi.json (OpenAI routes and admin routes, with and without the
admin token): no response is a 5xx and no request outlives its timeout. The gateway runs on a real
redis-server in front of one simulated vLLM worker process (bench/sim answers bad input as vLLM does)."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.faults.harness import Gateway, SimProc

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def fuzz_gateway(redis_server):
    sim = SimProc("a").start()
    gw = Gateway([sim], redis_server, admin={"token": TOKEN}, max_body_bytes=200_000)
    try:
        yield gw
    finally:
        gw.stop()
        sim.stop()


_SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


def _fuzz(gw, headers: dict) -> int:
    """Every operation of the schema, ``max_examples`` generated cases each; returns the cases sent."""
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json")
    sent = 0
    for result in schema.get_all_operations():
        op = result.ok()

        @_SETTINGS
        @given(case=op.as_strategy())
        def check(case):
            nonlocal sent
            if case.method in ("DELETE", "POST") and (case.path_parameters or {}).get("name") == "a":
                return  # keep the fleet's one worker: fuzzing may remove or drain others, not it
            r = case.call(base_url=gw.url, headers=headers, timeout=30)
            sent += 1
            assert r.status_code < 500, f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:300]}"

        check()
    return sent


@pytest.mark.timeout(600)
def test_no_server_errors_with_the_token(fuzz_gateway):
    assert _fuzz(fuzz_gateway, {"authorization": f"Bearer {TOKEN}"}) > 100


@pytest.mark.timeout(600)
def test_no_server_errors_without_the_token(fuzz_gateway):
    assert _fuzz(fuzz_gateway, {}) > 100
