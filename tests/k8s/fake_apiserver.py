"""A fake Kubernetes API server on loopback, speaking just the API that kvgate's discovery uses.

A real API server (kube-apiserver with etcd, or kind/k3s) cannot run on this machine or in CI here, so the
discovery tests use this stand-in. It is a real HTTP/1.1 server and the real ``kubernetes`` client talks
to it; it follows the API's wire behaviour for:
- ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=..`` (an EndpointSliceList
  whose ``metadata.resourceVersion`` is the store's current version);
- the same with ``watch=true``: a chunked stream of newline-delimited ``{"type", "object"}`` events after
  ``resourceVersion``, BOOKMARK events when asked, closed after ``timeoutSeconds``; a resourceVersion older
  than the compacted history gets the ``ERROR`` event with a 410 ``Expired`` Status, as etcd compaction does;
- ``GET /api/v1/namespaces/{ns}/pods/{name}`` (404 Status when absent).
Label selectors support the equality forms (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def endpoint_slice(
    name: str,
    endpoints: list[dict],
    *,
    labels: dict | None = None,
    ports: list[dict] | None = None,
    address_type: str = "IPv4",
) -> dict:
    """An EndpointSlice as the controller writes it. ``endpoints``: dicts with ``ip``, ``pod``, ``ready``
    (default True), ``terminating`` (default False)."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "labels": labels if labels is not None else {"app": "vllm"}},
        "addressType": address_type,
        "endpoints": [
            {
                "addresses": [e["ip"]],
                "conditions": {
                    "ready": e.get("ready", True),
                    "serving": e.get("ready", True),
                    "terminating": e.get("terminating", False),
                },
                "targetRef": {"kind": "Pod", "name": e["pod"], "namespace": "default"},
            }
            for e in endpoints
        ],
        "ports": ports if ports is not None else [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }


class FakeApiServer:
    def __init__(self, port: int = 0) -> None:
        self._cond = threading.Condition()
        self._rv = 100
        self._compacted_rv = 0
        self._slices: dict[tuple[str, str], dict] = {}
        self._pods: dict[tuple[str, str], dict] = {}
        self._history: list[tuple[int, str, str, dict]] = []  # (rv, type, namespace, object)
        self._generation = 0  # bumped by drop_watches()
        self._closing = False
        self._refusing = False
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.authorizations: list[str | None] = []
        self.watches_open = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def do_GET(self):
                server._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    # ---- control ---------------------------------------------------------------------------------------

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def _record(self, kind: str, namespace: str, obj: dict) -> int:
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        self._history.append((self._rv, kind, namespace, obj))
        self._cond.notify_all()
        return self._rv

    def put_slice(self, slice_: dict, namespace: str = "default") -> int:
        with self._cond:
            key = (namespace, slice_["metadata"]["name"])
            kind = "MODIFIED" if key in self._slices else "ADDED"
            rv = self._record(kind, namespace, slice_)
            self._slices[key] = self._history[-1][3]
            return rv

    def delete_slice(self, name: str, namespace: str = "default") -> int:
        with self._cond:
            obj = self._slices.pop((namespace, name))
            return self._record("DELETED", namespace, obj)

    def put_pod(self, name: str, annotations: dict[str, str], namespace: str = "default") -> None:
        with self._cond:
            self._pods[(namespace, name)] = {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "annotations": annotations,
                    "resourceVersion": str(self._rv),
                },
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            }

    def compact(self) -> None:
        """Forget the history, as etcd compaction does: older resourceVersions now get 410 Gone."""
        with self._cond:
            self._compacted_rv = self._rv
            self._history.clear()

    def drop_watches(self) -> None:
        """Cut every open watch connection without the closing chunk (a network failure)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._rv)

    def hold_watches(self) -> None:
        """Cut open watches and answer new ones 503 until ``release_watches`` (an API server outage)."""
        with self._cond:
            self._refusing = True
        self.drop_watches()

    def release_watches(self) -> None:
        with self._cond:
            self._refusing = False

    def wait_for_request(self, predicate, timeout: float = 30.0) -> tuple[str, dict[str, str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for req in list(self.requests):
                if predicate(req):
                    return req
            time.sleep(0.02)
        raise TimeoutError(f"no matching request; saw {self.requests}")

    # ---- HTTP ------------------------------------------------------------------------------------------

    def _send_json(self, h: BaseHTTPRequestHandler, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with self._cond:  # before the request is visible to the test: a later drop_watches() cuts it
            generation = self._generation
            refusing = self._refusing
        self.requests.append((url.path, query))
        self.authorizations.append(h.headers.get("Authorization"))
        parts = url.path.strip("/").split("/")
        if (
            parts[:4] == ["apis", "discovery.k8s.io", "v1", "namespaces"]
            and len(parts) == 6
            and parts[5] == "endpointslices"
        ):
            if query.get("watch") in ("true", "1"):
                if refusing:
                    return self._send_json(h, 503, _status(503, "ServiceUnavailable", "held by the test"))
                return self._watch(h, parts[4], query, generation)
            return self._list(h, parts[4], query)
        if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 6 and parts[4] == "pods":
            with self._cond:
                pod = self._pods.get((parts[3], parts[5]))
            if pod is None:
                return self._send_json(h, 404, _status(404, "NotFound", f'pods "{parts[5]}" not found'))
            return self._send_json(h, 200, pod)
        self._send_json(h, 404, _status(404, "NotFound", "the server could not find the requested resource"))

    def _list(self, h, namespace: str, query: dict[str, str]) -> None:
        selector = query.get("labelSelector", "")
        with self._cond:
            items = [
                copy.deepcopy(s)
                for (ns, _), s in sorted(self._slices.items())
                if ns == namespace and _matches(selector, s["metadata"].get("labels") or {})
            ]
            rv = str(self._rv)
        self._send_json(
            h,
            200,
            {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": rv},
                "items": items,
            },
        )

    def _watch(self, h, namespace: str, query: dict[str, str], generation: int) -> None:
        selector = query.get("labelSelector", "")
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + int(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(event: dict) -> None:
            data = (json.dumps(event) + "\n").encode()
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        with self._cond:
            self.watches_open += 1
        try:
            with self._cond:
                if since and since < self._compacted_rv:
                    chunk(
                        {
                            "type": "ERROR",
                            "object": _status(410, "Expired", f"too old resource version: {since}"),
                        }
                    )
                    h.wfile.write(b"0\r\n\r\n")
                    return
            sent_bookmark = False
            while True:
                with self._cond:
                    if self._closing or generation != self._generation:
                        break
                    pending = [
                        (rv, kind, obj)
                        for rv, kind, ns, obj in self._history
                        if rv > since and ns == namespace
                    ]
                    if not pending:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        if bookmarks and not sent_bookmark:
                            pending = [
                                (
                                    self._rv,
                                    "BOOKMARK",
                                    {
                                        "kind": "EndpointSlice",
                                        "apiVersion": "discovery.k8s.io/v1",
                                        "metadata": {"resourceVersion": str(self._rv)},
                                    },
                                )
                            ]
                            sent_bookmark = True
                        else:
                            self._cond.wait(min(remaining, 0.2))
                            continue
                for rv, kind, obj in pending:
                    since = max(since, rv)
                    if kind != "BOOKMARK" and not _matches(selector, obj["metadata"].get("labels") or {}):
                        continue
                    chunk({"type": kind, "object": obj})
            if generation != self._generation or self._closing:
                h.close_connection = True
                h.connection.shutdown(2)  # abrupt: no terminating chunk
                return
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()
        except OSError:
            pass
        finally:
            with self._cond:
                self.watches_open -= 1
