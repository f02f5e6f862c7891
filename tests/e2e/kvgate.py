"""A kvgate gateway in front of the session's real vLLM servers, for the end-to-end tests.

The app (``router.app.create_app``) runs on uvicorn on a free loopback port in a background thread with
its own event loop (``tests.support.servers.ThreadServer``); its index is ``RedisIndex`` on the test
session's real redis-server; its tokenizer is the served model's directory.
"""

from __future__ import annotations

import time

from indexer.hashing import routable_blocks, sequence_hashes
from router.app import create_app
from router.config import IndexConfig, ModelConfig, RoutingConfig, Settings, WorkerConfig
from tests.support.servers import ThreadServer
from tests.support.vllm_server import VllmServer


class KvGate:
    def __init__(self, server: ThreadServer, servers: list[VllmServer], model: str) -> None:
        self.server = server
        self.app = server.app
        self.state = server.app.state.kv
        self.url = server.url
        self.vllm = {s.name: s for s in servers}
        self.model = model

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the gateway's own event loop (its index client and state live there)."""
        return self.server.call(coro, timeout)

    # -- waiting for the gateway's view to settle ----------------------------------------------------
    def wait_ready(self, timeout_s: float = 120.0, parity: bool = True) -> None:
        """Every worker healthy and subscribed, and (``parity``) its parity check done."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = self.state.registry.workers()
            if (
                workers
                and all(w.healthy for w in workers)
                and all(t.name in self._statuses() for w in workers for t in w.targets())  # each DP rank
                and (not parity or all(w.parity is not None for w in workers))
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"gateway not ready: {[w.to_dict() for w in self.state.registry.workers()]}")

    def _statuses(self) -> dict:
        ing = self.state.ingestor
        return ing.statuses() if ing is not None else {}

    def hashes(self, tokens: list[int]) -> list[int]:
        """kvgate's routable block hashes of a prompt."""
        bs = self.state.registry.block_size(self.model)
        return sequence_hashes(tokens, bs, max_blocks=routable_blocks(len(tokens), bs))

    def held(self, hashes: list[int], worker: str) -> int:
        """Leading blocks of ``hashes`` the index says ``worker`` holds (any local tier)."""
        res = self.call(self.state.index.lookup(self.model, hashes, [worker]))
        return res.match(worker).local

    def wait_held(self, hashes: list[int], worker: str, predicate, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        n = self.held(hashes, worker)
        while not predicate(n) and time.monotonic() < deadline:
            time.sleep(0.1)
            n = self.held(hashes, worker)
        return n

    def plan(self, body: dict, path: str = "/v1/chat/completions"):
        """What the gateway knows about ``body``: tokens, hashes, and each worker's predicted cached tokens
        (sends nothing). Planned with the kv policy, so a round-robin gateway's rotation is left alone."""
        from router.policies import create_policy

        kv = create_policy(self.state.settings.routing, "kv")
        return self.call(self.state.router.plan(self.model, body, {}, path, policy=kv))

    def stop(self) -> None:
        self.server.stop()


def kvgate_settings(
    servers: list[VllmServer],
    redis_url: str,
    tokenizer: str,
    model: str,
    *,
    policy: str = "kv",
    block_size: int | None = None,
    **kw,
) -> Settings:
    base = dict(
        workers=[WorkerConfig(**s.worker_config()) for s in servers],
        models={model: ModelConfig(tokenizer=tokenizer, block_size=block_size)},
        # The gateway runs in the test's process (a thread), its GIL shared with the clients and the
        # pollers on 2 cores beside two vLLM servers: a Redis lookup there took over the 50 ms production
        # deadline, and the request was routed cache-blind (CI). These tests measure routing, not the guard
        # (tests/index, tests/faults test that).
        index=IndexConfig(backend="redis", redis_url=redis_url, lookup_timeout_s=2.0),
        routing=RoutingConfig(policy=policy),
        health_interval_s=0.5,
        refresh_interval_s=5.0,
        request_timeout_s=300.0,
        connect_timeout_s=5.0,
    )
    base.update(kw)
    return Settings(**base)


def start_kvgate(settings: Settings, servers: list[VllmServer], model: str) -> KvGate:
    from indexer.index.redis import RedisIndex

    index = RedisIndex(settings.index.redis_url, key_prefix=settings.index.key_prefix)
    app = create_app(settings, index=index)
    return KvGate(ThreadServer(app).start(), servers, model)
