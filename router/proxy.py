"""The OpenAI-compatible surface: plan with the router, forward to the chosen worker, stream back.

The data routes run as plain ASGI (:func:`dispatch`, called by the app before FastAPI's middleware stack),
since a request's framework layers (error, telemetry and body-limit middleware, routing, dependency
solving, Request/Response objects) cost as much CPU as planning a small chat; FastAPI still declares them,
for the OpenAPI document and for the catch-all ``/v1/*``.
- Request bodies are forwarded byte for byte; responses are passed through unbuffered (SSE chunk by chunk).
- Before the first byte reaches the client, a refused connection, a timeout or a 5xx moves the request to
  the next-best worker (``routing.max_attempts`` in all). After it, an upstream failure ends the stream
  with an OpenAI-style ``data: {"error": ...}`` event and ``data: [DONE]``.
- A client that disconnects cancels the upstream request (its connection is closed): one watcher per
  request cancels the handler.
- Delivered ``usage.prompt_tokens_details.cached_tokens`` goes into the decision record, and the
  observed time to first byte of a stream calibrates the worker's prefill speed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Request
from starlette.responses import Response

from router import eviction
from router.admission import gate_budget, gate_orders
from router.apis.routes import add_routes as add_api_routes
from router.errors import APIError, error_response, sse_error_event
from router.metrics import CONTENT_TYPE
from router.policies import RouteRequest
from router.routing import Decision, kind_of
from router.upstream import UpstreamError, UpstreamResponse
from router.wire import (ClientGone, check_engine_args, client_headers, completion_of, forward_headers, guarded,
                         parse_json_object, read_body, require_model, response_headers, send_error,
                         usage_from_body, usage_from_sse_tail)

log = logging.getLogger("kvgate.proxy")

_TAIL_KEEP = 8192


@dataclass
class DataPath:
    """What the request path needs of a gateway, and nothing more (router/state.py builds it)."""

    registry: object
    upstream: object
    router: object  # router.routing.Router: plan() and its cost model
    pending: object
    metrics: object
    decisions: object
    prefetcher: object
    spawn: Callable  # fire-and-forget tasks kept referenced by the gateway
    routing: object  # RoutingConfig
    max_body_bytes: int
    body_timeout_s: float

    @property
    def policy(self):
        return self.router.policy


class _Lease:
    """A request's place in its worker's load tracker (router/load.py): prefilling until its first byte,
    in flight until done."""

    def __init__(self, metrics, worker, cand, streamed: bool, max_tokens: int = 0, hashes=None,
                 block_size: int = 0) -> None:
        # prefill work (tokens at context 0, router/cost.py), so a long context queues as what it costs
        self.metrics, self.worker = metrics, worker
        self.seq = worker.active.add(cand.uncached_tokens, cand.prefill_work, cand.predicted_ttft_ms / 1000.0,
                                     streamed, tokens=cand.cached_tokens + cand.uncached_tokens,
                                     max_tokens=max_tokens, hashes=hashes, block_size=block_size,
                                     prefix_blocks=cand.local_blocks)
        self.active = True
        metrics.child(metrics.inflight, worker.name).set(worker.inflight)

    def first_byte(self) -> None:
        self.worker.active.first_token(self.seq)
        self.worker.gate.wake()  # its prefill is done: the next held one may go (router/admission.py)

    async def admit(self, routing, max_batched: int, tokens_per_s: float) -> float:
        """Wait at the worker's prefill gate (router/admission.py); the seconds waited. ``tokens_per_s``: the
        worker's calibrated prefill speed (the gate stands aside where a step's prefill outlasts its wait)."""
        if not routing.prefill_gate or not self.seq.prefills:
            return 0.0  # nothing to prefill (a stored response's GET, a count): nothing to order
        budget = gate_budget(routing, max_batched)
        if not gate_orders(budget, tokens_per_s, routing.prefill_gate_max_wait_s):
            return 0.0
        waited = await self.worker.gate.admit(self.worker.active, self.seq, budget, routing.prefill_gate_max_wait_s)
        self.metrics.child(self.metrics.gate_wait, self.worker.name).observe(waited)
        return waited

    def release(self, completion_tokens: int | None = None, ran: bool = True) -> None:
        """It ended; ``completion_tokens``: what it generated, when its usage said (router/load.py); ``ran``
        False: the worker never ran it (refused, not reached, the client left while it was held)."""
        if self.active:
            self.active = False
            if ran:
                self.worker.active.finish(self.seq, completion_tokens)
            else:
                self.worker.active.withdraw(self.seq)
            self.worker.gate.wake()
            self.metrics.child(self.metrics.inflight, self.worker.name).set(self.worker.inflight)


class Forwarder:
    """Sends one planned request down the decision's candidate list and writes the response to ASGI ``send``."""

    def __init__(self, dp: DataPath, d: Decision, body: bytes, path: str, *, method: str, query: str,
                 headers: dict[str, str], hooks=None, owned: bool = False):
        self.st, self.d, self.body, self.path = dp, d, body, path
        # what only its worker holds: sent while that one drains or fails health checks too (owner_reachable)
        self.owned = owned
        self.method, self.query, self.headers = method, query, headers
        self.hashes = d.hashes
        self.sent_text = d.sent_text  # the decision log drops it too
        self.after = d.after  # and this
        self.hooks = hooks  # router/apis/hooks.py: another API's usage, error events and response ids
        self._finished = False
        self._settled = False  # the pending record of the prompt's blocks is settled (the worker has them)
        self._events = 0  # SSE events passed (an OpenAI stream's answer length when it reports no usage)

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
        if outcome == "ok" and d.delivered_cached_tokens is not None and d.chosen:
            self._observe_eviction()
        if outcome == "ok" and d.model:
            m.child(m.predicted_cached, d.model).inc(d.predicted_cached_tokens)
            if d.delivered_cached_tokens is not None:
                m.child(m.delivered_cached, d.model).inc(d.delivered_cached_tokens)
            if d.prompt_tokens:
                m.child(m.prompt_tokens, d.model).inc(d.prompt_tokens)
                if d.delivered_cached_tokens is not None:
                    g = m.child(m.hit_rate, d.model)
                    g.set(0.9 * g._value.get() + 0.1 * d.delivered_cached_tokens / d.prompt_tokens)

    def _observe_eviction(self) -> None:
        """What vLLM delivered of the local prefix the index showed calibrates the worker's eviction model."""
        d = self.d
        cand, w = d.candidate(d.chosen), self.st.registry.target(d.chosen)
        if cand is not None and w is not None:
            eviction.observe_delivery(w.eviction, cand, d.delivered_cached_tokens, d.block_size)

    def _prefetch(self, worker, cand) -> None:
        if cand.g4_blocks <= 0 or not self.hashes:
            return
        want = self.hashes[cand.local_blocks: cand.local_blocks + cand.g4_blocks]
        st = self.st

        async def go():
            try:
                outcome = await asyncio.wait_for(st.prefetcher.order(worker, self.d.namespace, want),
                                                 st.routing.prefetch_timeout_s)
            except Exception:  # the order's deadline
                outcome = "failed"
            st.metrics.prefetch.labels(worker.name, outcome).inc()

        st.spawn(go())

    async def run(self, send) -> None:
        """Try the candidates in order until one answers; raises APIError (nothing sent) when none does.
        A cancellation (the client left) closes the upstream request and is recorded as a 499."""
        st, d = self.st, self.d
        reg = st.registry
        headers = forward_headers(self.headers, d.request_id)
        last_error = "no candidate worker"
        last_status = 503
        attempts = 0
        for cand in d.candidates:
            if cand.score_notes:  # a scorer fell back to a neutral term on this worker's figures
                st.metrics.child(st.metrics.scoring_fallbacks, cand.worker).inc()
        for cand in d.candidates:
            if attempts >= max(1, st.routing.max_attempts):
                break
            w = reg.target(cand.worker)  # a server, or one data-parallel rank of one
            if w is None or not self._usable(w):
                continue
            attempts += 1
            if attempts > 1:
                st.metrics.retries.labels(d.model, last_error.split(":")[0]).inc()
            d.chosen = w.name
            d.attempts.append(w.name)
            self._prefetch(w, cand)
            lease = _Lease(st.metrics, w, cand, d.stream, d.max_tokens, self.hashes, d.block_size)
            lease.seq.after = self.after.get(w.name)
            if cand.clamped:
                st.metrics.child(st.metrics.prediction_clamped, w.name).inc()
            # Recorded as sent before it is: vLLM answers a non-streaming request only when it is done, and a
            # request that arrives meanwhile should know what this one will have left there.
            recorded = bool(self.hashes) and not w.blind_for(kind_of(self.path))
            if recorded:
                st.pending.record(d.namespace, self.hashes, w.name, cand.local_blocks, text=self.sent_text,
                                  owner=lease.seq)
            t_send = time.perf_counter()  # TTFT counts the wait at the gateway's prefill gate too
            resp = None
            try:
                cost = st.router.cost
                waited = await lease.admit(st.routing, cost.budget(w), cost.prefill_speed(w))
                d.gate_wait_ms = round(d.gate_wait_ms + waited * 1000.0, 3)  # every attempt's
                # it failed, drains or left while the request was held (a request for its owner: left, down)
                if waited > 0 and not self._usable(w):
                    self._withdraw(w, cand, recorded)
                    last_error = f"unavailable: worker {w.name} left while the request was held"
                    last_status = 503
                    continue
                t_open = time.perf_counter()
                resp = await st.upstream.open(self.method, w.url + self.path, self.body, w.pin(headers),
                                              self.query)
                if resp.status >= 500:
                    self._withdraw(w, cand, recorded)
                    last_error, last_status = f"upstream_{resp.status}: worker {w.name}", 502
                    continue
                self._tell_policy(w)
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    await self._stream(send, resp, lease, w, cand, t_send, t_open, recorded)
                    return
                raw = await resp.read()
                t_worker = time.perf_counter() - t_open
                ok = resp.status < 400
                # parsed once: the load tracker's release and the decision record read the same usage (an
                # API's hooks read it first: released before them, Responses and Messages answers never
                # moved the worker's average answer length)
                if self.hooks is not None:
                    raw = await self.hooks.on_body(resp.status, raw)
                    usage = self.hooks.usage if ok else None
                else:
                    usage = usage_from_body(raw) if ok else None
                lease.release(completion_of(usage), ran=ok)
                if not ok:  # refused (a prompt too long, a bad parameter): nothing was computed
                    self._withdraw(w, cand, recorded)
                elif recorded:
                    st.pending.settle(d.namespace, self.hashes, w.name, cand.local_blocks,
                                      text=self.sent_text)
                    self._settled = True
                self.finish("ok" if ok else f"http_{resp.status}", resp.status, usage)
                hdrs = response_headers(resp, d)
                hdrs.append((b"content-length", str(len(raw)).encode()))
                await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
                await send({"type": "http.response.body", "body": raw})
                self._first_byte(t_worker)
                return
            except UpstreamError as e:
                self._withdraw(w, cand, recorded)
                if e.kind == "connect":
                    reg.mark_failed(w, str(e))
                last_error = f"{e.kind}: worker {w.name}: {e}"
                last_status = 504 if e.kind == "timeout" else 502
                continue
            except asyncio.CancelledError:
                if not self._settled:  # held at the gate or waiting for the head: the worker got none of
                    self._withdraw(w, cand, recorded)  # it or aborts it now; no claim on its blocks
                self.finish("client_disconnected", 499)
                raise
            finally:  # (not reached, refused, or held when the client left: the worker ran none of it)
                lease.release(ran=resp is not None and resp.status < 400)
                if resp is not None:
                    resp.close()
        self.finish("failed", last_status)
        if attempts == 0:
            raise APIError(503, f"No healthy worker serves the model `{d.model}`.", code="no_healthy_worker")
        raise APIError(last_status, f"All {attempts} attempt(s) failed; last: {last_error}",
                       code="upstream_error")

    def _usable(self, w) -> bool:
        return w.owner_reachable if self.owned else w.routable

    def _withdraw(self, w, cand, recorded: bool) -> None:
        if recorded:
            self.st.pending.withdraw(self.d.namespace, self.hashes, w.name, cand.local_blocks, self.sent_text)

    def _tell_policy(self, w) -> None:
        self.st.policy.chosen(RouteRequest(self.d.model, self.path, self.headers), w.name)

    def _observe_ttft(self, w, cand, ttft: float) -> None:
        self.d.observed_ttft_ms = ttft * 1000.0
        m = self.st.metrics
        m.child(m.ttft, self.d.model, w.name).observe(ttft)
        ratio = w.prediction.add(ttft * 1000.0, cand.predicted_ttft_ms)
        if ratio is not None:
            m.child(m.ttft_ratio, w.name).observe(ratio)
        self.st.router.cost.observe_ttft(w, ttft, cand)

    def _done_at_last_event(self, resp: UpstreamResponse, lease, tail: bytearray) -> None:
        """The response is complete once its last event passes (the OpenAI stream's ``[DONE]``, the other
        APIs' final events in their hooks): vLLM freed the request's KV when it sent it, and the client may
        send its next turn before the worker's end of stream reaches the gateway. So the request leaves the
        worker's load tracker (and its outcome is recorded) before that event goes on: the next turn must
        not find it in flight, as load or as a holder of its prefix (capacity-bound real vLLM: prefixes
        priced held and delivered 0)."""
        if self._finished:
            return
        hooks = self.hooks
        done = hooks.complete if hooks is not None else tail[-32:].rstrip().endswith(b"data: [DONE]")
        if done:
            usage = self._stream_usage(tail)
            self.finish("ok", resp.status, usage)
            lease.release(self._completion(usage))

    def _completion(self, usage: dict | None) -> int | None:
        """The tokens a stream generated: its usage's, else (an OpenAI stream without
        ``stream_options.include_usage``, as most clients send) its events counted: vLLM sends one per
        token, for chat one more first (the role), and ``[DONE]``. An estimate (a token that ends inside a
        character sends none; ``--stream-interval`` above 1 sends several per event), good enough for the
        worker's average answer length (router/load.py), which would otherwise never learn it."""
        n = completion_of(usage)
        if n is None and self.hooks is None and self._events:
            n = max(0, self._events - 1 - self.path.endswith("chat/completions"))
        return n

    def _stream_usage(self, tail: bytearray) -> dict | None:
        """The usage a stream reported: its API hooks' (which read it from their events), or the OpenAI
        stream's last chunk with one."""
        return self.hooks.usage if self.hooks is not None else usage_from_sse_tail(bytes(tail))

    def _first_byte(self, worker_s: float) -> None:
        """The client has the response's first byte: the gateway's own time since the request arrived,
        without the ``worker_s`` the worker took to answer (its first chunk, or its whole body when not
        streamed) and the prefill gate's wait, is the ``first_byte`` stage (a retried request counts its
        failed attempts in it too)."""
        d = self.d
        if not d.received_at:
            return
        ms = max(0.0, (time.perf_counter() - d.received_at - worker_s) * 1e3 - d.gate_wait_ms)
        d.timings_ms["first_byte"] = ms
        m = self.st.metrics
        m.child(m.routing_overhead, "first_byte").observe(ms / 1000.0)

    async def _stream(self, send, resp: UpstreamResponse, lease, w, cand, t_send: float, t_open: float,
                      recorded: bool = False) -> None:
        """Pass an SSE response through chunk by chunk. A failure before the first chunk is the worker's
        (retried by :meth:`run`); after it, the stream ends with an error event. ``recorded``: the prompt's
        blocks are in the pending record (router/pending.py), settled at the first chunk."""
        it = resp.chunks()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = b""
        t_worker = time.perf_counter() - t_open
        lease.first_byte()
        if recorded:
            self.st.pending.settle(self.d.namespace, self.hashes, w.name, cand.local_blocks,
                                   text=self.sent_text)
            self._settled = True
        self._observe_ttft(w, cand, time.perf_counter() - t_send)
        await send({"type": "http.response.start", "status": resp.status, "headers": response_headers(resp, self.d)})
        tail = bytearray(first[-_TAIL_KEEP:])
        outcome = "ok"
        hooks = self.hooks
        if first:
            if hooks is not None:
                await hooks.on_chunk(first)
            self._events += first.count(b"\n\n")
            self._done_at_last_event(resp, lease, tail)
            await send({"type": "http.response.body", "body": first, "more_body": True})
        self._first_byte(t_worker)
        try:
            async for chunk in it:
                if hooks is not None:
                    await hooks.on_chunk(chunk)
                self._events += chunk.count(b"\n\n")
                tail += chunk
                if len(tail) > 2 * _TAIL_KEEP:
                    del tail[:-_TAIL_KEEP]
                self._done_at_last_event(resp, lease, tail)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            outcome = "upstream_error_mid_stream"
            log.warning("worker %s failed mid-stream: %s", self.d.chosen, e)
            if self._finished:  # the client has the whole answer ([DONE] passed): an error event after it
                await send({"type": "http.response.body", "body": b""})  # would break the stream's framing
                return
            sep = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
            msg = f"The worker failed during the response ({type(e).__name__})."
            await send({"type": "http.response.body", "more_body": True,
                        "body": sep + (hooks.stream_error(msg) if hooks is not None else sse_error_event(msg))})
        except asyncio.CancelledError:
            # Clients close once they have the last event (the OpenAI SDKs stop reading at [DONE]), often
            # before the worker's end of stream reaches the gateway: that response was recorded complete
            # when its last event passed (_done_at_last_event); one that leaves before it disconnected.
            self.finish("client_disconnected", 499)
            raise
        # recorded before the last byte: a client that has the whole stream finds the outcome in place
        usage = self._stream_usage(tail) if outcome == "ok" else None
        self.finish(outcome, resp.status, usage)
        await send({"type": "http.response.body", "body": b""})


