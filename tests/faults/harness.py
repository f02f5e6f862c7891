"""The fault suite's parts: simulated vLLM workers as their own processes (bench/sim speaks vLLM's HTTP,
metrics and ZMQ KV events byte for byte; SIGKILL is a real crash), kvgate gateways in this process on a
real redis-server, a load of multi-turn conversations, and the divergence between what each worker's
cache holds, what the gateway's state says and what Redis holds."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from indexer.events.state import _unpack as unpack_handle
from router.app import create_app
from router.config import IndexConfig, ModelConfig, Settings, WorkerConfig
from tests.support.procs import free_port, free_port_pair
from tests.support.servers import ThreadServer

MODEL = "sim-model"
BLOCK = 16
REPO = Path(__file__).resolve().parents[2]


class SimProc:
    """One simulated vLLM server in its own process, restartable on the same ports."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()
        self.event_port = free_port_pair(1)  # PUB on it, replay on the next
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvgate-sim-{name}-"))
        self.proc: subprocess.Popen | None = None
        self.desc: dict = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> WorkerConfig:
        return WorkerConfig(url=self.url, name=self.name, events_endpoint=f"tcp://127.0.0.1:{self.event_port}",
                            replay_endpoint=f"tcp://127.0.0.1:{self.event_port + 1}")

    def start(self, timeout: float = 60.0) -> SimProc:
        wf = self.dir / "workers.json"
        wf.unlink(missing_ok=True)
        with open(self.dir / "sim.log", "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "sim", "--workers", "1", "--base-port", str(self.port),
                 "--event-base-port", str(self.event_port), "--num-blocks", "4096", "--block-size", str(BLOCK),
                 "--time-scale", "20", "--model", MODEL, "--workers-file", str(wf)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO),
                env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + timeout
        while not wf.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulated worker {self.name} did not start: "
                                   f"{(self.dir / 'sim.log').read_text()[-2000:]}")
            time.sleep(0.05)
        self.desc = json.loads(wf.read_text())
        return self

    def kill(self) -> None:
        """SIGKILL: the process and its KV cache are gone at once, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """Kill it and remove its log folder (a restart after :meth:`kill` keeps appending to the log)."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def cached(self) -> set[int]:
        return set(httpx.get(self.url + "/sim/cached", timeout=10).json()["hashes"])

    def fault(self, **kw) -> None:
        httpx.post(self.url + "/sim/fault", json=kw, timeout=10).raise_for_status()


class Gateway:
    def __init__(self, sims: list[SimProc], redis_url: str, **kw) -> None:
        settings = Settings(
            workers=[s.config() for s in sims], models={MODEL: ModelConfig(block_size=BLOCK)},
            index=IndexConfig(backend="redis", redis_url=redis_url, breaker_open_s=0.5, lease_ttl_s=1.5,
                              timeout_s=0.5),
            health_interval_s=0.2, health_timeout_s=1.0, unhealthy_after=2, refresh_interval_s=2.0,
            request_timeout_s=30.0, connect_timeout_s=1.0, **kw)
        settings.routing.parity_check = False  # no tokenizer here: prompts are token ids
        self.server = ThreadServer(create_app(settings, with_events=True)).start()
        self.state = self.server.app.state.kv
        self.url = self.server.url

    def call(self, coro, timeout: float = 30.0):
        return self.server.call(coro, timeout)

    def stop(self) -> None:
        self.server.stop()

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                    total += smp.value
        return total


@dataclass
class Result:
    status: int = 0
    first_byte: bool = False
    done: bool = False  # a complete answer ([DONE] or a JSON body)
    error_event: bool = False
    worker: str | None = None
    cached: int = 0
    exc: str | None = None
    stream: bool = False


