"""Admin API fixtures: a real gateway (uvicorn on loopback) over a real Redis index, with live fake vLLM
workers (tests/support/fake_worker.py: vLLM's HTTP surface) whose KV events come from vLLM-shaped ZMQ
publishers (bench.sim.vllm_format.EventPublisher) into the gateway's real event ingestor.

The fake worker is not an engine, so the test plays the engine's part for the cache: after a request it
publishes the BlockStored events vLLM would (:meth:`AdminEnv.publish`)."""
from __future__ import annotations

import time

import httpx
import pytest

from bench.sim import vllm_format as vf
from indexer.hashing import sequence_hashes
from indexer.index.redis import RedisIndex
from router.app import create_app
from router.config import AdminConfig, IndexConfig, ModelConfig, Settings, WorkerConfig
from tests.support.fake_worker import FakeState, create_fake_worker
from tests.support.procs import free_port
from tests.support.servers import ThreadServer
from tests.support.tiny_tokenizer import build

MODEL = "tiny"
BLOCK = 16
TOKEN = "s3cret-admin-token"


@pytest.fixture(scope="session")
def admin_tokenizer_dir(tmp_path_factory):
    return str(build(tmp_path_factory.mktemp("admin-tiny-tokenizer")))


def until(cond, timeout: float = 30.0, what: str = "condition", interval: float = 0.05):
    """Poll ``cond`` until truthy (generous timeout: the machine is shared)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def engine_hash(h: int) -> int:
    """A stand-in for vLLM's own block hash of a block (any stable 64-bit value works)."""
    return (h ^ 0x5DEECE66D5DEECE6) & 0xFFFFFFFFFFFFFFFF


class LiveWorker:
    """One fake vLLM server and its KV event publisher (PUB + replay ROUTER, as vLLM binds them)."""

    def __init__(self, name: str, tokenizer_dir: str, **state_kw) -> None:
        self.name = name
        port, rport = free_port(), free_port()
        self.pub = vf.EventPublisher(f"tcp://*:{port}", f"tcp://*:{rport}", topic="kv-events")
        self.events_endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.state = FakeState(name=name, model=MODEL, block_size=BLOCK, **state_kw)
        self.server = ThreadServer(create_fake_worker(self.state, tokenizer_dir)).start()
        self.batches = 0

    @property
    def url(self) -> str:
        return self.server.url

    def config(self) -> WorkerConfig:
        return WorkerConfig(url=self.url, name=self.name, events_endpoint=self.events_endpoint,
                            replay_endpoint=self.replay_endpoint)

    def publish(self, tokens: list[int], medium: str = "GPU") -> list[int]:
        """BlockStored for every full block of ``tokens`` (what vLLM emits after prefilling them);
        returns kvgate's sequence hashes of those blocks."""
        n = len(tokens) // BLOCK
        hashes = sequence_hashes(tokens[: n * BLOCK], BLOCK)
        self.pub.publish([vf.stored([engine_hash(h) for h in hashes], tokens[: n * BLOCK], BLOCK, None,
                                    medium=medium)])
        self.batches += 1
        return hashes

    def stop(self) -> None:
        self.server.stop()
        self.pub.close()


class AdminEnv:
    def __init__(self, server: ThreadServer, workers: list[LiveWorker], index_url: str, token: str | None):
        self.server = server
        self.app = server.app
        self.state = server.app.state.kv
        self.url = server.url
        self.workers = {w.name: w for w in workers}
        self.index_url = index_url
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0, trust_env=False)
        self.anon = httpx.Client(base_url=self.url, timeout=60.0, trust_env=False)

    def call(self, coro):
        """Run a coroutine on the gateway's event loop (to read its in-memory state)."""
        return self.server.call(coro)

    def wait_healthy(self, *names: str) -> None:
        names = names or tuple(self.workers)
        until(lambda: all((w := self.state.registry.get(n)) is not None and w.healthy for n in names),
              what=f"workers {names} healthy")

    def wait_subscribed(self, *names: str) -> None:
        names = names or tuple(self.workers)

        def ok():
            st = self.state.ingestor.statuses()
            return all(st.get(n, {}).get("connected") for n in names)

        until(ok, what=f"event sources of {names} connected")

    def publish(self, worker: str, tokens: list[int], medium: str = "GPU") -> list[int]:
        """Publish the blocks of ``tokens`` from ``worker`` and wait until the index shows them."""
        hashes = self.workers[worker].publish(tokens, medium)

        def indexed():
            r = self.call(self.state.index.lookup(MODEL, hashes, [worker]))
            m = r.match(worker)
            held = {"GPU": m.gpu, "CPU": m.cpu}.get(medium, r.g4)
            return held == len(hashes)

        until(indexed, what=f"{len(hashes)} {medium} blocks of {worker} in the index")
        return hashes

    def close(self) -> None:
        self.http.close()
        self.anon.close()


@pytest.fixture
def admin_env(redis_url, admin_tokenizer_dir):
    """Factory: ``admin_env(n_workers=2, token=TOKEN, **settings)`` -> a started :class:`AdminEnv`."""
    made: list[tuple[AdminEnv, list[LiveWorker]]] = []

    def start(n_workers: int = 2, *, token: str | None = TOKEN, open_without_token: bool = False,
              worker_kw: dict | None = None, index_url: str | None = None, **settings_kw) -> AdminEnv:
        workers = [LiveWorker(f"w{i + 1}", admin_tokenizer_dir, **((worker_kw or {}).get(f"w{i + 1}", {})))
                   for i in range(n_workers)]
        # The fake worker is no engine: the registration-time parity probe (router/parity.py) would wait
        # for events nobody publishes and mark it cache-blind. Tests run the check on demand instead.
        # Nor does it announce what it serves: the tests place blocks in the index themselves (env.publish), so
        # the gateway's record of forwarded prompts (router/pending.py) is off here.
        routing = {"parity_check": False, "pending_ttl_s": 0, **settings_kw.pop("routing", {})}
        kw = dict(workers=[w.config() for w in workers], routing=routing,
                  models={MODEL: ModelConfig(tokenizer=admin_tokenizer_dir)},
                  index=IndexConfig(backend="redis", redis_url=index_url or redis_url),
                  admin=AdminConfig(token=token, open_without_token=open_without_token),
                  health_interval_s=0.2, refresh_interval_s=1.0, request_timeout_s=30.0,
                  connect_timeout_s=2.0)
        kw.update(settings_kw)
        settings = Settings(**kw)
        # The fake workers count requests; the registration probe (router/parity.py) would be one more.
        settings.routing.parity_check = False
        app = create_app(settings, index=RedisIndex(index_url or redis_url, timeout_s=2.0),
                         with_events=True)
        server = ThreadServer(app).start()
        env = AdminEnv(server, workers, redis_url, token)
        made.append((env, workers))
        env.wait_healthy()
        if index_url is None:
            env.wait_subscribed()
        return env

    yield start
    for env, workers in made:
        env.close()
        env.server.stop()
        for w in workers:
            w.stop()
