"""Kubernetes discovery against a fake API server.

A real Kubernetes API server cannot run here (no kube-apiserver/etcd, kind or k3s on this machine or in CI),
so these tests run ``tests.k8s.fake_apiserver.FakeApiServer``: a real HTTP server on loopback speaking the
EndpointSlice list/watch and pod JSON of the API. kvgate's discovery talks to it through the real
``kubernetes`` client, so requests, watch streaming, resourceVersions, 410 Gone and reconnects are real.
"""

from __future__ import annotations

import asyncio

import pytest
import yaml
from kubernetes import client

from router.config import DiscoveryConfig, Settings, WorkerConfig
from router.discovery import StaticDiscovery, create_discovery
from router.discovery.kubernetes import KubernetesDiscovery, endpoints_of_slice
from tests.k8s.fake_apiserver import FakeApiServer, endpoint_slice
from tests.support.procs import free_port

WAIT = 30.0  # generous: the machine is shared and loaded


class Recorder:
    """The gateway side: records what discovery announces, like a WorkerRegistry would."""

    def __init__(self, fail_for: set[str] = frozenset()) -> None:
        self.calls: list[tuple[str, object]] = []
        self.workers: dict[str, WorkerConfig] = {}
        self.fail_for = set(fail_for)

    async def on_add(self, worker: WorkerConfig) -> None:
        self.calls.append(("add", worker))
        if worker.name in self.fail_for:
            raise RuntimeError("registry refused the worker")
        self.workers[worker.name] = worker

    async def on_remove(self, name: str) -> None:
        self.calls.append(("remove", name))
        self.workers.pop(name, None)

    async def until(self, predicate, timeout: float = WAIT) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"condition not reached; calls: {self.calls}")
            await asyncio.sleep(0.02)


@pytest.fixture
def apiserver():
    srv = FakeApiServer().start()
    yield srv
    srv.stop()


def make_discovery(url: str, rec: Recorder, **kw) -> KubernetesDiscovery:
    cfg = DiscoveryConfig(kind="kubernetes", namespace="default", label_selector="app=vllm", port=8000)
    api = client.ApiClient(client.Configuration(host=url))
    kw.setdefault("backoff_initial_s", 0.05)
    kw.setdefault("backoff_max_s", 0.5)
    return KubernetesDiscovery(cfg, rec.on_add, rec.on_remove, api_client=api, **kw)


def list_requests(srv: FakeApiServer) -> list[dict]:
    return [q for p, q in srv.requests if p.endswith("/endpointslices") and q.get("watch") != "true"]


def watch_requests(srv: FakeApiServer) -> list[dict]:
    return [q for p, q in srv.requests if p.endswith("/endpointslices") and q.get("watch") == "true"]


async def test_lists_ready_pods_by_label_with_annotated_event_endpoints(apiserver):
    apiserver.put_slice(
        endpoint_slice(
            "vllm-abc",
            [
                {"ip": "10.0.0.1", "pod": "vllm-0"},
                {"ip": "10.0.0.2", "pod": "vllm-1", "ready": False},
                {"ip": "10.0.0.3", "pod": "vllm-2", "terminating": True},
            ],
        )
    )
    apiserver.put_slice(
        endpoint_slice("other-xyz", [{"ip": "10.0.9.9", "pod": "other-0"}], labels={"app": "other"})
    )
    apiserver.put_pod(
        "vllm-0", {"kvgate.io/events-endpoint": "tcp://*:5557", "kvgate.io/replay-endpoint": "tcp://*:6557",
                   "kvgate.io/prefetch-url": "http://*:8201", "kvgate.io/g4-tier": "cephfs-b"}
    )
    rec = Recorder()
    d = make_discovery(apiserver.url, rec)
    await d.start()
    try:
        assert await d.wait_synced(WAIT)
        assert rec.workers == {
            "vllm-0": WorkerConfig(
                url="http://10.0.0.1:8000",
                name="vllm-0",
                events_endpoint="tcp://10.0.0.1:5557",
                replay_endpoint="tcp://10.0.0.1:6557",
                prefetch_url="http://10.0.0.1:8201",
                g4_tier="cephfs-b",
            )
        }
        assert list_requests(apiserver)[0]["labelSelector"] == "app=vllm"
    finally:
        await d.stop()


