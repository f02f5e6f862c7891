"""Worker discovery: where the gateway's vLLM workers come from.

Discovery only announces workers; it never touches the gateway. The gateway passes two async callbacks,
``on_add(WorkerConfig)`` and ``on_remove(name)``, and connects them to its WorkerRegistry, so discovery
sources can be swapped and tested without a gateway. A worker is identified by its name (for Kubernetes,
the pod name); a changed worker is announced as ``on_remove(name)`` followed by ``on_add(new_config)``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from router.config import WorkerConfig

if TYPE_CHECKING:
    from router.config import Settings

OnAdd = Callable[[WorkerConfig], Awaitable[None]]
OnRemove = Callable[[str], Awaitable[None]]

log = logging.getLogger(__name__)


class Discovery(Protocol):
    """A source of workers. ``start`` returns once the source is running (not necessarily synced)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def worker_name(worker: WorkerConfig) -> str:
    """The name a worker is announced under: its configured name, else its URL."""
    return worker.name or worker.url


class StaticDiscovery:
    """The fixed list from the configuration: every worker is added once at start, nothing is removed."""

    def __init__(self, workers: list[WorkerConfig], on_add: OnAdd, on_remove: OnRemove) -> None:
        self._workers = [w if w.name else w.model_copy(update={"name": worker_name(w)}) for w in workers]
        self._on_add = on_add
        self._on_remove = on_remove

    async def start(self) -> None:
        for worker in self._workers:
            try:
                await self._on_add(worker)
            except Exception:  # one bad worker must not keep the others out
                log.exception("discovery: adding worker %s failed", worker.name)

    async def stop(self) -> None:
        return None


def create_discovery(settings: Settings, on_add: OnAdd, on_remove: OnRemove, **kwargs) -> Discovery:
    """The discovery source that ``settings.discovery.kind`` names (static workers or Kubernetes)."""
    if settings.discovery.kind == "kubernetes":
        from router.discovery.kubernetes import KubernetesDiscovery  # needs the k8s extra

        return KubernetesDiscovery(settings.discovery, on_add, on_remove, **kwargs)
    return StaticDiscovery(settings.workers, on_add, on_remove)


__all__ = ["Discovery", "OnAdd", "OnRemove", "StaticDiscovery", "create_discovery", "worker_name"]
