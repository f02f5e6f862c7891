"""Routes of the Responses and Messages APIs (mounted by ``router.proxy.build_router``).

- ``POST /v1/responses``: tokenized like chat (``responses.chat_view``) and routed by the cache; with
  ``previous_response_id`` it goes to the worker that created that response, and nowhere else;
- ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``: to the
  response's owner;
- ``POST /v1/messages``: validated, tokenized like chat (``messages.chat_view``) and routed by the cache;
- ``POST /v1/messages/count_tokens``: to any healthy worker of the model, like other utility paths.

An id without an owner record (another gateway process served it, the gateway restarted, the record
expired) is looked up on the fleet: ``GET /v1/responses/{id}`` to each worker that may hold it, at once,
with the control timeout; the one answering 200 is the owner, and is recorded (its chain's history is
unknown: a follow-up is pinned and routed on load). No worker holds it: 404; some could not be asked and
none holds it: 503. An owner that left the fleet 410; an owner that is down or draining 503: each in the
OpenAI error shape, naming the id and the worker.
Messages errors, the gateway's own and non-Anthropic ones from a worker, use Anthropic's shape.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from urllib.parse import quote

from fastapi import APIRouter, Request
from starlette.responses import Response

from router.apis import MESSAGES, RESPONSES, fit_template, template_traits
from router.apis import messages as msg_api
from router.apis import responses as resp_api
from router.apis.conversation import Unsupported
from router.apis.hooks import MessagesHooks, ResponsesHooks, put_owner
from router.cost import Candidate
from router.errors import APIError
from router.routing import Decision
from router.upstream import UpstreamError
from router.wire import (ClientGone, check_engine_args, client_headers, error_headers, parse_json_object,
                         read_body, require_model, send_error)

log = logging.getLogger("kvgate.apis")


async def _owner(st, response_id: str, param: str, chain: bool = False,
                 owned: bool = False, model: str | None = None) -> list[dict]:
    """The owner record of ``response_id`` (with ``chain``: and its parents', newest first), or the
    OpenAI-shaped error that says why not. ``owned``: only the owner can answer it (a GET, cancel or delete
    of a response): asked while it drains or fails health checks too (``Worker.owner_reachable``). Without
    a record the fleet is asked (:func:`_locate`; ``model``: only its workers, when known)."""
    try:
        if chain:
            recs = await asyncio.wait_for(st.owners.chain(response_id, st.settings.responses.chain_max_depth),
                                          st.settings.index.timeout_s)
        else:
            one = await asyncio.wait_for(st.owners.get(response_id), st.settings.index.timeout_s)
            recs = [one] if one is not None else []
    except Exception as e:
        raise APIError(503, f"The response store is unreachable ({type(e).__name__}); response "
                            f"'{response_id}' cannot be located.", param=param,
                       code="response_store_unavailable") from None
    rec = recs[0] if recs else None
    if rec is None or not isinstance(rec.get("worker"), str):
        rec = await _locate(st, response_id, param, model)
        recs = [rec]
    w = st.registry.target(rec["worker"])
    if w is None:
        raise APIError(410, f"Response '{response_id}' was stored by worker `{rec['worker']}`, which is no "
                            "longer in the fleet: the response is gone.", param=param,
                       code="response_owner_gone", type_="invalid_request_error")
    if not (w.owner_reachable if owned else w.routable):
        raise APIError(503, f"Response '{response_id}' is held by worker `{w.name}`, which is "
                            f"{'draining' if w.draining else 'unavailable'}; try again later.", param=param,
                       code="response_owner_unavailable")
    return recs


LOOKUP_ID_MAX = 512  # longest id looked up on the workers (vLLM's own: "resp_" and 32 hex digits)
# What a worker's answer to GET /v1/responses/{id} says when it is not a 200: it does not hold the id
# (vLLM's 404; 400, 405 and 410: it cannot hold it), else it could not be asked (a timeout, a 5xx, a 401...;
# a refused connection is no answer but says the same as a 404: no process listens, so no store holds it).
_NOT_HERE = frozenset({400, 404, 405, 410})


def _response_path(response_id: str, suffix: str = "") -> str:
    """A stored response's path on its worker: the id arrives decoded, so it goes quoted (a space or CR/LF in
    it made a malformed request line)."""
    return "/v1/responses/" + quote(response_id, safe="") + suffix


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found", type_="invalid_request_error")


async def _locate(st, response_id: str, param: str, model: str | None) -> dict:
    """The owner of a response the owner store has no record of, asked of the fleet: vLLM keeps a stored
    response in the one server that made it, and answers ``GET /v1/responses/{id}`` with a 404 everywhere
    else. So a record is missing where another gateway process (``serve --workers N`` on the in-memory
    store) or this one before a restart saw the response, or where the record expired or was lost: the
    response is still on its worker.

    Asked, all at once, with the registry's control timeout (``health_timeout_s``): every server that
    has been healthy and is not seen gone (connections refused: its process, and its stored responses, are
    gone; a connection refused now says the same), serving ``model`` when it is known (a GET by id names
    none). The first to answer 200 with this
    ``id`` is the owner (the others are cancelled): recorded with the model its answer names and no parent
    or turn, so the next lookup is local and the chain's history is unknown (a follow-up is pinned to it
    and routed on load). None answers 200: 404 ``response_not_found``, or, when some could not be asked,
    503 ``response_owner_unavailable`` (the owner may be among them)."""
    if len(response_id) > LOOKUP_ID_MAX:
        raise _not_found(response_id, param)
    try:
        path = _response_path(response_id)
    except UnicodeEncodeError:  # a lone surrogate: no worker can have made that id
        raise _not_found(response_id, param) from None
    workers = [w for w in st.registry.workers() if w.ever_healthy and not w.down
               and (model is None or not w.models or model in w.models)]
    timeout = st.settings.health_timeout_s

    async def ask(w):
        """(worker, the answer's body when it holds the id, why it could not be asked or None)."""
        try:
            async with asyncio.timeout(timeout):
                status, raw = await st.registry.control.get(w.url + path)
        except UpstreamError as e:  # nothing listens (refused): no process, so no store to hold it
            return w, None, None if e.refused else f"{w.name}: {e.kind}"
        except TimeoutError:
            return w, None, f"{w.name}: timeout"
        except Exception as e:  # an unsupported URL, a bug: this worker could not be asked
            return w, None, f"{w.name}: {type(e).__name__}"
        if status == 200:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("id") == response_id:
                return w, body, None
            return w, None, None  # a 200 for another id (not vLLM's answer): it does not hold this one
        return w, None, None if status in _NOT_HERE else f"{w.name}: HTTP {status}"

    tasks = [asyncio.ensure_future(ask(w)) for w in workers]
    failed: list[str] = []
    try:
        for next_done in asyncio.as_completed(tasks):
            w, body, why = await next_done
            if body is not None:
                owner = w.targets()[0].name  # a data-parallel server's store is its API server's: any rank
                found = body.get("model")
                rec = {"worker": owner, "model": found if isinstance(found, str) and found else model,
                       "parent": None, "delta": None}
                log.info("response %s had no owner record: worker %s holds it (%d asked)", response_id,
                         w.name, len(workers))
                await put_owner(st, response_id, rec)
                return rec
            if why is not None:
                failed.append(why)
    finally:
        for t in tasks:
            t.cancel()
    if failed:
        some = ", ".join(failed[:5]) + (", ..." if len(failed) > 5 else "")
        raise APIError(503, f"Response '{response_id}' has no owner record here, no worker asked holds it, "
                            f"and {len(failed)} of {len(workers)} could not be asked ({some}): its owner "
                            "could not be located; try again later.", param=param,
                       code="response_owner_unavailable")
    raise _not_found(response_id, param)


def _pin(d, worker: str) -> None:
    d.candidates = [c for c in d.candidates if c.worker == worker]
    if not d.candidates:
        raise APIError(503, f"Worker `{worker}` holds this response but is not serving model `{d.model}`.",
                       code="response_owner_unavailable")
    d.chosen = worker


async def _send_anthropic_error(send, err: APIError) -> None:
    body = json.dumps(msg_api.error_body(err.status, err.message)).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": error_headers(err.status, len(body))})
    await send({"type": "http.response.body", "body": body})


async def _serve(st, scope, receive, send, path: str, prepare, *, anthropic: bool = False, after=None,
                 direct: bool = False) -> None:
    """One request of these APIs over plain ASGI (as ``router.proxy.handle`` serves chat): read the body,
    ``prepare(headers, raw)`` -> (model, body, plan keywords, owner, hooks factory), plan, pin to the
    owner, forward. Errors go out in the API's shape; ``after(status)`` runs once the answer is sent.
    ``direct``: no plan, straight to the owner, draining or not (a stored response's GET, cancel, delete)."""
    from router.proxy import Forwarder, arrived, forward  # proxy mounts these routes: imported late

    send_err = _send_anthropic_error if anthropic else send_error
    received = time.perf_counter()
    try:
        headers = client_headers(scope)
        raw = await read_body(headers, receive, st.settings.max_body_bytes, st.settings.body_timeout_s)
        read_ms = (time.perf_counter() - received) * 1e3
        model, body, plan_kw, owner, hooks = await prepare(headers, raw)
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        if direct:
            d = Decision(request_id=rid, model=model or "", path=path, policy="owner",
                         candidates=[Candidate(worker=owner)], chosen=owner)
        else:
            d = await st.router.plan(model, body, headers, path, size=len(raw), request_id=rid, **plan_kw)
            if owner is not None:
                _pin(d, owner)
        arrived(d, received, read_ms)
        st.metrics.observe_stages(d.timings_ms)
        fwd = Forwarder(st.datapath, d, raw, path, method=scope["method"], query=scope.get("query_string", b"").decode(
            "latin-1"), headers=headers, hooks=hooks(d) if hooks else None, owned=direct)
        st.decisions.add(d)
    except ClientGone:
        return
    except APIError as e:
        await send_err(send, e)
        return
    except Exception as e:  # a bug answers in the API's shape (as router/proxy.py handle does)
        log.exception("unhandled error planning %s: %s", path, e)
        await send_err(send, APIError(500, "internal gateway error", type_="api_error"))
        return
    status = await forward(fwd, receive, send, path, send_err)
    if after is not None and status is not None:
        await after(status)


def _local(st, model: str):
    ns, _ = st.registry.namespace(model) if st.registry.knows_model(model) else (model, None)
    return st.tokenizers.for_model(model, ns)


def _body(schema: dict) -> dict:
    """An OpenAPI request body (the handlers read the raw body: it is forwarded byte for byte)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_STR = {"type": "string", "minLength": 1}
RESPONSES_BODY = {"type": "object", "required": ["model"], "properties": {
    "model": _STR, "instructions": {"type": "string"}, "previous_response_id": _STR,
    "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "stream": {"type": "boolean"}, "store": {"type": "boolean"}, "background": {"type": "boolean"},
    "max_output_tokens": {"type": "integer", "minimum": 1}}}
_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": sorted(msg_api.BLOCK_TYPES)},
                                                            "text": {"type": "string"}}}}]}
MESSAGES_BODY = {"type": "object", "required": ["model", "messages", "max_tokens"], "properties": {
    "model": _STR, "max_tokens": {"type": "integer", "minimum": 1}, "system": _CONTENT,
    "stream": {"type": "boolean"},
    "messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant"]}, "content": _CONTENT}}}}}
COUNT_BODY = {**MESSAGES_BODY, "required": ["model", "messages"]}


def add_routes(api: APIRouter) -> None:
    def asgi(request: Request, path: str, prepare, **kw) -> Response:
        from router.proxy import _ASGI

        st = request.app.state.kv
        return _ASGI(lambda scope, receive, send: _serve(st, scope, receive, send, path, prepare(st), **kw))

    @api.post("/v1/responses", summary="OpenAI Responses (routed by cache; chains go to their owner)",
              openapi_extra=_body(RESPONSES_BODY))
    async def create_response(request: Request) -> Response:
        return asgi(request, "/v1/responses", _prepare_response)

    def by_id(request: Request, response_id: str, suffix: str = "") -> Response:
        st = request.app.state.kv

        async def forget(status: int) -> None:
            if request.method == "DELETE" and status == 200:
                try:
                    await asyncio.wait_for(st.owners.delete(response_id), st.settings.index.timeout_s)
                except Exception as e:
                    log.warning("could not forget response %s: %s", response_id, e)

        def prepare(st):
            async def go(headers, raw):
                rec = (await _owner(st, response_id, "response_id", owned=True))[0]
                return rec.get("model"), {}, {}, rec["worker"], None
            return go

        return asgi(request, _response_path(response_id, suffix), prepare, after=forget, direct=True)

    @api.get("/v1/responses/{response_id}", summary="A stored response (from the worker that created it)")
    async def get_response(request: Request, response_id: str) -> Response:
        return by_id(request, response_id)

    @api.delete("/v1/responses/{response_id}", summary="Delete a stored response (on its worker)")
    async def delete_response(request: Request, response_id: str) -> Response:
        return by_id(request, response_id)

    @api.post("/v1/responses/{response_id}/cancel", summary="Cancel a background response (on its worker)")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return by_id(request, response_id, "/cancel")

    @api.post("/v1/messages", summary="Anthropic Messages (routed by cache)", openapi_extra=_body(MESSAGES_BODY))
    async def messages(request: Request) -> Response:
        return asgi(request, "/v1/messages", lambda st: _prepare_messages(st, routed=True), anthropic=True)

    @api.post("/v1/messages/count_tokens", summary="Anthropic token count (any healthy worker of the model)",
              openapi_extra=_body(COUNT_BODY))
    async def count_tokens(request: Request) -> Response:
        return asgi(request, "/v1/messages/count_tokens", lambda st: _prepare_messages(st, routed=False),
                    anthropic=True)


def _prepare_response(st):
    async def go(headers, raw):
        body = parse_json_object(raw)
        check_engine_args(body)
        prev = body.get("previous_response_id")
        owner = history = None
        if prev is not None:
            if not isinstance(prev, str) or not prev:
                raise APIError(400, "`previous_response_id` must be a non-empty string.",
                               param="previous_response_id", code="invalid_value")
            named = body.get("model") if isinstance(body.get("model"), str) and body["model"] else None
            recs = await _owner(st, prev, "previous_response_id", chain=True, model=named)
            rec = recs[0]
            owner, history = rec["worker"], resp_api.history_of(recs)
            model = named or rec.get("model")
            if not isinstance(model, str) or not model:  # a located record whose answer named no model
                model = require_model(body)
            w = st.registry.target(owner)
            if model != rec.get("model") and w is not None and w.models and model not in w.models:
                # the chain's state lives on its owner alone: no worker can ever answer this (not a 503)
                raise APIError(400, f"Response '{prev}' was created with model `{rec.get('model')}` on a "
                                    f"worker that does not serve `{model}`: continue it with its own model.",
                               param="model", code="model_mismatch")
        else:
            model = require_model(body)
        view = None
        if prev is None or history is not None:
            try:
                view = fit_template(_local(st, model), resp_api.chat_view(body, history))
            except Unsupported as e:
                log.debug("responses body routed on load: %s", e)
            except Exception as e:  # a body shape the conversion did not foresee: vLLM will judge it
                log.warning("responses body routed on load (conversion failed: %s: %s)", type(e).__name__, e)
        return model, body, {"view": view, "api": RESPONSES}, owner, lambda d: ResponsesHooks(st, d, body)
    return go


def _prepare_messages(st, routed: bool):
    async def go(headers, raw):
        body = parse_json_object(raw)
        check_engine_args(body)
        msg_api.validate(body) if routed else _require_model(body)
        view = None
        if routed:
            local = _local(st, body["model"])
            try:  # the template's traits too: a template that raises other than TemplateError there was a 500
                merge, effort = template_traits(local)
                view = fit_template(local, msg_api.chat_view(body, merge, effort))
            except Unsupported as e:
                log.debug("messages body routed on load: %s", e)
            except Exception as e:  # a body shape the conversion did not foresee: vLLM will judge it
                log.warning("messages body routed on load (conversion failed: %s: %s)", type(e).__name__, e)
        plan_kw = {"view": view, "api": MESSAGES} if routed else {}
        return body["model"], body, plan_kw, None, lambda d: MessagesHooks(st)
    return go


def _require_model(body: dict) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise APIError(400, "`model` is required (a non-empty string).", param="model")