async def test_watch_announces_ready_changed_and_deleted_pods(apiserver):
    apiserver.put_slice(
        endpoint_slice(
            "vllm-abc",
            [{"ip": "10.0.0.1", "pod": "vllm-0"}, {"ip": "10.0.0.2", "pod": "vllm-1", "ready": False}],
        )
    )
    rec = Recorder()
    d = make_discovery(apiserver.url, rec)
    await d.start()
    try:
        assert await d.wait_synced(WAIT)
        assert set(rec.workers) == {"vllm-0"}
        apiserver.wait_for_request(lambda r: r[1].get("watch") == "true")
        # The watch starts from the list's resourceVersion (nothing changed since), with bookmarks.
        first_watch = watch_requests(apiserver)[0]
        assert first_watch["resourceVersion"] == apiserver.resource_version
        assert first_watch["allowWatchBookmarks"] == "true"

        apiserver.put_slice(
            endpoint_slice(
                "vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}, {"ip": "10.0.0.2", "pod": "vllm-1"}]
            )
        )
        await rec.until(lambda: "vllm-1" in rec.workers)
        assert rec.workers["vllm-1"].url == "http://10.0.0.2:8000"
        assert rec.workers["vllm-1"].events_endpoint is None  # no annotation: the gateway asks the worker

        # vllm-0 restarts with a new IP: re-registered under the same name.
        apiserver.put_slice(
            endpoint_slice(
                "vllm-abc", [{"ip": "10.0.0.7", "pod": "vllm-0"}, {"ip": "10.0.0.2", "pod": "vllm-1"}]
            )
        )
        await rec.until(lambda: rec.workers.get("vllm-0", WorkerConfig(url="")).url == "http://10.0.0.7:8000")
        assert ("remove", "vllm-0") in rec.calls

        apiserver.delete_slice("vllm-abc")
        await rec.until(lambda: not rec.workers)
        assert len(list_requests(apiserver)) == 1  # all of it came through the watch
    finally:
        await d.stop()


