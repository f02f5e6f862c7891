"""Many simulated vLLM workers in one process and one event loop: one uvicorn server listens on every
worker's port and an ASGI dispatcher hands each connection to the app of the port it arrived on."""
from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import uvicorn
import zmq.asyncio

from bench.sim.asgi import serve_lifespan
from bench.sim.cache import PrefixCache, SharedG4Store
from bench.sim.engine import SimEngine
from bench.sim.events import ZmqPublisher
from bench.sim.server import WorkerInfo, create_worker_app
from bench.sim.timing import DEFAULT_TIMING, TimingModel
from bench.sim.tokenizer import DEFAULT_VOCAB, SimTokenizer

log = logging.getLogger(__name__)


@dataclass
class FleetConfig:
    workers: int = 4
    host: str = "127.0.0.1"
    base_port: int = 0                 # 0: ephemeral ports; else worker i listens on base_port + i
    event_base_port: int = 0           # 0: ephemeral; else PUB on event_base_port + 2i, replay on +2i+1
    model: str = "sim-model"
    block_size: int = 16
    # per-worker GPU KV capacity in blocks: ~25 GB of KV for gpt-oss-120b (72 KiB/token) on a 96 GB card
    num_blocks: int = 21_000
    max_model_len: int = 262_144
    vocab_size: int = DEFAULT_VOCAB
    timing: TimingModel = DEFAULT_TIMING
    g4: bool = False                   # a shared simulated G4 store across the workers
    g4_capacity_blocks: int = 1_000_000
    hash_seed: str = "vllm-none-hash"  # chain root; the same on every worker (like sha256 + fixed seed)
    topic_prefix: str = "kv"
    stream_interval: int = 16
    default_max_tokens: int = 16
    buffer_steps: int = 10_000


@dataclass
class SimWorker:
    name: str
    port: int
    url: str
    engine: SimEngine
    publisher: ZmqPublisher
    info: WorkerInfo

    @property
    def events_endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint


def _listen(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    s.setblocking(False)
    return s


class _Dispatcher:
    """ASGI app routing by the local port of the connection."""

    def __init__(self):
        self.apps: dict[int, object] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send)
        server = scope.get("server") or (None, None)
        app = self.apps.get(server[1])
        if app is None:
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b""})
            return
        await app(scope, receive, send)


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the owner of the loop handles signals
        pass


class SimFleet:
    """``async with SimFleet(cfg) as fleet``: workers listening, publishers bound."""

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        self.workers: list[SimWorker] = []
        self.g4 = SharedG4Store(cfg.g4_capacity_blocks) if cfg.g4 else None
        self._ctx: zmq.asyncio.Context | None = None
        self._server: _Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._sockets: list[socket.socket] = []

    async def start(self) -> SimFleet:
        cfg = self.cfg
        self._ctx = zmq.asyncio.Context()
        self._ctx.setsockopt(zmq.LINGER, 0)  # term() in stop() never waits on unsent frames
        tokenizer = SimTokenizer(cfg.vocab_size)
        dispatcher = _Dispatcher()
        for i in range(cfg.workers):
            sock = _listen(cfg.host, cfg.base_port + i if cfg.base_port else 0)
            port = sock.getsockname()[1]
            self._sockets.append(sock)
            name = f"sim-{i}"
            ev_port = cfg.event_base_port + 2 * i if cfg.event_base_port else 0
            pub = ZmqPublisher(self._ctx, cfg.host, ev_port, ev_port + 1 if ev_port else 0,
                               topic=f"{cfg.topic_prefix}@{name}@{cfg.model}", buffer_steps=cfg.buffer_steps)
            pub.start()
            cache = PrefixCache(cfg.num_blocks, cfg.block_size, cfg.hash_seed, g4=self.g4)
            engine = SimEngine(cache, pub, cfg.timing, cfg.max_model_len, cfg.vocab_size, cfg.stream_interval)
            engine.start()
            info = WorkerInfo(name=name, model=cfg.model, engine=engine, tokenizer=tokenizer,
                              default_max_tokens=cfg.default_max_tokens, topic=pub.topic)
            sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub.endpoint,
                             "replay_endpoint": pub.replay_endpoint, "buffer_steps": cfg.buffer_steps,
                             "hwm": 100_000, "max_queue_size": 100_000, "topic": pub.topic}}
            dispatcher.apps[port] = create_worker_app(info, sources)
            self.workers.append(SimWorker(name, port, f"http://{cfg.host}:{port}", engine, pub, info))
        config = uvicorn.Config(dispatcher, log_level="warning", access_log=False, lifespan="on",
                                timeout_keep_alive=30, backlog=1024)
        self._server = _Server(config)
        self._serve_task = asyncio.get_running_loop().create_task(self._server.serve(sockets=self._sockets))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._serve_task is not None:
                try:
                    await asyncio.wait_for(self._serve_task, 10)
                except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - best effort shutdown
                    self._serve_task.cancel()
        for w in self.workers:
            await w.engine.stop()
            w.publisher.close()
        if self._ctx is not None:
            self._ctx.term()
        self._server = None

    async def __aenter__(self) -> SimFleet:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def describe(self) -> list[dict]:
        return [{"name": w.name, "url": w.url, "events_endpoint": w.events_endpoint,
                 "replay_endpoint": w.replay_endpoint} for w in self.workers]
