"""The OpenAI-compatible surface: plan with the router, forward to the chosen worker, stream back.

- Request bodies are forwarded byte for byte; responses are passed through unbuffered (SSE chunk by chunk).
- Before the first byte reaches the client, a refused connection, a timeout or a 5xx moves the request to
  the next-best worker (``routing.max_attempts`` in all). After it, an upstream failure ends the stream
  with an OpenAI-style ``data: {"error": ...}`` event and ``data: [DONE]``.
- A client that disconnects cancels the upstream request (its connection is closed).
- Delivered ``usage.prompt_tokens_details.cached_tokens`` goes into the decision record, and the
  observed time to first byte of a stream calibrates the worker's prefill speed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from functools import partial

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from router.apis.routes import add_routes as add_api_routes
from router.errors import APIError, error_response, sse_error_event
from router.metrics import CONTENT_TYPE
from router.policies import RouteRequest
from router.routing import Decision
from router.upstream import UpstreamError, UpstreamResponse

log = logging.getLogger("kvgate.proxy")

HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                        "trailer", "upgrade", "proxy-authorization", "proxy-authenticate"})
_TAIL_KEEP = 8192


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (declared or actually streamed)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise APIError(400, "Invalid Content-Length header.") from None
        if declared > limit:
            raise APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                           code="request_too_large")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


_decode_json = msgspec.json.Decoder().decode


def parse_json_object(raw: bytes) -> dict:
    try:
        try:
            body = _decode_json(raw)
        except msgspec.DecodeError:
            body = json.loads(raw)  # the reference parser decides (msgspec refuses e.g. huge integers)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"Invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def require_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "The request must name a `model` (a non-empty string).", param="model",
                       code="missing_model")
    return model


def forward_headers(headers, request_id: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
    out["x-request-id"] = request_id
    return out


_NOT_COPIED = HOP_BY_HOP | {"date", "server"}  # uvicorn sets its own


def response_headers(resp: UpstreamResponse, d: Decision) -> dict[str, str]:
    out = {k: v for k, v in resp.headers.items() if k.lower() not in _NOT_COPIED}
    out.update(kvgate_headers(d))
    return out


def kvgate_headers(d: Decision) -> dict[str, str]:
    ttft = d.predicted_ttft_ms
    return {"x-kvgate-worker": d.chosen or "", "x-kvgate-cached-tokens": str(d.predicted_cached_tokens),
            "x-kvgate-predicted-ttft-ms": f"{ttft:.1f}" if ttft is not None else "",
            "x-kvgate-policy": d.policy, "x-request-id": d.request_id}


def usage_from_sse_tail(tail: bytes) -> dict | None:
    """The last ``usage`` object in the end of an SSE stream (the final usage chunk), if any."""
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if not event.startswith(b"data:") or b'"usage"' not in event:
            continue
        try:
            obj = json.loads(event[5:])
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            return obj["usage"]
    return None


def usage_from_body(body: bytes) -> dict | None:
    if b'"usage"' not in body:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    u = obj.get("usage") if isinstance(obj, dict) else None
    return u if isinstance(u, dict) else None


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, aw):
    """Await ``aw`` unless the client disconnects first (then cancel it and raise ClientGone)."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientGone()