async def handle(st: DataPath, scope, receive, send, path: str, need_model: bool) -> None:
    """One routed request over plain ASGI: read, plan, forward (the whole data path)."""
    received = time.perf_counter()
    try:
        headers = client_headers(scope)
        raw = await read_body(headers, receive, st.max_body_bytes, st.body_timeout_s)
        read_ms = (time.perf_counter() - received) * 1e3
        body: dict = {}
        model = None
        if need_model or raw:
            if need_model or "json" in headers.get("content-type", ""):
                body = parse_json_object(raw)
                check_engine_args(body)
                model = require_model(body) if need_model else (body.get("model") if isinstance(
                    body.get("model"), str) and body.get("model") else None)
        query = scope.get("query_string", b"").decode("latin-1")
        if model is None and scope["method"] == "GET" and query:
            model = (parse_qs(query).get("model") or [None])[0] or None
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        d = await st.router.plan(model, body, headers, path, size=len(raw), request_id=rid)
        arrived(d, received, read_ms)
        st.metrics.observe_stages(d.timings_ms)
        fwd = Forwarder(st, d, raw, path, method=scope["method"], query=query, headers=headers)
        st.decisions.add(d)  # drops the decision's hashes (the forwarder keeps its own reference)
    except ClientGone:
        return
    except APIError as e:
        await send_error(send, e)
        return
    except Exception as e:  # a bug answers in the API's shape (no framework error middleware runs here)
        log.exception("unhandled error planning %s: %s", path, e)
        await send_error(send, APIError(500, "internal gateway error", type_="api_error"))
        return
    await forward(fwd, receive, send, path)


