"""Gateway test fixtures: fake vLLM workers (tests/support/fake_worker.py) and the gateway itself, each a
real uvicorn server on a loopback port; the index is RedisIndex on a real redis-server."""
from __future__ import annotations

import pytest

from router.app import create_app
from router.config import IndexConfig, ModelConfig, Settings, WorkerConfig
from tests.support.fake_worker import FakeState, create_fake_worker
from tests.support.servers import ThreadServer
from tests.support.tiny_tokenizer import build

MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return str(build(tmp_path_factory.mktemp("tiny-tokenizer")))


def make_index(redis_url: str):
    from indexer.index.redis import RedisIndex

    return RedisIndex(redis_url)


class Fleet:
    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.servers: list[ThreadServer] = []
        self.states: list[FakeState] = []

    def add(self, name: str, **kw) -> FakeState:
        st = FakeState(name=name, model=MODEL, block_size=BLOCK, **kw)
        srv = ThreadServer(create_fake_worker(st, self.tokenizer_dir)).start()
        self.servers.append(srv)
        self.states.append(st)
        return st

    def url(self, i: int) -> str:
        return self.servers[i].url

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class Gateway:
    def __init__(self, server: ThreadServer) -> None:
        self.server = server
        self.app = server.app
        self.state = server.app.state.kv
        self.url = server.url

    def call(self, coro):
        return self.server.call(coro)


@pytest.fixture
def fleet(tokenizer_dir):
    f = Fleet(tokenizer_dir)
    yield f
    f.stop()


@pytest.fixture
def start_gateway(redis_url, tokenizer_dir):
    started: list[ThreadServer] = []

    def start(fleet: Fleet, *, policy: str = "kv", local_tokenizer: bool = True, ingestor=None,
              events: bool = False, pending: bool = False, parity: bool = False, **settings_kw) -> Gateway:
        workers = [WorkerConfig(url=s.url, name=st.name) for s, st in zip(fleet.servers, fleet.states)]
        models = {MODEL: ModelConfig(tokenizer=tokenizer_dir if local_tokenizer else None)}
        kw = dict(workers=workers, models=models, index=IndexConfig(backend="redis", redis_url=redis_url),
                  health_interval_s=0.2, refresh_interval_s=1.0, max_body_bytes=1_000_000,
                  request_timeout_s=30.0, connect_timeout_s=2.0)
        kw.update(settings_kw)
        settings = Settings(**kw)
        settings.routing.policy = policy
        # The fake workers count requests; the registration probe (router/parity.py) would be one more.
        settings.routing.parity_check = parity
        # Nor do they announce what they serve: tests place blocks in the index themselves, so the record of
        # forwarded prompts (router/pending.py) is off unless a test is about it.
        if not pending:
            settings.routing.pending_ttl_s = 0
        app = create_app(settings, index=make_index(redis_url), ingestor=ingestor,
                         with_events=events)
        srv = ThreadServer(app).start()
        started.append(srv)
        return Gateway(srv)

    yield start
    for s in started:
        s.stop()
