"""Asynchronous G4 loads on a real vLLM CPU server, as a user sees them, in both load modes.

One server per mode (``load_async`` true, then false) on its own G4 directory, with the store's read
throttle (``read_bytes_per_s``) standing in for a slow shared filesystem so that a load lasts long enough
to overlap other requests. A prompt's blocks reach G4 by serving it once; ``POST /reset_prefix_cache``
then empties vLLM's own cache so the next request that extends it loads them from G4. The reference for
every output is the same prompt under a ``cache_salt`` (no block in common with anything stored).
No timing thresholds: the assertions are on outputs, ``cached_tokens`` and the connector's counters.
"""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from bench import tiny_model
from bench.vllm_server import VllmServer, vllm_python
from indexer.hashing import routable_blocks, sequence_hashes
from tests.g4.real_vllm import BLOCK, cached, complete, corrupt, g4_server, prompt, store_of, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not (vllm_python().parent.parent / ".kvgate-ready").exists():  # `make test` builds it
    pytestmark.append(pytest.mark.skip(reason="vLLM env missing: run `make vllm-env`"))

READ_BYTES_PER_S = 1_000_000  # tiny model: 128 KiB blocks, so about 8 blocks a second
QUESTION = prompt(2, 24)


@pytest.fixture(scope="module")
def model():
    return tiny_model.ensure("tiny")


@pytest.fixture(scope="module", params=["async", "sync"])
def srv(request, model, tmp_path_factory):
    g4 = str(tmp_path_factory.mktemp(f"g4-{request.param}"))
    s = g4_server(
        model, g4, f"g4-{request.param}",
        g4_config={"load_async": request.param == "async", "read_bytes_per_s": READ_BYTES_PER_S},
    )
    with s:
        yield {"server": s, "g4": g4, "mode": request.param}


def put_on_g4_only(s: VllmServer, g4: str, p: list[int]) -> list[int]:
    """Serve ``p`` once, wait for its full blocks in the store, empty vLLM's cache; the block hashes."""
    complete(s, p, max_tokens=1)
    hs = sequence_hashes(p, BLOCK)[: routable_blocks(len(p), BLOCK)]
    st = store_of(g4)
    assert wait_for(lambda: all(st.contains(h) for h in hs)), "the prompt's blocks did not reach G4"
    httpx.post(s.url + "/reset_prefix_cache", timeout=60).raise_for_status()
    return hs


def test_output_equals_the_reference_and_cached_tokens_show_the_g4_hit(srv):
    s = srv["server"]
    p = prompt(11, 20 * BLOCK + 7)
    put_on_g4_only(s, srv["g4"], p)
    ref = complete(s, p + QUESTION, max_tokens=12, cache_salt="no-g4-reference")
    assert cached(ref) == 0
    before = s.g4_stats()
    got = complete(s, p + QUESTION, max_tokens=12)
    after = s.g4_stats()
    assert cached(got) == 20 * BLOCK, got["usage"]
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert after["loads"] - before["loads"] == 20
    assert after["load_failures"] == before["load_failures"]
    assert after["async_loads"] - before["async_loads"] == (1 if srv["mode"] == "async" else 0)


@pytest.mark.parametrize("srv", ["async"], indirect=True)  # a synchronous load stalls the step: bench/g4_async.py
def test_a_short_request_is_served_while_a_long_load_is_in_flight(srv):
    s = srv["server"]
    long_p = prompt(12, 64 * BLOCK + 3)  # 64 blocks: about 8 s through the read throttle
    put_on_g4_only(s, srv["g4"], long_p)
    ref = complete(s, long_p + QUESTION, max_tokens=6, cache_salt="no-g4-reference-long")
    result: dict = {}

    def long_request():
        result["resp"] = complete(s, long_p + QUESTION, max_tokens=6)

    t = threading.Thread(target=long_request)
    t.start()
    try:
        assert wait_for(lambda: s.g4_stats()["loads_in_flight"] >= 1, timeout=60, every=0.05), (
            "the long request's G4 load never started"
        )
        short = complete(s, prompt(13, 40), max_tokens=4)
        assert len(short["choices"][0]["token_ids"]) == 4
        # served to the end while the long request was still waiting for its blocks
        assert s.g4_stats()["loads_in_flight"] >= 1, "the short request waited for the long load"
    finally:
        t.join(300)
    got = result["resp"]
    assert cached(got) == 64 * BLOCK, got["usage"]
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]


@pytest.mark.parametrize("bad_block", [5, 0])
def test_a_corrupt_block_is_recomputed_with_the_reference_output(srv, bad_block):
    s = srv["server"]
    p = prompt(20 + bad_block, 12 * BLOCK + 3)
    hs = put_on_g4_only(s, srv["g4"], p)
    path = store_of(srv["g4"]).path(hs[bad_block])
    corrupt(path)
    ref = complete(s, p + QUESTION, max_tokens=12, cache_salt=f"no-g4-reference-bad{bad_block}")
    before = s.g4_stats()
    got = complete(s, p + QUESTION, max_tokens=12)
    after = s.g4_stats()
    assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert after["load_failures_by_reason"]["corrupt"] - before["load_failures_by_reason"]["corrupt"] == 1
    assert not os.path.exists(path), "a corrupt block file must not be served again"
    # every other block was read once; the request was not offered the bad block again (vLLM's
    # cached_tokens still counts the whole planned hit: it is recorded when the request is admitted)
    assert after["loads"] - before["loads"] == len(hs) - 1
    assert after["load_failures_by_reason"]["missing"] == before["load_failures_by_reason"]["missing"]