def arrived(d: Decision, received: float, read_ms: float) -> None:
    """When ``d``'s request arrived (``time.perf_counter``) and how long its body took to read (the ``read``
    stage: a slow client, or an event loop too busy to take the body's packets)."""
    d.received_at = received
    d.timings_ms["read"] = read_ms


async def forward(fwd: Forwarder, receive, send, path: str, send_err=send_error) -> int | None:
    """Run a planned request; an error before the response started is answered with ``send_err`` (the
    API's error shape). Returns the status sent (None: nothing was)."""
    status = None

    async def tracked(msg):
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        await send(msg)

    try:
        await guarded(receive, fwd.run(tracked))
    except APIError as e:
        if status is None:
            await send_err(send, e)
    except Exception as e:  # a bug must still answer in the API's shape, never a traceback
        log.exception("unhandled error on %s: %s", path, e)
        if status is None:
            await send_err(send, APIError(500, "internal gateway error", type_="api_error"))
    return status


class _ASGI(Response):
    """A FastAPI endpoint's answer that runs a plain ASGI handler (the routes :func:`dispatch` does not
    intercept)."""

    def __init__(self, fn) -> None:  # noqa: D107 - no body of its own
        self._fn = fn
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await self._fn(scope, receive, send)


# POST routes served without FastAPI's layers: path -> whether the body must name a model.
FAST_ROUTES = {"/v1/chat/completions": True, "/v1/completions": True}