class _PassThrough(StreamingResponse):
    """A streamed upstream response whose clean-up runs even if the body was never iterated (a client gone
    before the response started never reaches the generator's ``finally``)."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Lease:
    """Gateway-side load a request puts on a worker: in flight until done, pending until its first byte."""

    def __init__(self, state, worker, cand) -> None:
        # prefill work (tokens at context 0, router/cost.py), so a long context queues as what it costs
        self.state, self.worker, self.tokens = state, worker, round(cand.prefill_work)
        self.pending = self.active = True
        worker.inflight += 1
        worker.pending_requests += 1
        worker.pending_tokens += self.tokens
        worker.mean_prompt_tokens = 0.9 * worker.mean_prompt_tokens + 0.1 * self.tokens
        state.metrics.child(state.metrics.inflight, worker.name).set(worker.inflight)
        # A non-streamed response shows no first token: count its prompt as queued until twice the
        # predicted TTFT has passed (vLLM's own waiting gauge covers a longer wait), not for its whole decode.
        self._timer = asyncio.get_running_loop().call_later(
            max(0.01, 2 * cand.predicted_ttft_ms / 1000.0), self.first_byte)

    def first_byte(self) -> None:
        self._timer.cancel()
        if self.pending:
            self.pending = False
            self.worker.pending_requests -= 1
            self.worker.pending_tokens -= self.tokens

    def release(self) -> None:
        self.first_byte()
        if self.active:
            self.active = False
            self.worker.inflight -= 1
            self.state.metrics.child(self.state.metrics.inflight, self.worker.name).set(self.worker.inflight)


class Forwarder:
    """Sends one planned request down the decision's candidate list."""

    def __init__(self, state, request: Request, d: Decision, body: bytes, path: str, hashes: list[int],
                 hooks=None):
        self.st, self.request, self.d, self.body, self.path = state, request, d, body, path
        self.hashes = hashes
        self.hooks = hooks  # router/apis/hooks.py: another API's usage, error events and response ids
        self._finished = False

    def _closed(self, resp: UpstreamResponse, lease: _Lease) -> None:
        lease.release()
        resp.close()
        self.finish("client_disconnected", 499)

    def finish(self, outcome: str, status: int | None, usage: dict | None = None) -> None:
        if self._finished:
            return
        self._finished = True
        d, m = self.d, self.st.metrics
        d.outcome, d.status = outcome, status
        if usage:
            pt = usage.get("prompt_tokens")
            d.prompt_tokens = pt if isinstance(pt, int) else None
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                d.delivered_cached_tokens = details["cached_tokens"]
        m.child(m.requests, d.model, d.chosen or "", d.policy, outcome).inc()
        if outcome == "ok" and d.model:
            m.child(m.predicted_cached, d.model).inc(d.predicted_cached_tokens)
            if d.delivered_cached_tokens is not None:
                m.child(m.delivered_cached, d.model).inc(d.delivered_cached_tokens)
            if d.prompt_tokens:
                m.child(m.prompt_tokens, d.model).inc(d.prompt_tokens)
                if d.delivered_cached_tokens is not None:
                    g = m.child(m.hit_rate, d.model)
                    g.set(0.9 * g._value.get() + 0.1 * d.delivered_cached_tokens / d.prompt_tokens)

    def _prefetch(self, worker, cand) -> None:
        if cand.g4_blocks <= 0 or not self.hashes:
            return
        want = self.hashes[cand.local_blocks: cand.local_blocks + cand.g4_blocks]
        st = self.st

        async def go():
            try:
                ok = await asyncio.wait_for(st.prefetcher.order(worker, self.d.namespace, want),
                                            st.settings.routing.prefetch_timeout_s)
                st.metrics.prefetch.labels(worker.name, "sent" if ok else "declined").inc()
            except Exception:
                st.metrics.prefetch.labels(worker.name, "failed").inc()

        st.spawn(go())

    async def run(self) -> Response:
        st, d = self.st, self.d
        reg = st.registry
        headers = forward_headers(self.request.headers, d.request_id)
        query = self.request.scope.get("query_string", b"").decode("latin-1")
        last_error = "no candidate worker"
        last_status = 503
        attempts = 0
        for cand in d.candidates:
            if attempts >= max(1, st.settings.routing.max_attempts):
                break
            w = reg.get(cand.worker)
            if w is None or not w.routable:
                continue
            attempts += 1
            if attempts > 1:
                st.metrics.retries.labels(d.model, last_error.split(":")[0]).inc()
            d.chosen = w.name
            d.attempts.append(w.name)
            self._prefetch(w, cand)
            lease = _Lease(st, w, cand)
            t_send = time.perf_counter()
            resp = None
            try:
                resp = await race_disconnect(self.request, st.upstream.open(
                    self.request.method, w.url + self.path, self.body, headers, query))
                if resp.status >= 500:
                    last_error, last_status = f"upstream_{resp.status}: worker {w.name}", 502
                    resp.close()
                    lease.release()
                    continue
                self._tell_policy(w)
                if self.hashes and not w.cache_blind:
                    st.pending.record(d.namespace, self.hashes, w.name)
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    it = resp.chunks()
                    try:
                        first = await race_disconnect(self.request, it.__anext__())
                    except StopAsyncIteration:
                        first = b""
                    ttft = time.perf_counter() - t_send
                    lease.first_byte()
                    self._observe_ttft(w, cand, ttft)
                    return _PassThrough(self._stream(resp, it, first, lease),
                                        partial(self._closed, resp, lease), status_code=resp.status,
                                        headers=response_headers(resp, d))
                raw = await race_disconnect(self.request, resp.read())
                resp.close()
                lease.release()
                ok = resp.status < 400
                if self.hooks is not None:
                    raw = await self.hooks.on_body(resp.status, raw)
                self.finish("ok" if ok else f"http_{resp.status}", resp.status,
                            (self.hooks.usage if self.hooks is not None else usage_from_body(raw)) if ok else None)
                return Response(raw, status_code=resp.status, headers=response_headers(resp, d))
            except ClientGone:
                lease.release()
                if resp is not None:
                    resp.close()
                self.finish("client_disconnected", 499)
                return Response(status_code=499)
            except UpstreamError as e:
                lease.release()
                if resp is not None:
                    resp.close()
                if e.kind == "connect":
                    reg.mark_failed(w, str(e))
                last_error = f"{e.kind}: worker {w.name}: {e}"
                last_status = 504 if e.kind == "timeout" else 502
                continue
            except BaseException:
                lease.release()
                if resp is not None:
                    resp.close()
                raise
        self.finish("failed", last_status)
        if attempts == 0:
            raise APIError(503, f"No healthy worker serves the model `{d.model}`.", code="no_healthy_worker")
        raise APIError(last_status, f"All {attempts} attempt(s) failed; last: {last_error}",
                       code="upstream_error")

    def _tell_policy(self, w) -> None:
        hdrs = {k.lower(): v for k, v in self.request.headers.items()}
        self.st.policy.chosen(RouteRequest(self.d.model, self.path, hdrs), w.name)

    def _observe_ttft(self, w, cand, ttft: float) -> None:
        self.d.observed_ttft_ms = ttft * 1000.0
        self.st.metrics.child(self.st.metrics.ttft, self.d.model, w.name).observe(ttft)
        self.st.router.cost.observe_ttft(w, ttft, cand)

    async def _stream(self, resp: UpstreamResponse, it, first: bytes, lease: _Lease):
        tail = bytearray(first[-_TAIL_KEEP:])
        outcome = "ok"
        hooks = self.hooks
        try:
            if first:
                if hooks is not None:
                    await hooks.on_chunk(first)
                yield first
            try:
                async for chunk in it:
                    if hooks is not None:
                        await hooks.on_chunk(chunk)
                    tail += chunk
                    if len(tail) > 2 * _TAIL_KEEP:
                        del tail[:-_TAIL_KEEP]
                    yield chunk
            except UpstreamError as e:
                outcome = "upstream_error_mid_stream"
                log.warning("worker %s failed mid-stream: %s", self.d.chosen, e)
                sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
                msg = f"The worker failed during the response ({type(e).__name__})."
                yield sep + (hooks.stream_error(msg) if hooks is not None else sse_error_event(msg))
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_disconnected"
            raise
        finally:
            lease.release()
            resp.close()
            usage = (hooks.usage if hooks is not None else usage_from_sse_tail(bytes(tail))) if outcome == "ok" else None
            self.finish(outcome, resp.status if outcome != "client_disconnected" else 499, usage)


