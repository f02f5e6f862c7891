"""Worker-state gauges the operator acts on through the admin API (draining, events connected), read
from the registry and the ingestor at scrape time (a custom collector on the gateway's own metrics
registry; nothing cached)."""
from __future__ import annotations

import logging

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("kvgate.admin")


class AdminCollector:
    def __init__(self, state) -> None:
        self.state = state

    def describe(self):
        return []  # values appear and vanish with workers: no fixed description at registration

    def collect(self):
        draining = GaugeMetricFamily("kvgate_worker_draining", "1 while a worker is drained (admin API)",
                                     labels=["worker"])
        connected = GaugeMetricFamily("kvgate_events_connected",
                                      "1 when the worker's KV event stream is connected", labels=["worker"])
        try:
            for w in self.state.registry.workers():
                draining.add_metric([w.name], 1.0 if w.draining else 0.0)
            ing = self.state.ingestor
            for worker, st in (ing.statuses() if ing is not None else {}).items():
                connected.add_metric([worker], 1.0 if st.get("connected") else 0.0)
        except Exception as exc:  # a scrape must never fail because of one reader
            log.warning("admin metrics collection failed: %s", exc)
        yield draining
        yield connected