async def dispatch(dp: DataPath, scope, receive, send) -> bool:
    """Serve a generation route straight from :func:`handle`; False: not one (FastAPI serves it)."""
    if scope["type"] == "http" and scope["method"] == "POST":
        need = FAST_ROUTES.get(scope["path"])
        if need is not None:
            await handle(dp, scope, receive, send, scope["path"], need)
            return True
    return False


def build_router() -> APIRouter:
    api = APIRouter()

    def routed(request: Request, path: str, *, need_model: bool) -> Response:
        dp = request.app.state.kv.datapath
        return _ASGI(lambda scope, receive, send: handle(dp, scope, receive, send, path, need_model))

    @api.post("/v1/chat/completions", include_in_schema=True, summary="OpenAI chat completions (routed)")
    async def chat(request: Request) -> Response:
        return routed(request, "/v1/chat/completions", need_model=True)

    @api.post("/v1/completions", summary="OpenAI completions (routed)")
    async def completions(request: Request) -> Response:
        return routed(request, "/v1/completions", need_model=True)

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
        # forwarded as the client encoded it: the decoded path can hold characters an HTTP request line
        # cannot (a 500 before) and separators that change what the worker reads (%3F, %2F)
        raw = request.scope.get("raw_path") or b""
        path = raw.decode("latin-1") if raw.startswith(b"/v1/") else quote("/v1/" + rest, safe="/")
        return routed(request, path, need_model=False)

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
