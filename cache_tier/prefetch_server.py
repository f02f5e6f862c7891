"""The worker's small HTTP endpoint: prefetch orders in, connector counters out.

Served from a daemon thread inside vLLM's worker process (``prefetch_port`` in the connector's extra
config), with the standard library and ``prometheus_client`` (a dependency of vLLM) only, so it adds
nothing to vLLM's environment:

- ``POST /kvgate/prefetch {"model": str, "hashes": [int | "hex16", ...]}`` -> 202 ``{"accepted", ...}``;
  404 for another model, 400/413 for bad bodies;
- ``GET /kvgate/g4/stats`` -> the connector's counters as JSON (loads, failures by reason, staged
  blocks, prefetch hits, store stats, measured load bandwidth);
- ``GET /metrics`` -> the same counters in Prometheus' text format, from a private registry (vLLM's own
  metrics stay on its API port), every series labelled ``model``:
  ``kvgate_g4_loads_total`` (blocks), ``kvgate_g4_load_failures_total{reason="missing|truncated|corrupt|
  foreign|io_error|error"}`` (blocks vLLM recomputed), ``kvgate_g4_load_bytes_total``,
  ``kvgate_g4_load_seconds_total``, ``kvgate_g4_async_loads_total`` (requests),
  ``kvgate_g4_loads_in_flight``, ``kvgate_g4_prefetch_hits_total``, ``kvgate_g4_saves_planned_total``,
  ``kvgate_g4_saves_written_total``, ``kvgate_g4_saves_dropped_total`` (every planned save not written:
  writer queue full or write failed), ``kvgate_g4_save_failures_total{reason="disk_full|unwritable|
  io_error|error"}``, ``kvgate_g4_agree_failures_total``, ``kvgate_g4_save_copy_seconds_total``, ``kvgate_g4_writer_queue_blocks``,
  ``kvgate_g4_writer_queue_bytes``, ``kvgate_g4_store_blocks``, ``kvgate_g4_store_bytes``,
  ``kvgate_g4_store_evictions_total``, ``kvgate_g4_prefetch_orders_total``,
  ``kvgate_g4_prefetch_staged_total``, ``kvgate_g4_staging_bytes``;
- ``GET /health`` -> 200.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20
# A connection's socket timeout: a client that stalls mid-request (or never sends its body) frees its
# handler thread after this long. The gateway sends a small body at once (router/prefetch.py).
READ_TIMEOUT_S = 5.0
# Connections served at once (one thread each, inside vLLM's worker process); more are closed unanswered:
# an order is advisory (the gateway counts it failed and the load happens at prefill).
MAX_CONNECTIONS = 16

# (name, kind, help, path into the stats dict); a dict value is one series per key, labelled ``reason``
_METRICS = (
    ("loads", "counter", "G4 blocks loaded into vLLM's KV cache", ("loads",)),
    ("load_failures", "counter", "G4 blocks that failed to load (vLLM recomputed them), by reason",
     ("load_failures_by_reason",)),
    ("load_bytes", "counter", "bytes loaded from G4", ("load_bytes",)),
    ("load_seconds", "counter", "seconds spent in G4 loads (start to last block)", ("load_seconds",)),
    ("async_loads", "counter", "requests whose G4 load ran in the background", ("async_loads",)),
    ("loads_in_flight", "gauge", "background G4 loads not finished", ("loads_in_flight",)),
    ("prefetch_hits", "counter", "blocks loaded from prefetch staging", ("prefetch_hits",)),
    ("saves_planned", "counter", "blocks planned for saving to G4", ("saves_planned",)),
    ("saves_written", "counter", "blocks written to G4", ("saves_written",)),
    ("saves_dropped", "counter", "planned saves not written (writer queue full or write failed)",
     ("saves_dropped",)),
    ("save_failures", "counter", "G4 block writes that failed, by reason", ("save_failures_by_reason",)),
    ("agree_failures", "counter", "steps whose tensor-parallel ranks could not agree on their failed loads "
     "(the saves of the step's loading requests dropped)", ("agree_failures",)),
    ("save_copy_seconds", "counter", "seconds copying saved blocks out of the KV cache",
     ("save_copy_seconds",)),
    ("writer_queue_blocks", "gauge", "blocks waiting for the G4 writer", ("writer_queue",)),
    ("writer_queue_bytes", "gauge", "bytes reserved by the G4 writer's queue", ("writer_queue_bytes",)),
    ("store_blocks", "gauge", "blocks in the namespace, as this worker sees it", ("store", "blocks")),
    ("store_bytes", "gauge", "bytes in the namespace, as this worker sees it", ("store", "bytes")),
    ("store_evictions", "counter", "blocks evicted by the store's capacity GC", ("store", "evictions")),
    ("prefetch_orders", "counter", "prefetch orders received", ("staging", "orders")),
    ("prefetch_staged", "counter", "blocks staged by prefetch orders", ("staging", "staged")),
    ("staging_bytes", "gauge", "bytes held in prefetch staging", ("staging", "bytes")),
)


def metrics_text(stats: dict) -> tuple[bytes, str]:
    """``stats`` (``WorkerSide.stats()``) in Prometheus' text format, and its content type."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

    model = str(stats.get("model", ""))

    class _Collector:
        def collect(self):
            for name, kind, doc, path in _METRICS:
                v = stats
                for k in path:
                    v = v.get(k) if isinstance(v, dict) else None
                if v is None:
                    continue
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                if isinstance(v, dict):
                    fam = cls(f"kvgate_g4_{name}", doc, labels=["model", "reason"])
                    for reason, n in v.items():
                        fam.add_metric([model, reason], n)
                else:
                    fam = cls(f"kvgate_g4_{name}", doc, labels=["model"])
                    fam.add_metric([model], v)
                yield fam

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return generate_latest(reg), CONTENT_TYPE_LATEST