async def test_resumes_from_last_resource_version_after_connection_loss(apiserver):
    apiserver.put_slice(endpoint_slice("vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}]))
    rec = Recorder()
    d = make_discovery(apiserver.url, rec)
    await d.start()
    try:
        assert await d.wait_synced(WAIT)
        apiserver.wait_for_request(lambda r: r[1].get("watch") == "true")
        seen_rv = d.resource_version
        apiserver.hold_watches()  # connection cut, API answers 503 for a while
        apiserver.put_slice(endpoint_slice("vllm-def", [{"ip": "10.0.0.2", "pod": "vllm-1"}]))
        await rec.until(lambda: d.errors >= 2)
        assert set(rec.workers) == {"vllm-0"}  # kept while the API is unreachable
        apiserver.release_watches()
        await rec.until(lambda: "vllm-1" in rec.workers)
        # No relist: the watch resumed from the resourceVersion seen before the outage.
        assert len(list_requests(apiserver)) == 1
        assert watch_requests(apiserver)[-1]["resourceVersion"] == seen_rv
    finally:
        await d.stop()


async def test_relists_when_resource_version_is_gone(apiserver):
    apiserver.put_slice(endpoint_slice("vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}]))
    apiserver.put_slice(endpoint_slice("vllm-def", [{"ip": "10.0.0.2", "pod": "vllm-1"}]))
    rec = Recorder()
    d = make_discovery(apiserver.url, rec)
    await d.start()
    try:
        assert await d.wait_synced(WAIT)
        assert set(rec.workers) == {"vllm-0", "vllm-1"}
        apiserver.wait_for_request(lambda r: r[1].get("watch") == "true")
        apiserver.hold_watches()
        apiserver.delete_slice("vllm-def")
        apiserver.put_slice(endpoint_slice("vllm-ghi", [{"ip": "10.0.0.3", "pod": "vllm-2"}]))
        apiserver.compact()  # the client's resourceVersion is now older than the history: 410 Gone
        apiserver.release_watches()
        await rec.until(lambda: set(rec.workers) == {"vllm-0", "vllm-2"})
        assert ("remove", "vllm-1") in rec.calls
        assert len(list_requests(apiserver)) == 2
        assert d.relists == 2
    finally:
        await d.stop()


async def test_backs_off_until_the_api_server_comes_up():
    port = free_port()
    rec = Recorder()
    d = make_discovery(f"http://127.0.0.1:{port}", rec, request_timeout_s=2.0)
    await d.start()
    srv = None
    try:
        await rec.until(lambda: d.errors >= 3)  # connection refused, retried with backoff
        assert not rec.workers
        srv = FakeApiServer(port)
        srv.put_slice(endpoint_slice("vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}]))
        srv.start()
        assert await d.wait_synced(WAIT)
        assert set(rec.workers) == {"vllm-0"}
    finally:
        await d.stop()
        if srv is not None:
            srv.stop()


async def test_stop_interrupts_an_open_watch_and_never_blocks_the_loop(apiserver):
    """The watch timeout is 300 s; stop() returning well before means it cut the blocking read."""
    apiserver.put_slice(endpoint_slice("vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}]))
    rec = Recorder()
    d = make_discovery(apiserver.url, rec, watch_timeout_s=300)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    t = asyncio.create_task(ticker())
    await d.start()
    assert await d.wait_synced(WAIT)
    await rec.until(lambda: apiserver.watches_open == 1)
    before = ticks
    await asyncio.sleep(0.3)  # the watch is blocked reading in its thread; the loop keeps running
    assert ticks > before
    thread = d._thread
    await asyncio.wait_for(d.stop(), 60)
    assert thread is not None and not thread.is_alive()
    t.cancel()


async def test_a_failing_callback_does_not_stop_discovery_and_is_retried(apiserver):
    apiserver.put_slice(endpoint_slice("vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}]))
    rec = Recorder(fail_for={"vllm-0"})
    d = make_discovery(apiserver.url, rec)
    await d.start()
    try:
        assert await d.wait_synced(WAIT)
        assert [c for c in rec.calls if c[0] == "add"][0][1].name == "vllm-0"
        assert "vllm-0" not in d.workers()  # refused: not counted as announced
        rec.fail_for.clear()  # the registry accepts it now
        apiserver.put_slice(endpoint_slice("vllm-def", [{"ip": "10.0.0.2", "pod": "vllm-1"}]))
        await rec.until(lambda: set(rec.workers) == {"vllm-0", "vllm-1"})
        assert set(d.workers()) == {"vllm-0", "vllm-1"}
    finally:
        await d.stop()


async def test_connects_with_the_kubeconfig_when_no_client_is_given(apiserver, tmp_path, monkeypatch):
    """Outside a cluster (no service account) discovery uses $KUBECONFIG, with its credentials."""
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": apiserver.url}}],
                "users": [{"name": "dev", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    apiserver.put_slice(endpoint_slice("vllm-abc", [{"ip": "10.0.0.1", "pod": "vllm-0"}]))
    rec = Recorder()
    d = KubernetesDiscovery(
        DiscoveryConfig(kind="kubernetes", namespace="default"), rec.on_add, rec.on_remove
    )
    await d.start()
    try:
        assert await d.wait_synced(WAIT)
        assert set(rec.workers) == {"vllm-0"}
        assert apiserver.authorizations[0] == "Bearer s3cret"
    finally:
        await d.stop()


def test_slice_parsing_ports_ipv6_and_missing_conditions():
    cfg = DiscoveryConfig(kind="kubernetes", port=8000, scheme="http")
    sl = endpoint_slice(
        "s",
        [{"ip": "fd00::5", "pod": "p"}],
        address_type="IPv6",
        ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 8001}],
    )
    del sl["endpoints"][0]["conditions"]  # nil conditions mean ready
    assert endpoints_of_slice(sl, cfg) == [
        {"name": "p", "address": "fd00::5", "url": "http://[fd00::5]:8001", "pod": "p"}
    ]
    sl = endpoint_slice("s", [{"ip": "10.1.1.1", "pod": "p"}], ports=[{"port": 9000}])
    assert endpoints_of_slice(sl, cfg)[0]["url"] == "http://10.1.1.1:9000"
    sl = endpoint_slice("s", [{"ip": "10.1.1.1", "pod": "p"}], ports=[])
    assert endpoints_of_slice(sl, cfg)[0]["url"] == "http://10.1.1.1:8000"


async def test_static_discovery_and_factory():
    rec = Recorder()
    workers = [WorkerConfig(url="http://a:8000"), WorkerConfig(url="http://b:8000", name="b")]
    d = create_discovery(Settings(workers=workers), rec.on_add, rec.on_remove)
    assert isinstance(d, StaticDiscovery)
    await d.start()
    await d.stop()
    assert set(rec.workers) == {"http://a:8000", "b"}
    k = create_discovery(
        Settings(discovery=DiscoveryConfig(kind="kubernetes", namespace="ns")),
        rec.on_add,
        rec.on_remove,
        api_client=object(),
    )
    assert isinstance(k, KubernetesDiscovery) and k.namespace == "ns"
