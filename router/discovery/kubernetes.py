"""Kubernetes discovery: vLLM pods from the EndpointSlices selected by a label, via the official client.

Why EndpointSlices: they carry exactly the pods a Service considers ready, with their IPs and ports, and they
change when a pod starts, becomes ready, terminates or moves. Slices inherit their Service's labels, so
``app=vllm`` (or ``kubernetes.io/service-name=vllm``) selects the slices of the vLLM Service.

How: the official client's list and watch are blocking, so they run in one daemon thread (never on the event
loop). The thread lists once, then watches from the list's resourceVersion, resumes from the last
resourceVersion it saw after a dropped connection or a watch timeout, relists when the server answers 410
Gone, and backs off exponentially while the API server is unreachable. After every change it builds the
full set of ready workers and hands the latest one to the event loop; a task there diffs it with what it
announced before and awaits the callbacks. Snapshots coalesce, so slow callbacks never grow a queue. While
the API server is unreachable the last known workers are kept: a stale list beats an empty fleet.

Each worker's events endpoint comes from its pod's annotation (``kvgate.io/events-endpoint``, and
``kvgate.io/replay-endpoint`` for replay) when present, with ``*`` replaced by the pod IP, so one pod
template annotation such as ``tcp://*:5557`` fits every replica. Without it the gateway asks the worker's
``/kv_event_sources``. Two more annotations are read the same way: ``kvgate.io/prefetch-url`` (kvgate's
connector endpoint on the pod, e.g. ``http://*:8200``; default: ``g4.prefetch_port`` on the pod IP) and
``kvgate.io/g4-tier`` (the shared G4 tier the pod mounts; default ``g4.tier``), see docs/g4.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any

from router.config import DiscoveryConfig, WorkerConfig
from router.discovery import OnAdd, OnRemove

log = logging.getLogger(__name__)

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _namespace(config: DiscoveryConfig) -> str:
    """The configured namespace, else the pod's own (in-cluster), else ``default``."""
    if config.namespace:
        return config.namespace
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def _pick_port(ports: list[dict[str, Any]], wanted: int) -> int:
    """The slice port that serves vLLM's HTTP API: ``wanted`` if listed, else one named ``http``, else the
    only one; a slice without ports means the Service passes every port, so ``wanted`` it is."""
    numbers = [p.get("port") for p in ports if isinstance(p, dict) and isinstance(p.get("port"), int)]
    if wanted in numbers or not numbers:
        return wanted
    for p in ports:
        if p.get("name") == "http" and isinstance(p.get("port"), int):
            return p["port"]
    return numbers[0] if len(numbers) == 1 else wanted


def endpoints_of_slice(slice_: dict[str, Any], config: DiscoveryConfig) -> list[dict[str, str]]:
    """Ready endpoints of one EndpointSlice (API JSON, camelCase) as ``{name, address, url, pod}``.

    Per the API, a missing ``ready`` condition means ready; terminating endpoints are left out even when
    still serving, so the gateway stops sending new requests to pods that are going away.
    """
    port = _pick_port(slice_.get("ports") or [], config.port)
    out = []
    for ep in slice_.get("endpoints") or []:
        if not isinstance(ep, dict):
            continue
        cond = ep.get("conditions") or {}
        if cond.get("ready") is False or cond.get("terminating") is True:
            continue
        addresses = [a for a in ep.get("addresses") or [] if isinstance(a, str) and a]
        if not addresses:
            continue
        address = addresses[0]
        ref = ep.get("targetRef") or {}
        pod = ref.get("name") if ref.get("kind") == "Pod" else None
        host = f"[{address}]" if ":" in address else address
        out.append(
            {
                "name": pod or ep.get("hostname") or address,
                "address": address,
                "url": f"{config.scheme}://{host}:{port}",
                "pod": pod or "",
            }
        )
    return out


def _with_address(endpoint: str | None, address: str) -> str | None:
    """``tcp://*:5557`` -> ``tcp://<pod ip>:5557``: one pod template annotation serves every replica."""
    if not endpoint:
        return None
    host = f"[{address}]" if ":" in address else address
    return endpoint.replace("*", host)


