"""The admin API in front of the simulated vLLM fleet (bench/sim): workers that keep a real prefix cache,
publish their own KV events over ZMQ in vLLM's wire format and report ``cached_tokens`` — so parity,
explain and the predicted-vs-delivered comparison run with no help from the test."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from bench.sim import fleet as sim_fleet
from bench.sim import timing as sim_timing
from bench.sim import tokenizer as sim_tokenizer
from indexer.index.redis import RedisIndex
from router.app import create_app
from router.config import AdminConfig, IndexConfig, ModelConfig, Settings, WorkerConfig
from tests.admin.conftest import until
from tests.support.servers import ThreadServer


MODEL = "sim-model"


class FleetThread:
    """A SimFleet on its own event loop in a background thread."""

    def __init__(self, workers: int) -> None:
        cfg = sim_fleet.FleetConfig(workers=workers, model=MODEL, block_size=16, num_blocks=4000,
                                    timing=sim_timing.DEFAULT_TIMING.with_(time_scale=50.0))
        self.fleet = sim_fleet.SimFleet(cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="sim-fleet")
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.fleet.start(), self.loop).result(60)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.fleet.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def sim_gateway(redis_url, tmp_path):
    fleet = FleetThread(2)
    tok_dir = sim_tokenizer.save_model_dir(tmp_path / "sim-tokenizer")
    settings = Settings(
        workers=[WorkerConfig(url=w["url"], name=w["name"]) for w in fleet.fleet.describe()],
        models={MODEL: ModelConfig(tokenizer=str(tok_dir))},
        index=IndexConfig(backend="redis", redis_url=redis_url), admin=AdminConfig(token=None),
        health_interval_s=0.2, refresh_interval_s=1.0, request_timeout_s=60.0)
    server = ThreadServer(create_app(settings, index=RedisIndex(redis_url), with_events=True)).start()
    state = server.app.state.kv
    names = [w.name for w in fleet.fleet.workers]
    until(lambda: all((w := state.registry.get(n)) is not None and w.healthy for n in names),
          what="simulated workers healthy")
    until(lambda: all(state.ingestor.statuses().get(n, {}).get("connected") for n in names),
          what="simulated workers' events connected")
    client = httpx.Client(base_url=server.url, timeout=60.0, trust_env=False)
    yield server, client, names
    client.close()
    server.stop()
    fleet.stop()


def test_parity_explain_and_delivery_against_the_simulator(sim_gateway):
    server, http, names = sim_gateway
    state = server.app.state.kv

    # Parity: the gateway checks every worker when it registers (router/parity.py); the admin API shows
    # the result. (Re-running it on demand is covered in test_workers.py: against the simulator a second
    # probe stores no new blocks, so it would wait for events that never come.)
    until(lambda: all((w.get("parity") or {}).get("status") == "ok"
                      for w in http.get("/admin/workers").json()["workers"]),
          what="registration-time parity checks ok")
    for w in http.get("/admin/workers").json()["workers"]:
        assert w["parity"]["matched_blocks"] == w["parity"]["expected_blocks"] >= 4
        assert w["cache_blind"] is False
        # the simulator renders the chat probe (content list, tool call, tool message) as the gateway does
        assert w["parity"]["chat"]["status"] == "ok" and w["chat_cache_blind"] is False, w["parity"]["chat"]

    chat = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": "You answer questions about caches. " * 20},
        {"role": "user", "content": "Which worker holds the longest prefix of this conversation?"}]}
    first = http.post("/v1/chat/completions", json=chat)
    assert first.status_code == 200
    served = state.decisions.get(first.headers["x-request-id"]).chosen
    # The worker announces the prompt's blocks by itself; wait until the index has them.
    ex0 = http.post("/admin/explain", json={"body": chat}).json()
    n_blocks = len(ex0["hashes"])
    until(lambda: next(c for c in http.post("/admin/explain", json={"body": chat}).json()["candidates"]
                       if c["worker"] == served)["local_blocks"] == n_blocks,
          what="the first request's blocks indexed")

    ex = http.post("/admin/explain", json={"body": chat}).json()
    assert ex["chosen"] == served
    second = http.post("/v1/chat/completions", json=chat)
    d = state.decisions.get(second.headers["x-request-id"])
    assert d.chosen == ex["chosen"]
    # Predicted hit == what the engine reported in usage.prompt_tokens_details.cached_tokens.
    listed = http.get("/admin/decisions", params={"limit": 1}).json()["decisions"][0]
    assert listed["request_id"] == d.request_id
    assert listed["predicted_cached_tokens"] == n_blocks * 16
    assert listed["delivered_cached_tokens"] == listed["predicted_cached_tokens"]

    workers = {w["name"]: w for w in http.get("/admin/workers").json()["workers"]}
    assert workers[served]["cached_blocks"]["GPU"] >= n_blocks
    assert workers[served]["events"]["applied"] > 0 and workers[served]["parity"]["status"] == "ok"
