"""Gateway-side G4 pieces against real servers on loopback: the worker's prefetch/stats HTTP endpoint
(the same server the connector runs inside vLLM, here around a real store and stager), the prefetch
client, the bandwidth calibration, and the index rebuild/GC hooks with the in-memory index."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from cache_tier.inventory import gc_store, rebuild_index
from cache_tier.prefetch_client import G4Bandwidth, G4Prefetcher
from cache_tier.prefetch_server import serve_in_thread
from cache_tier.stager import Stager
from cache_tier.store import G4Store, Namespace
from indexer.index.memory import MemoryIndex
from tests.support.procs import free_port

B = 32
NS = Namespace(model="tiny", dtype="bfloat16", block_size=B, layer_shapes=((4 * B * 128,),) * 2)


def toks(i):
    return list(range(i * B, (i + 1) * B))


def fill(store: G4Store, hashes):
    for i, h in enumerate(hashes):
        store.put(h, toks(i), None, torch.full((2, 4 * B * 128), float(i)).to(torch.bfloat16))


class Endpoint:
    """What the connector's worker side exposes to the HTTP server: cfg.model, stager, stats()."""

    def __init__(self, store: G4Store):
        self.cfg = type("Cfg", (), {"model": NS.model})()
        self.store = store
        self.stager = Stager(store, capacity_bytes=4 * store.file_bytes)
        self.load_bytes, self.load_seconds = 0, 0.0

    def stats(self):
        return {
            "load_bytes": self.load_bytes,
            "load_seconds": self.load_seconds,
            "block_bytes": self.store.file_bytes,
            "staging": self.stager.stats(),
            **getattr(self, "extra", {}),
        }


@pytest.fixture
def endpoint(tmp_path):
    ep = Endpoint(G4Store(tmp_path, NS))
    port = free_port()
    srv = serve_in_thread(ep, "127.0.0.1", port)
    ep.url = f"http://127.0.0.1:{port}"
    yield ep
    srv.shutdown()
    ep.stager.close()


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


async def test_prefetch_order_stages_blocks_and_is_idempotent(endpoint):
    fill(endpoint.store, [11, 12, 13])
    pf = G4Prefetcher(timeout_s=2.0)
    try:
        assert await pf.order(endpoint.url, "tiny", [11, 12, 13, 99]) == "sent"
        assert wait_for(lambda: endpoint.stager.stats()["staged"] == 3)
        assert endpoint.stager.stats()["stage_misses"] == 1  # 99 is not on G4: harmless
        assert await pf.order(endpoint.url, "tiny", [11, 12]) == "sent"  # again: nothing new is read
        assert endpoint.stager.stats()["staged"] == 3
        # the connector takes staged blocks first, checking token ids
        assert endpoint.stager.take(11, toks(1)) is None  # wrong ids: refused
        got = endpoint.stager.take(12, toks(1))
        assert got is not None and got.numel() == NS.payload_bytes
        # bounded: staging never exceeds its capacity (4 blocks) however much is ordered
        fill(endpoint.store, list(range(100, 110)))
        assert await pf.order(endpoint.url, "tiny", list(range(100, 110))) == "sent"
        assert wait_for(lambda: endpoint.stager.stats()["in_flight"] == 0)
        st = endpoint.stager.stats()
        assert st["blocks"] <= 4 and st["bytes"] <= st["capacity_bytes"]
        assert pf.counters["sent"] == 3
    finally:
        await pf.aclose()


async def test_prefetch_refusals_and_unreachable_worker(endpoint):
    import httpx

    async with httpx.AsyncClient() as c:
        r = await c.post(endpoint.url + "/kvgate/prefetch", json={"model": "other", "hashes": [1]})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        r = await c.post(endpoint.url + "/kvgate/prefetch", json={"hashes": ["zz-not-hex"]})
        assert r.status_code == 400 and "error" in r.json()
        r = await c.post(endpoint.url + "/kvgate/prefetch", content=b"{not json")
        assert r.status_code == 400
    pf = G4Prefetcher(timeout_s=0.5)
    t0 = time.monotonic()
    # no answer (a refused connection) fails; an answer other than 202 is the connector declining
    assert await pf.order(f"http://127.0.0.1:{free_port()}", "tiny", [1, 2]) == "failed"
    assert time.monotonic() - t0 < 5
    assert await pf.order(endpoint.url, "other", [1]) == "declined"  # the 404 above
    assert await pf.order(None, "tiny", [1]) == "skipped"
    assert pf.counters == {"sent": 0, "declined": 1, "failed": 1, "skipped": 1, "hashes": 0}
    await pf.aclose()


