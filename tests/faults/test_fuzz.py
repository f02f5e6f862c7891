"""Schemathesis over the gateway's own /openapi.json (OpenAI routes and admin routes, with and without the
admin token): no response is a 5xx and no request outlives its timeout. The gateway runs on a real
redis-server in front of one simulated vLLM worker process (bench/sim answers bad input as vLLM does)."""
from __future__ import annotations

import threading
import time

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


_SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(HealthCheck))


def _call(case, url: str, headers: dict):
    try:
        return case.call(base_url=url, headers=headers, timeout=30)
    except Exception as e:  # a timeout or a reset: the test reports it
        return e


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
            if isinstance(case.body, dict):  # a valid request for 10^9 tokens streams for minutes: no hang,
                for k, cap in (("max_tokens", 64), ("max_completion_tokens", 64), ("n", 2), ("best_of", 2)):
                    if isinstance(case.body.get(k), int) and case.body[k] > cap:  # no use to the fuzz either
                        case.body[k] = cap
            t = time.monotonic()
            # requests' timeout bounds each read, not the whole call: a worker thread bounds it all, so
            # a request that hangs fails the test with its curl command instead of stalling the suite.
            box: list = []
            th = threading.Thread(target=lambda: box.append(_call(case, gw.url, headers)), daemon=True)
            th.start()
            th.join(60)
            assert box, f"request hung for 60 s: {case.as_curl_command()}"
            r = box[0]
            if isinstance(r, Exception):
                raise r
            sent += 1
            assert r.status_code < 500, f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:300]}"
            assert time.monotonic() - t < 60, f"{case.method} {case.formatted_path} took {time.monotonic() - t:.0f} s"

        check()
    return sent


@pytest.mark.timeout(240)
def test_no_server_errors_with_the_token(fuzz_gateway):
    assert _fuzz(fuzz_gateway, {"authorization": f"Bearer {TOKEN}"}) > 100


@pytest.mark.timeout(240)
def test_no_server_errors_without_the_token(fuzz_gateway):
    assert _fuzz(fuzz_gateway, {}) > 100
