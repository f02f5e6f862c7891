"""A short replay through the real gateway (in-process, in-memory index) in front of a simulated fleet:
``kv`` routing serves more prompt tokens from cache than ``round_robin`` on multi-turn sessions.

Everything is real and on loopback: the simulated workers' HTTP servers and ZMQ event sockets, the
gateway's uvicorn server and its event ingestion. Only hit rates are asserted, never timings."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import uvicorn

from bench import replay as rp
from bench.replay_workloads import WorkItem
from bench.sim.fleet import FleetConfig, SimFleet
from bench.sim.timing import DEFAULT_TIMING
from bench.sim.tokenizer import save_model_dir

pytestmark = pytest.mark.slow


def sessions(n_sessions=7, turns=4, first=600, per_turn=300, gap_s=40.0, seed=7,
             stagger_s=0.5) -> list[WorkItem]:
    """Distinct sessions (no shared prefix between them); each turn resends the history plus new text.
    7 sessions over 4 workers: round robin never sends a session's next turn to the same worker. Turns are
    far apart (2 s of wall time at 20x) so a loaded machine still finishes a turn before the next one."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n_sessions):
        hist = rng.integers(0, 32000, first).astype(np.uint32)
        for k in range(turns):
            out.append(WorkItem(at=s * stagger_s + k * gap_s, tokens=hist.copy(), max_tokens=8,
                                session=f"s{s}"))
            hist = np.concatenate([hist, rng.integers(0, 32000, per_turn).astype(np.uint32)])
    return sorted(out, key=lambda w: w.at)


class _Server(uvicorn.Server):
    def install_signal_handlers(self):
        pass


async def _run(policy: str, items, tok_dir: str, scale: float) -> dict:
    from indexer.index.memory import MemoryIndex
    from router.app import create_app
    from router.config import Settings

    # 4 workers, each able to hold ~2 sessions' histories: placement decides the hit rate
    cfg = FleetConfig(workers=4, num_blocks=320, block_size=16, timing=DEFAULT_TIMING.with_(time_scale=scale))
    async with SimFleet(cfg) as fleet:
        import socket

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        settings = Settings(
            host="127.0.0.1", port=port,
            workers=[{"url": w.url, "name": w.name, "events_endpoint": w.events_endpoint,
                      "replay_endpoint": w.replay_endpoint} for w in fleet.workers],
            models={"sim-model": {"tokenizer": tok_dir, "block_size": 16}},
            routing={"policy": policy}, health_interval_s=1.0)
        app = create_app(settings, index=MemoryIndex())
        server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                assert not task.done(), "gateway failed to start"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # event subscriptions connect
            res = await rp.replay(items, f"http://127.0.0.1:{port}", "sim-model", name=policy, time_scale=scale,
                                  worker_urls=[w.url for w in fleet.workers], progress=False, timeout_s=120)
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 30)
    return res.summary()


def test_kv_beats_round_robin_on_hit_rate(tmp_path):
    tok_dir = str(save_model_dir(tmp_path / "sim-model"))
    items = sessions()
    kv = asyncio.run(_run("kv", items, tok_dir, 20.0))
    rr = asyncio.run(_run("round_robin", items, tok_dir, 20.0))
    assert kv["failed"] == 0 and rr["failed"] == 0
    # the workers' own counters agree with the usage they reported
    assert kv["worker_hit_rate"] == pytest.approx(kv["hit_rate"], abs=1e-9)
    assert kv["hit_rate"] > rr["hit_rate"] + 0.1, (kv["hit_rate"], rr["hit_rate"])