@dataclass
class Load:
    """Conversations against a gateway until ``stop`` is set; every request's outcome is kept."""

    urls: list[str]
    conversations: int = 6
    turn_tokens: int = 48
    results: list[Result] = field(default_factory=list)
    active: list[Result] = field(default_factory=list)  # requests in flight now
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), trust_env=False) as c:
            await asyncio.gather(*(self._converse(c, i) for i in range(self.conversations)))

    async def _converse(self, c: httpx.AsyncClient, i: int) -> None:
        prompt = [1000 + i * 5000 + k for k in range(96)]
        turn = 0
        while not self.stop.is_set():
            turn += 1
            prompt = prompt + [1000 + i * 5000 + 100 * turn + k for k in range(self.turn_tokens)]
            url = self.urls[(i + turn) % len(self.urls)]
            stream = bool(i % 2)  # streams are long (1500 tokens): a crash cuts some of them mid-way
            res = Result(stream=stream)
            self.active.append(res)
            try:
                await request(c, url, prompt, stream=stream, max_tokens=1500 if stream else 8, res=res)
            finally:
                self.active.remove(res)
            self.results.append(res)
            await asyncio.sleep(0.05)

    def failed(self) -> list[Result]:
        """Requests that did not get a complete answer and were not already streaming when they failed."""
        return [r for r in self.results if not r.done and not (r.first_byte and r.error_event)]

    def streaming_on(self, worker: str) -> int:
        """Streams in flight whose first token came from ``worker``."""
        return sum(1 for r in self.active if r.stream and r.first_byte and r.worker == worker)

    def cut_mid_stream(self) -> list[Result]:
        return [r for r in self.results if r.first_byte and not r.done]


async def request(c: httpx.AsyncClient, url: str, prompt: list[int], stream: bool, max_tokens: int = 8,
                  res: Result | None = None) -> Result:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    res = res or Result(stream=stream)
    try:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            res.worker = r.headers.get("x-kvgate-worker")
            if not stream:
                data = json.loads(await r.aread())
                res.first_byte = True
                res.done = r.status_code == 200 and "choices" in data
                res.cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                res.first_byte = True
                payload = line[6:]
                if payload == "[DONE]":
                    res.done = not res.error_event
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    res.error_event = True
                usage = obj.get("usage") or {}
                res.cached = max(res.cached, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (httpx.HTTPError, ValueError) as e:
        res.exc = f"{type(e).__name__}: {e}"
    return res


def divergence(gw: Gateway, sim: SimProc) -> dict:
    """What the worker's cache holds vs the gateway's state (engine hashes), and the state vs Redis
    (kvgate hashes): entries Redis holds that the state does not (phantoms) and the reverse (missing)."""
    truth = sim.cached()
    ing = gw.state.ingestor

    async def read():
        s = ing._sources.get(sim.name)
        if s is None:  # between an unsubscribe and the new subscription (a restart): not settled yet
            return None
        engine = {k for k, h in s.state._handles.items()
                  if not isinstance(k, tuple) and unpack_handle(h)[1] > 0}
        held = set(s.state.held("GPU"))
        idx = gw.state.index
        in_redis = 0
        for h in held:
            in_redis += sim.name in (await idx.locate(MODEL, h)).workers
        count = ((await idx.stats(MODEL)).get(MODEL, {}).get("workers", {}).get(sim.name) or {}).get("GPU", 0)
        return engine, held, in_redis, count

    got = gw.call(read())
    if got is None:
        return {"unsubscribed": 1, "blocks": len(truth)}
    engine, held, in_redis, count = got
    return {"engine_missing": len(truth - engine), "engine_extra": len(engine - truth),
            "redis_missing": len(held) - in_redis, "redis_phantoms": count - in_redis, "blocks": len(truth)}


def converged(d: dict) -> bool:
    return all(v == 0 for k, v in d.items() if k != "blocks")


async def wait_for(cond, timeout: float = 30.0, what: str = "condition", every: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await asyncio.to_thread(cond)
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (last: {last})")


def record(scenario: str, **figures) -> None:
    """Append a scenario's figures to $KVGATE_FAULT_REPORT (JSON lines) when set: docs/RELIABILITY.md is
    written from them."""
    path = os.environ.get("KVGATE_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, **figures}) + "\n")


def load_figures(load: Load) -> dict:
    return {"requests": len(load.results), "failed": len(load.failed()),
            "cut_mid_stream_with_error_event": sum(r.error_event for r in load.cut_mid_stream()),
            "streamed": sum(1 for r in load.results if r.stream)}