class KubernetesDiscovery:
    """Announces the ready pods behind the EndpointSlices that match ``config.label_selector``.

    ``api_client`` is a ``kubernetes.client.ApiClient``; without one the in-cluster service account is
    used, falling back to ``$KUBECONFIG``/``~/.kube/config``.
    """

    def __init__(
        self,
        config: DiscoveryConfig,
        on_add: OnAdd,
        on_remove: OnRemove,
        *,
        api_client: Any = None,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 10.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self._config = config
        self._on_add = on_add
        self._on_remove = on_remove
        self._api_client = api_client
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self.namespace = _namespace(config)
        # Shared between the watch thread and the loop; guarded by _lock.
        self._lock = threading.Lock()
        self._latest: dict[str, WorkerConfig] | None = None
        self._watch: Any = None
        # Thread-only state.
        self._slices: dict[str, list[dict[str, str]]] = {}
        # (pod, IP) -> its annotated settings: events and replay endpoints, prefetch URL, G4 tier
        self._pod_endpoints: dict[tuple[str, str], tuple[str | None, ...]] = {}
        # Loop-only state.
        self._announced: dict[str, WorkerConfig] = {}
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._synced: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self.resource_version: str | None = None
        self.relists = 0
        self.errors = 0

    # ---- event-loop side -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._synced = asyncio.Event()
        self._stopping.clear()
        self._task = asyncio.create_task(self._apply_loop(), name="kvgate-k8s-discovery-apply")
        self._thread = threading.Thread(target=self._run, name="kvgate-k8s-discovery", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop watching; the announced workers stay registered (the gateway is going away anyway)."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        # Watch.stop() shuts the watch socket down, which unblocks the thread's read. The thread may be
        # between requests when we look, so keep stopping whatever watch it holds until it has exited.
        deadline = asyncio.get_running_loop().time() + self._request_timeout_s + 5
        while thread is not None and thread.is_alive() and asyncio.get_running_loop().time() < deadline:
            with self._lock:
                watch = self._watch
            if watch is not None:
                watch.stop()
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def wait_synced(self, timeout: float) -> bool:
        """True once the first listing has been announced (for readiness), False after ``timeout``."""
        assert self._synced is not None, "start() first"
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def workers(self) -> dict[str, WorkerConfig]:
        """The workers announced so far, by name."""
        return dict(self._announced)

    async def _apply_loop(self) -> None:
        assert self._wake is not None and self._synced is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                snapshot = self._latest
            if snapshot is None:
                continue
            await self._apply(snapshot)
            self._synced.set()

    async def _apply(self, snapshot: dict[str, WorkerConfig]) -> None:
        for name in [n for n in self._announced if n not in snapshot]:
            del self._announced[name]
            await self._call(self._on_remove, name)
        for name, worker in snapshot.items():
            old = self._announced.get(name)
            if old == worker:
                continue
            if old is not None:  # same pod name, new IP or endpoints: re-register it
                del self._announced[name]
                await self._call(self._on_remove, name)
            # A refused add is not recorded, so the next snapshot offers the worker again.
            if await self._call(self._on_add, worker):
                self._announced[name] = worker

    @staticmethod
    async def _call(callback, arg) -> bool:
        try:
            await callback(arg)
            return True
        except Exception:  # a failing callback must not stop discovery
            log.exception("discovery: callback %s(%r) failed", getattr(callback, "__name__", callback), arg)
            return False

    def _publish(self, snapshot: dict[str, WorkerConfig]) -> None:
        """Called in the thread: keep only the newest snapshot and wake the loop."""
        with self._lock:
            self._latest = snapshot
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop is closed: we are shutting down
            self._stopping.set()

    # ---- thread side -----------------------------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = self._backoff_initial_s
        gone_in_a_row = 0
        while not self._stopping.is_set():
            try:
                if self._api_client is None:
                    self._api_client = self._default_api_client()
                if self.resource_version is None:
                    self._list()
                if self._watch_once():
                    backoff = self._backoff_initial_s
                gone_in_a_row = 0
                continue
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion is too old: list again, then watch from there
                    log.info("discovery: resourceVersion %s expired, relisting", self.resource_version)
                    self.resource_version = None
                    gone_in_a_row += 1
                    if gone_in_a_row == 1:
                        continue
                error: Exception = exc
            except Exception as exc:  # connection refused, reset, timeouts, bad config: retry with backoff
                error = exc
            if self._stopping.is_set():
                break
            self.errors += 1
            log.warning("discovery: Kubernetes API error (retrying in %.1fs): %s", backoff, error)
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)

    @staticmethod
    def _default_api_client():
        """The pod's service account in a cluster, else ``$KUBECONFIG``; the client's global default
        configuration is left alone."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            # The client reads $KUBECONFIG once at import time; read it now.
            config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg, persist_config=False
            )
        return client.ApiClient(cfg)

    def _list(self) -> None:
        from kubernetes import client

        api = client.DiscoveryV1Api(self._api_client)
        result = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self._config.label_selector,
            _request_timeout=self._request_timeout_s,
        )
        data = self._api_client.sanitize_for_serialization(result)
        self._slices = {}
        for item in data.get("items") or []:
            name = (item.get("metadata") or {}).get("name")
            if name:
                self._slices[name] = endpoints_of_slice(item, self._config)
        self.relists += 1
        self.resource_version = (data.get("metadata") or {}).get("resourceVersion") or ""
        self._publish(self._snapshot())

    def _watch_once(self) -> bool:
        """One watch request from ``resource_version``; True if it saw events or ended normally."""
        from kubernetes import client, watch

        api = client.DiscoveryV1Api(self._api_client)
        w = watch.Watch()
        with self._lock:
            self._watch = w
        if self._stopping.is_set():
            return False
        progressed = False
        try:
            stream = w.stream(
                api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=self._config.label_selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                _request_timeout=(self._request_timeout_s, self._watch_timeout_s + 30),
            )
            for event in stream:
                if self._stopping.is_set():
                    break
                progressed = True
                kind = event.get("type")
                obj = event.get("raw_object") or {}
                meta = obj.get("metadata") or {}
                if meta.get("resourceVersion"):
                    self.resource_version = meta["resourceVersion"]
                name = meta.get("name")
                if kind == "BOOKMARK" or not name:
                    continue
                if kind in ("ADDED", "MODIFIED"):
                    self._slices[name] = endpoints_of_slice(obj, self._config)
                elif kind == "DELETED":
                    self._slices.pop(name, None)
                else:
                    continue
                self._publish(self._snapshot())
            else:
                progressed = True  # the server closed the watch at timeout_seconds: resume from here
        finally:
            with self._lock:
                self._watch = None
        return progressed

    def _snapshot(self) -> dict[str, WorkerConfig]:
        """All ready workers over every slice; with dual-stack slices the first slice (by name) wins."""
        workers: dict[str, WorkerConfig] = {}
        seen_pods: set[tuple[str, str]] = set()
        for slice_name in sorted(self._slices):
            for ep in self._slices[slice_name]:
                if ep["name"] in workers:
                    continue
                events = replay = prefetch = tier = None
                if ep["pod"]:
                    key = (ep["pod"], ep["address"])
                    seen_pods.add(key)
                    events, replay, prefetch, tier = self._pod_annotations(key)
                workers[ep["name"]] = WorkerConfig(
                    url=ep["url"],
                    name=ep["name"],
                    events_endpoint=events,
                    replay_endpoint=replay,
                    prefetch_url=prefetch,
                    g4_tier=tier,
                )
        for key in [k for k in self._pod_endpoints if k not in seen_pods]:  # keep the cache bounded
            del self._pod_endpoints[key]
        return workers

    def _pod_annotations(self, key: tuple[str, str]) -> tuple[str | None, ...]:
        """The pod's event endpoints, prefetch URL and G4 tier from its annotations, read once per (pod,
        IP); errors are retried."""
        if key in self._pod_endpoints:
            return self._pod_endpoints[key]
        from kubernetes import client

        pod_name, address = key
        try:
            pod = client.CoreV1Api(self._api_client).read_namespaced_pod(
                pod_name,
                self.namespace,
                _request_timeout=self._request_timeout_s,
            )
        except Exception as exc:  # no RBAC for pods, pod gone, API hiccup: fall back to /kv_event_sources
            status = getattr(exc, "status", None)
            log.warning(
                "discovery: cannot read the annotations of pod %s/%s: %s",
                self.namespace,
                pod_name,
                f"HTTP {status} {getattr(exc, 'reason', '')}" if status else exc,
            )
            if status in (403, 404):  # will not change by asking again for this (pod, IP)
                self._pod_endpoints[key] = (None,) * 4
            return (None,) * 4
        annotations = (self._api_client.sanitize_for_serialization(pod).get("metadata") or {}).get(
            "annotations"
        ) or {}
        found = (
            _with_address(annotations.get(self._config.events_annotation), address),
            _with_address(annotations.get(self._config.replay_annotation), address),
            _with_address(annotations.get(self._config.prefetch_annotation), address),
            annotations.get(self._config.g4_tier_annotation),
        )
        self._pod_endpoints[key] = found
        return found