def test_the_prefetch_endpoint_refuses_a_negative_length_and_frees_stalled_connections(tmp_path, monkeypatch):
    """A negative Content-Length is a 400 (read(-1) would take the body to EOF, past MAX_BODY); a client
    that stalls mid-body frees its handler thread after READ_TIMEOUT_S; past MAX_CONNECTIONS a connection is
    closed unanswered; and stopping the server releases its port."""
    import socket
    import threading

    from cache_tier import prefetch_server

    monkeypatch.setattr(prefetch_server, "READ_TIMEOUT_S", 0.3)
    monkeypatch.setattr(prefetch_server, "MAX_CONNECTIONS", 4)
    ep = Endpoint(G4Store(tmp_path, NS))
    port = free_port()
    srv = serve_in_thread(ep, "127.0.0.1", port)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /kvgate/prefetch HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"
                  + b'{"hashes": []}' + b" " * (prefetch_server.MAX_BODY + 10))
        assert s.recv(64).startswith(b"HTTP/1.1 400 ")
        s.close()
        before = threading.active_count()
        stalled = []
        for _ in range(6):  # each sends half a body and stops
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(b"POST /kvgate/prefetch HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            stalled.append(c)
        time.sleep(0.1)
        assert threading.active_count() - before <= 4  # the two past the cap were closed at once
        assert wait_for(lambda: threading.active_count() <= before, timeout=5.0)  # the timeout freed the rest
        for c in stalled:
            c.close()
        r = httpx.post(f"http://127.0.0.1:{port}/kvgate/prefetch", json={"hashes": []}, timeout=5)
        assert r.status_code == 202  # and it still serves
    finally:
        prefetch_server.stop(srv)
        ep.stager.close()
    probe = socket.socket()
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the test's own TIME_WAIT connections
    probe.bind(("127.0.0.1", port))  # no listener left on it (shutdown alone kept it bound)
    probe.close()


async def test_a_prefetch_order_to_a_malformed_url_is_a_failure_not_an_exception():
    p = G4Prefetcher(timeout_s=0.2)
    try:
        assert await p.order("http://[::1:8200", "m", [1]) == "failed"
        assert p.counters["failed"] == 1
    finally:
        await p.aclose()


async def test_metrics_is_prometheus_text_with_failures_by_reason(endpoint):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    endpoint.load_bytes = 4096
    endpoint.extra = {
        "load_failures_by_reason": {"missing": 2, "foreign": 1},
        "save_failures_by_reason": {"disk_full": 3},
        "store": {"blocks": 5, "bytes": 640},
        "model": "tiny",
    }
    async with httpx.AsyncClient() as c:
        r = await c.get(endpoint.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = {
        (s.name, s.labels.get("reason")): (s.value, s.labels["model"])
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }
    assert got[("kvgate_g4_load_failures_total", "missing")] == (2, "tiny")
    assert got[("kvgate_g4_load_failures_total", "foreign")][0] == 1
    assert got[("kvgate_g4_save_failures_total", "disk_full")][0] == 3
    assert got[("kvgate_g4_load_bytes_total", None)][0] == 4096
    assert got[("kvgate_g4_store_blocks", None)][0] == 5
    assert got[("kvgate_g4_prefetch_orders_total", None)][0] == 0  # from the stager's counters
    assert ("kvgate_g4_loads_total", None) not in got  # absent from the stats: no series, not a zero


async def test_bandwidth_calibrated_from_connector_counters(endpoint):
    bw = G4Bandwidth(default_bytes_per_s=1e9, alpha=0.5)
    assert bw.bytes_per_s("w1") == 1e9
    endpoint.load_bytes, endpoint.load_seconds = 100 << 20, 0.5
    await bw.poll("w1", endpoint.url)
    assert bw.bytes_per_s("w1") == pytest.approx((100 << 20) / 0.5)
    endpoint.load_bytes, endpoint.load_seconds = 200 << 20, 1.5  # the next 100 MiB took 1 s
    await bw.poll("w1", endpoint.url)
    assert bw.bytes_per_s("w1") == pytest.approx(0.5 * (200 << 20) + 0.5 * (100 << 20))
    assert bw.seconds_for_blocks("w1", 10) == pytest.approx(
        10 * endpoint.store.file_bytes / bw.bytes_per_s("w1")
    )
    assert await bw.poll("w2", f"http://127.0.0.1:{free_port()}") is None
    assert bw.bytes_per_s("w2") == 1e9
    await bw.aclose()


async def test_rebuild_index_after_restart_and_gateway_gc(tmp_path):
    st = G4Store(tmp_path, NS)
    fill(st, [1, 2, 3, 4, 5])
    other = G4Store(
        tmp_path, Namespace(model="other", dtype="bfloat16", block_size=B, layer_shapes=((4 * B * 128,),) * 2)
    )
    fill(other, [77])
    index = MemoryIndex()
    assert await rebuild_index(index, "tiny", str(tmp_path)) == 5
    res = await index.lookup("tiny", [1, 2, 3, 4, 5, 6])
    assert res.g4 == 5
    assert (await index.lookup("other", [77])).g4 == 0  # not rebuilt: another model
    import os

    for i, h in enumerate([1, 2, 3, 4, 5]):
        os.utime(st.path(h), (1000 + i, 1000 + i))
    evicted = await gc_store(index, "tiny", str(tmp_path), capacity_bytes=int(3.2 * st.file_bytes))
    assert sorted(evicted) == [1, 2, 3]
    assert (await index.lookup("tiny", [4, 5])).g4 == 2
    assert (await index.lookup("tiny", [1])).g4 == 0


async def test_gateway_prefetcher_orders_and_calibrates_the_cost_model(endpoint):
    """The gateway's G4 prefetcher (router/prefetch.py) against the connector endpoint on loopback: the
    order stages the blocks, and the worker's G4 price then follows the connector's measured bandwidth."""
    from urllib.parse import urlsplit

    from indexer.index.base import WorkerMatch
    from router.config import Settings, WorkerConfig
    from router.cost import CostModel
    from router.prefetch import G4Prefetcher as GatewayPrefetcher
    from router.prefetch import make_prefetcher
    from router.worker import Worker

    bare = make_prefetcher(Settings())  # no fleet port: a worker without its own endpoint gets no order
    nowhere = Worker(name="w0", url="http://127.0.0.1:1", config=WorkerConfig(url="http://127.0.0.1:1"))
    assert bare.base_url(nowhere) is None and await bare.order(nowhere, "tiny", [1]) == "skipped"
    assert bare.client.counters["sent"] + bare.client.counters["failed"] == 0
    await bare.aclose()
    port = urlsplit(endpoint.url).port
    settings = Settings(g4={"prefetch_port": port, "stats_interval_s": 0.0})
    pf = make_prefetcher(settings)
    assert isinstance(pf, GatewayPrefetcher)
    w = Worker(name="w1", url="http://127.0.0.1:1", config=WorkerConfig(url="http://127.0.0.1:1"))
    cost = CostModel(settings.routing)
    before = cost.score(w, WorkerMatch(), g4=10, num_tokens=10 * B + 1, block_size=B).g4_load_ms
    fill(endpoint.store, [21, 22])
    endpoint.load_bytes, endpoint.load_seconds = 64 << 20, 0.25  # the connector measured 256 MiB/s
    try:
        assert await pf.order(w, "tiny", [21, 22]) == "sent"
        assert wait_for(lambda: endpoint.stager.stats()["staged"] == 2)
        assert w.g4_bytes_per_s == pytest.approx((64 << 20) / 0.25)
        assert w.g4_bytes_per_block == endpoint.store.file_bytes
        after = cost.score(w, WorkerMatch(), g4=10, num_tokens=10 * B + 1, block_size=B).g4_load_ms
        assert after == pytest.approx(10 * endpoint.store.file_bytes / ((64 << 20) / 0.25) * 1000.0)
        assert after != before
        gone = Worker(name="gone", url="http://127.0.0.1:1", config=WorkerConfig(url="http://127.0.0.1:1"))
        assert await pf.order(gone, "other", [21]) == "declined"  # the endpoint serves no model "other"
    finally:
        await pf.aclose()


async def test_two_workers_on_one_host_each_get_their_own_prefetch_order(tmp_path):
    """Per-worker prefetch endpoints (WorkerConfig.prefetch_url; issue #13): two workers on one host, two
    connector endpoints on different ports (real prefetch servers around real stores and stagers). Each
    plan's order goes to its own worker's endpoint; a worker without its own URL falls back to the
    fleet's g4.prefetch_port on its host; one with neither gets none. /admin/workers shows the URLs."""
    from indexer.index.memory import MemoryIndex as Index
    from router.config import Settings, WorkerConfig
    from router.prefetch import make_prefetcher
    from router.registry import WorkerRegistry

    eps, servers = [], []
    for i in range(3):
        ep = Endpoint(G4Store(tmp_path / f"w{i}", NS))
        port = free_port()
        servers.append(serve_in_thread(ep, "127.0.0.1", port))
        ep.url = f"http://127.0.0.1:{port}"
        eps.append(ep)
        fill(ep.store, [101, 102, 103])
    fleet_port = int(eps[2].url.rsplit(":", 1)[1])
    settings = Settings(g4={"prefetch_port": fleet_port, "stats_interval_s": 0.0}, workers=[
        WorkerConfig(url="http://127.0.0.1:8001", name="a", prefetch_url=eps[0].url + "/"),
        WorkerConfig(url="http://127.0.0.1:8002", name="b", prefetch_url=eps[1].url),
        WorkerConfig(url="http://127.0.0.1:8003", name="c")])  # the fleet's port on its host
    reg = WorkerRegistry(settings, Index())
    ws = [await reg.add(cfg, probe=False) for cfg in settings.workers]
    assert [w.prefetch_url for w in ws] == [eps[0].url, eps[1].url, eps[2].url]
    assert ws[0].to_dict()["prefetch_url"] == eps[0].url
    pf = make_prefetcher(settings)
    try:
        assert await pf.order(ws[0], "tiny", [101]) == "sent"
        assert await pf.order(ws[1], "tiny", [102, 103]) == "sent"
        assert wait_for(lambda: eps[0].stager.stats()["staged"] == 1)
        assert wait_for(lambda: eps[1].stager.stats()["staged"] == 2)
        assert eps[2].stager.stats()["staged"] == 0  # nothing went to the fleet-wide port
        assert await pf.order(ws[2], "tiny", [101, 102, 103]) == "sent"
        assert wait_for(lambda: eps[2].stager.stats()["staged"] == 3)
        assert eps[0].stager.stats()["staged"] == 1 and eps[1].stager.stats()["staged"] == 2
        none = Settings(workers=[WorkerConfig(url="http://127.0.0.1:8004", name="d")])
        d = await WorkerRegistry(none, Index()).add(none.workers[0], probe=False)
        bare = make_prefetcher(none)
        assert d.prefetch_url is None and await bare.order(d, "tiny", [101]) == "skipped"
        assert bare.client.counters["skipped"] + bare.client.counters["sent"] == 0  # not even tried
        await bare.aclose()
    finally:
        await pf.aclose()
        for srv in servers:
            srv.shutdown()
        for ep in eps:
            ep.stager.close()


async def test_each_data_parallel_rank_gets_its_prefetch_order_on_its_own_port(tmp_path):
    """A server with ``--data-parallel-size 2`` runs two engines on one host, each with kvgate's connector:
    rank r's connector serves on the configured prefetch port + r (as vLLM offsets its event ports; both on
    one port, the second engine failed to start). The gateway routes to each rank on its own, so a rank's
    order goes to that rank's port: one on the server's port staged the blocks in the other engine."""
    from indexer.index.memory import MemoryIndex as Index
    from router.config import Settings, WorkerConfig
    from router.prefetch import make_prefetcher
    from router.registry import WorkerRegistry

    for _ in range(20):  # two free ports in a row
        port = free_port()
        try:
            servers = []
            eps = []
            for r in range(2):
                ep = Endpoint(G4Store(tmp_path / f"dp{r}", NS))
                servers.append(serve_in_thread(ep, "127.0.0.1", port + r))
                eps.append(ep)
            break
        except OSError:
            for srv in servers:
                srv.shutdown()
                srv.server_close()
    else:
        pytest.skip("no two free ports in a row")
    for ep in eps:
        fill(ep.store, [101, 102, 103])
    settings = Settings(g4={"prefetch_port": port, "stats_interval_s": 0.0},
                        workers=[WorkerConfig(url="http://127.0.0.1:8001", name="dp")])
    reg = WorkerRegistry(settings, Index())
    w = await reg.add(settings.workers[0], probe=False)
    reg._set_sources(w, {str(r): {"endpoint": f"tcp://*:{5557 + r}"} for r in range(2)})  # /kv_event_sources
    r0, r1 = w.targets()
    assert (r0.name, r1.name) == ("dp@dp0", "dp@dp1")
    assert (r0.prefetch_url, r1.prefetch_url) == (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}")
    pf = make_prefetcher(settings)
    try:
        assert await pf.order(r1, "tiny", [102, 103]) == "sent"
        assert wait_for(lambda: eps[1].stager.stats()["staged"] == 2)
        assert eps[0].stager.stats()["staged"] == 0  # not to rank 0's engine
        assert await pf.order(r0, "tiny", [101]) == "sent"
        assert wait_for(lambda: eps[0].stager.stats()["staged"] == 1)
        assert w.prefetch_url == f"http://127.0.0.1:{port}"  # the server's own: rank 0's
    finally:
        await pf.aclose()
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for ep in eps:
            ep.stager.close()
