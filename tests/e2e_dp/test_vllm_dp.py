"""kvgate in front of one real vLLM server with ``--data-parallel-size 2`` (two engine cores behind one
port, one core each: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), the referee being vLLM's own
``usage.prompt_tokens_details.cached_tokens``.

Its own package: the server takes both cores, so it starts only after tests/e2e has stopped its two
(package-scoped) servers. One server start (about a minute with the tiny model) for the whole module.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import httpx
import pytest

from router.config import WorkerConfig
from router.vllm_metrics import parse_metrics
from tests.e2e.kvgate import kvgate_settings, start_kvgate
from tests.support.vllm_server import VllmServer, free_port

pytestmark = pytest.mark.vllm

MODEL = "tiny"
CHAT = "/v1/chat/completions"


def _pair() -> int:
    """A free port whose next one is free too: rank r binds the configured port + r."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p


@pytest.fixture(scope="module")
def dp_server():
    from bench import tiny_model

    server = VllmServer(
        tiny_model.ensure("tiny"),
        name="vllm-dp",
        served_model_name=MODEL,
        omp_threads_bind="0|1" if (os.cpu_count() or 1) >= 2 else "0|0",
        extra_args=["--data-parallel-size", "2"],
    )
    server.events_port, server.replay_port = _pair(), _pair()
    try:
        server.start().wait_ready()
        yield server
    finally:
        server.close()


@pytest.fixture
def gw(dp_server, redis_url):
    """A gateway given only the server's URL: the ranks come from its /kv_event_sources."""
    from bench import tiny_model

    settings = kvgate_settings([dp_server], redis_url, str(tiny_model.ensure("tiny")), MODEL,
                               workers=[WorkerConfig(url=dp_server.url, name="dp")])
    g = start_kvgate(settings, [dp_server], MODEL)
    try:
        g.wait_ready(parity=True)
        yield g
    finally:
        g.stop()


def _chat(messages: list[dict], max_tokens: int = 4) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}


def _post(url: str, body: dict, rank: int | None = None) -> httpx.Response:
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    r = httpx.post(url + CHAT, json=body, headers=headers, timeout=300.0)
    assert r.status_code == 200, r.text
    return r


def _cached(r: httpx.Response) -> int:
    return int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _prompt() -> str:
    tag = uuid.uuid4().hex[:10]
    return " ".join(f"{tag} line {i} of a long shared context about data parallel ranks" for i in range(60))


def _wait(cond, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if v := cond():
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_follow_up_goes_to_the_rank_holding_its_prefix(gw, dp_server):
    """Both ranks' event streams reach the index under ``dp@dp0`` / ``dp@dp1``; a follow-up turn routed
    through kvgate goes to the rank that holds its prefix and vLLM serves the prefix from that rank's
    cache. The header really pins: the same kind of follow-up sent straight to the other rank finds
    nothing cached there."""
    reg = gw.state.registry
    w = reg.get("dp")
    assert [t.name for t in w.ranks] == ["dp@dp0", "dp@dp1"]
    ports = [int(t.event_sources[0]["endpoint"].rsplit(":", 1)[1]) for t in w.ranks]
    assert ports == [dp_server.events_port, dp_server.events_port + 1]  # vLLM's port + rank
    assert w.parity["status"] == "ok", w.parity  # the probe, pinned to rank 0, came back on its stream

    for rank in (0, 1):  # a conversation warmed on each rank directly, as another client would
        mine, other = f"dp@dp{rank}", f"dp@dp{1 - rank}"
        text = _prompt()
        first = _post(dp_server.url, _chat([{"role": "user", "content": text}]), rank=rank)
        answer = first.json()["choices"][0]["message"]["content"]
        hashes = gw.plan(_chat([{"role": "user", "content": text}])).hashes
        assert len(hashes) >= 10
        assert gw.wait_held(hashes, mine, lambda n: n == len(hashes)) == len(hashes)
        assert gw.held(hashes, other) == 0

        history = [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        turn = _chat(history + [{"role": "user", "content": "And what follows from that?"}])
        r = _post(gw.url, turn)
        assert r.headers["x-kvgate-worker"] == mine
        predicted, delivered = int(r.headers["x-kvgate-cached-tokens"]), _cached(r)
        assert predicted > 0 and delivered >= predicted, (predicted, delivered)

        # Referee for the header: the prefix lives on this rank only.
        probe = _chat(history + [{"role": "user", "content": "Put differently, what then?"}])
        assert _cached(_post(dp_server.url, probe, rank=1 - rank)) == 0
        assert _cached(_post(dp_server.url, probe, rank=rank)) >= predicted

    # Each rank's load and calibration come from its own engine="r" series.
    text = httpx.get(dp_server.url + "/metrics", timeout=30).text
    for t in w.ranks:
        assert parse_metrics(text, str(t.dp_rank))[0].prompt_tokens > 0
        _wait(lambda t=t: t.load.prompt_tokens > 0, what=f"{t.name}'s scraped load")
    workers = httpx.get(gw.url + "/admin/workers", timeout=30).json()["workers"]
    ranks = {r["name"]: r for r in workers[0]["ranks"]}
    assert set(ranks) == {"dp@dp0", "dp@dp1"}
    assert all(r["events"]["applied"] > 0 and r["cached_blocks"].get("GPU", 0) > 0 for r in ranks.values())
