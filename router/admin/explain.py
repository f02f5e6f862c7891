"""``POST /admin/explain``: what the gateway would do with a request, without sending it anywhere.

It runs the proxy's own planning (``router.plan``: tokenize, hash, index lookup, cost model, policy), so
the answer is the decision the proxy would make now. Two forms:

- ``POST /admin/explain`` with ``{"body": <client body>, "path": ..., "model": ..., "headers": {...}}``;
- ``POST /admin/explain/v1/chat/completions`` (or ``/v1/completions``) with the client's body verbatim.
"""
from __future__ import annotations

import copy
import json

from fastapi import APIRouter, Request

from router.admin import schemas
from router.admin.common import kv_state
from router.errors import APIError, error_responses

router = APIRouter(prefix="/explain", tags=["admin: explain"])
# as the data routes: a body the gateway cannot route, a model it does not serve, no healthy worker
_ERRORS = error_responses(400, 404, 503)

PATHS = ("/v1/chat/completions", "/v1/completions")


def dry_run_policy(policy):
    """A copy of the live policy for planning without consequences.

    Policies break exact ties with a rotation counter that every ``order`` call advances (round robin
    is nothing else). Planning on a copy whose counters are copied too gives the choice the *next* real
    request would get, and leaves the live counters where they were, so explaining never shifts routing.
    """
    from router.policies.base import Policy, Rotation

    dry = copy.copy(policy)
    for name, value in vars(policy).items():
        if isinstance(value, Rotation):
            setattr(dry, name, copy.copy(value))
        elif isinstance(value, Policy):
            setattr(dry, name, dry_run_policy(value))
    return dry


def _check_body(path: str, body: dict) -> None:
    """The same shape checks a client would meet, as 400s naming the field."""
    if path == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise APIError(400, "'messages' must be a non-empty list of message objects", param="messages")
    else:
        if not _valid_prompt(body.get("prompt")):
            raise APIError(400, "'prompt' must be a string, a list of strings, or token ids", param="prompt")


def _is_token_ids(xs: list) -> bool:
    # C-speed checks (map/set/min): a 128K-token prompt must not cost milliseconds here.
    return bool(xs) and set(map(type, xs)) == {int} and min(xs) >= 0


def _valid_prompt(prompt) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    kinds = set(map(type, prompt))
    if kinds == {str}:
        return True
    if kinds == {int}:
        return min(prompt) >= 0
    return kinds == {list} and all(_is_token_ids(p) for p in prompt)


async def _explain(request: Request, path: str, body: dict, model: str | None,
                   headers: dict[str, str]) -> dict:
    state = kv_state(request)
    if path not in PATHS:
        raise APIError(400, f"path must be one of {', '.join(PATHS)}", param="path")
    model = model or body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "the request names no model (body.model or model)", param="model")
    _check_body(path, body)
    # The request's size decides whether tokenization goes to the thread pool; the explain call's own
    # length bounds the client body's without re-serializing it.
    size = int(request.headers.get("content-length") or 0) or len(json.dumps(body))
    # Same call as the proxy's, on a copy of the policy; a fresh request id, and the decision is not logged.
    decision = await state.router.plan(model, body, headers, path, size=size,
                                       policy=dry_run_policy(state.policy))
    d = decision.to_dict(include_hashes=True)
    d["hashes_hex"] = [f"{h:016x}" for h in decision.hashes]
    return d  # validated and serialized once, by the route's response model


@router.post("", response_model=schemas.Explanation,
             responses=_ERRORS, summary="Explain how a request would be routed")
async def explain(req: schemas.ExplainRequest, request: Request) -> schemas.Explanation:
    path = req.path
    if path is None:
        path = "/v1/chat/completions" if "messages" in req.body else "/v1/completions"
    return await _explain(request, path, req.body, req.model, req.headers)


@router.post("/v1/chat/completions", response_model=schemas.Explanation, responses=_ERRORS,
             summary="Explain a chat request given verbatim")
async def explain_chat(body: dict, request: Request) -> schemas.Explanation:
    return await _explain(request, "/v1/chat/completions", body, None, _client_headers(request))


@router.post("/v1/completions", response_model=schemas.Explanation, responses=_ERRORS,
             summary="Explain a completion request given verbatim")
async def explain_completion(body: dict, request: Request) -> schemas.Explanation:
    return await _explain(request, "/v1/completions", body, None, _client_headers(request))


def _client_headers(request: Request) -> dict[str, str]:
    """Routing-relevant headers of the explain call itself (the admin token is not one of them)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in ("authorization", "cookie")}