def build_router() -> APIRouter:
    api = APIRouter()

    async def routed(request: Request, path: str, *, need_model: bool) -> Response:
        st = request.app.state.kv
        raw = await read_body(request, st.settings.max_body_bytes)
        body: dict = {}
        model = None
        if need_model or raw:
            ctype = request.headers.get("content-type", "")
            if need_model or "json" in ctype:
                body = parse_json_object(raw)
                model = require_model(body) if need_model else (body.get("model") if isinstance(
                    body.get("model"), str) and body.get("model") else None)
        if model is None and request.method == "GET":
            model = request.query_params.get("model") or None
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        d = await st.router.plan(model, body, dict(request.headers), path, size=len(raw), request_id=rid)
        st.metrics.observe_stages(d.timings_ms)
        hashes = d.hashes
        st.decisions.add(d)
        return await Forwarder(st, request, d, raw, path, hashes).run()

    @api.post("/v1/chat/completions", include_in_schema=True, summary="OpenAI chat completions (routed)")
    async def chat(request: Request) -> Response:
        return await routed(request, "/v1/chat/completions", need_model=True)

    @api.post("/v1/completions", summary="OpenAI completions (routed)")
    async def completions(request: Request) -> Response:
        return await routed(request, "/v1/completions", need_model=True)

    add_api_routes(api)  # /v1/responses, /v1/messages (router/apis/routes.py)

    @api.get("/v1/models", summary="The union of the fleet's models")
    async def models(request: Request) -> Response:
        st = request.app.state.kv
        seen: dict[str, dict] = {}
        for w in st.registry.workers():
            if not w.healthy:
                continue
            for mid, info in w.models.items():
                seen.setdefault(mid, info.get("card") or {"id": mid, "object": "model", "owned_by": "vllm"})
        return Response(json.dumps({"object": "list", "data": list(seen.values())}),
                        media_type="application/json")

    # Left out of the OpenAPI document: one function under five methods would give five operations with
    # one id (FastAPI warns), and a pass-through has no schema of its own to describe.
    @api.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
                   summary="Any other OpenAI path, forwarded to a healthy worker serving the model",
                   include_in_schema=False)
    async def other(request: Request, rest: str) -> Response:
        return await routed(request, "/v1/" + rest, need_model=False)

    @api.get("/health", summary="Liveness")
    async def health() -> Response:
        return Response('{"status":"ok"}', media_type="application/json")

    @api.get("/ready", summary="Readiness: at least one healthy worker")
    async def ready(request: Request) -> Response:
        st = request.app.state.kv
        n = sum(1 for w in st.registry.workers() if w.routable)
        if n == 0:
            return error_response(APIError(503, "No healthy worker.", code="no_healthy_worker"))
        return Response(json.dumps({"status": "ready", "healthy_workers": n}), media_type="application/json")

    @api.get("/metrics", summary="Prometheus metrics (kvgate_*)")
    async def metrics(request: Request) -> Response:
        st = request.app.state.kv
        await st.metrics.refresh(st)
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    return api
