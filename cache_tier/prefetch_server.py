"""The worker's small HTTP endpoint: prefetch orders in, connector counters out.

Served from a daemon thread inside vLLM's worker process (``prefetch_port`` in the connector's extra
config), with the standard library only, so it adds nothing to vLLM's environment:

- ``POST /kvgate/prefetch {"model": str, "hashes": [int | "hex16", ...]}`` -> 202 ``{"accepted", ...}``;
  404 for another model, 400/413 for bad bodies;
- ``GET /kvgate/g4/stats`` -> the connector's counters (loads, failures, staged blocks, prefetch hits,
  store stats, measured load bandwidth);
- ``GET /health`` -> 200.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20


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

        def log_message(self, fmt, *args):  # quiet: vLLM's logs are busy enough
            return

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if self.path.split("?")[0] == "/kvgate/g4/stats":
                return self._send(200, worker.stats())
            return self._send(404, _error("not found", 404, "not_found_error"))

        def do_POST(self):
            if self.path.split("?")[0] != "/kvgate/prefetch":
                return self._send(404, _error("not found", 404, "not_found_error"))
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, _error("bad Content-Length", 400))
            if n > MAX_BODY:
                return self._send(413, _error(f"body over {MAX_BODY} bytes", 413))
            try:
                body = json.loads(self.rfile.read(n) or b"null")
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


def serve_in_thread(worker, host: str, port: int) -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer((host, port), make_handler(worker))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, name="kvgate-g4-http", daemon=True).start()
    return srv