def _parse_hash(h: Any) -> int:
    if isinstance(h, bool):
        raise ValueError("hash must be an integer or 16 hex digits")  # noqa: TRY004 - a 400, not a bug
    if isinstance(h, int):
        if not 0 <= h < 1 << 64:
            raise ValueError("hash out of the u64 range")
        return h
    if isinstance(h, str) and 1 <= len(h) <= 16:
        return int(h, 16)
    raise ValueError("hash must be an integer or 16 hex digits")


def _error(msg: str, code: int, typ: str = "invalid_request_error") -> dict:
    return {"error": {"message": msg, "type": typ, "param": None, "code": code}}


def make_handler(worker) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = READ_TIMEOUT_S

        def log_message(self, fmt, *args):  # quiet: vLLM's logs are busy enough
            return

        def _send(self, code: int, obj: dict | bytes, ctype: str = "application/json") -> None:
            body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            path = self.path.split("?")[0]
            if path == "/kvgate/g4/stats":
                return self._send(200, worker.stats())
            if path == "/metrics":
                return self._send(200, *metrics_text(worker.stats()))
            return self._send(404, _error("not found", 404, "not_found_error"))

        def do_POST(self):
            if self.path.split("?")[0] != "/kvgate/prefetch":
                return self._send(404, _error("not found", 404, "not_found_error"))
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, _error("bad Content-Length", 400))
            if n < 0:  # rfile.read(-1) would read until the client closes: no limit at all
                return self._send(400, _error("bad Content-Length", 400))
            if n > MAX_BODY:
                return self._send(413, _error(f"body over {MAX_BODY} bytes", 413))
            try:
                raw = self.rfile.read(n)
            except OSError:  # the client stalled past READ_TIMEOUT_S or went away: nobody to answer
                self.close_connection = True
                return None
            try:
                body = json.loads(raw or b"null")
                if not isinstance(body, dict) or not isinstance(body.get("hashes"), list):
                    raise ValueError('expected {"model": str, "hashes": [...]}')  # noqa: TRY004
                hashes = [_parse_hash(h) for h in body["hashes"]]
            except ValueError as e:
                return self._send(400, _error(str(e), 400))
            model = body.get("model")
            if model is not None and model != worker.cfg.model:
                return self._send(404, _error(f"model {model!r} is not served here", 404, "not_found_error"))
            res = worker.stager.order(hashes)
            return self._send(202, res)

    return Handler


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once (the rest are closed at once)."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max(1, max_connections))

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_in_thread(worker, host: str, port: int) -> ThreadingHTTPServer:
    srv = _BoundedServer((host, port), make_handler(worker), MAX_CONNECTIONS)
    threading.Thread(target=srv.serve_forever, name="kvgate-g4-http", daemon=True).start()
    return srv


def stop(srv: ThreadingHTTPServer) -> None:
    """Stop serving and release the port (``shutdown`` alone leaves the socket bound)."""
    srv.shutdown()
    srv.server_close()
