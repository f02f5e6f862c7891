"""The gateway's HTTP plumbing around a request, kept apart from the forwarding (router/proxy.py) and shared
with the other APIs' routes (router/apis/routes.py): reading and parsing the body within its limit, the
headers passed on and added, the ``usage`` of a response or the tail of a stream (decoding nothing else),
OpenAI-format errors over plain ASGI, and cancelling a handler whose client went away.
"""
from __future__ import annotations

import asyncio
import json

import msgspec

from router.errors import APIError, error_body
from router.routing import Decision
from router.upstream import UpstreamResponse

# ``expect`` too: the gateway's server answers a client's ``Expect: 100-continue``; forwarded, the worker's
# interim 100 would follow (router/upstream.py skips interim heads as well)
HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                        "trailer", "upgrade", "proxy-authorization", "proxy-authenticate", "expect"})
_NOT_COPIED = HOP_BY_HOP | {"date", "server"}  # uvicorn sets its own
JSON_HEADERS = [(b"content-type", b"application/json")]


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def read_body(headers: dict[str, str], receive, limit: int, timeout_s: float) -> bytes:
    """The request body from ASGI ``receive``, refusing more than ``limit`` bytes (declared or streamed)
    and a body still arriving ``timeout_s`` after the request's headers (a 408)."""
    cl = headers.get("content-length")
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
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = msg.get("body", b"")
                total += len(chunk)
                if total > limit:
                    raise APIError(413, f"Request body exceeds the limit of {limit} bytes.",
                                   code="request_too_large")
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s.",
                       code="request_timeout") from None


_decode_json = msgspec.json.Decoder().decode


def _no_lone_surrogate(body) -> None:
    """msgspec refuses a ``\\ud800`` escape without its pair; json.loads takes it. Such a string is no
    text: a worker's tokenizer fails on it (vLLM answers 500) and the gateway cannot hash it, so it is the
    client's error here, whether or not the gateway tokenizes the prompt itself."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise APIError(400, "The request body is not valid Unicode: it holds a lone surrogate (a \\ud800-"
                       "\\udfff escape without its pair).", code="invalid_prompt") from None


def parse_json_object(raw: bytes) -> dict:
    try:
        try:
            body = _decode_json(raw)
        except msgspec.DecodeError:
            body = json.loads(raw)  # the reference parser decides (msgspec refuses e.g. huge integers)
            _no_lone_surrogate(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"Invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:  # json.loads on a body nested thousands deep (msgspec refuses it first)
        raise APIError(400, "Invalid JSON body: nested too deeply.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def check_engine_args(body: dict) -> None:
    """Refuse vLLM per-request options (``vllm_xargs``) that would corrupt what the gateway learns from the
    engine. ``kv_cache_report_mode`` other than "incremental" (vLLM's default): in "full" mode vLLM
    publishes a ``BlockStored`` again for every cached block the request reuses, while it still removes each
    block once, so the index counts the re-announcements as copies and keeps the blocks after vLLM evicted
    them (any client could plant such phantom hits; found by a review)."""
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and xargs.get("kv_cache_report_mode", "incremental") != "incremental":
        raise APIError(400, "`vllm_xargs.kv_cache_report_mode` must be \"incremental\" through kvgate: other "
                            "modes re-announce cached blocks in vLLM's KV events, which the gateway's index "
                            "reads as new copies.", param="vllm_xargs.kv_cache_report_mode",
                       code="unsupported_value")


def require_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "The request must name a `model` (a non-empty string).", param="model",
                       code="missing_model")
    return model


def client_headers(scope) -> dict[str, str]:
    """The request's headers, names lower-case (ASGI servers deliver them so)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


def forward_headers(headers: dict[str, str], request_id: str) -> dict[str, str]:
    """The client's headers to send the worker: not the hop-by-hop ones, nor those its ``Connection``
    header names (RFC 9110 7.6.1)."""
    named = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    out = {k: v for k, v in headers.items() if k not in HOP_BY_HOP and k not in named}
    out["x-request-id"] = request_id
    return out


def kvgate_headers(d: Decision) -> dict[str, str]:
    ttft = d.predicted_ttft_ms
    return {"x-kvgate-worker": d.chosen or "", "x-kvgate-cached-tokens": str(d.predicted_cached_tokens),
            "x-kvgate-predicted-ttft-ms": f"{ttft:.1f}" if ttft is not None else "",
            "x-kvgate-policy": d.policy, "x-request-id": d.request_id}


def response_headers(resp: UpstreamResponse, d: Decision) -> list[tuple[bytes, bytes]]:
    """The worker's headers (less hop-by-hop ones and those kvgate sets itself: a worker that echoes
    ``x-request-id``, vLLM's ``--enable-request-id-headers``, gave the client two) and kvgate's, as ASGI
    header pairs."""
    own = kvgate_headers(d)
    out = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()
           if k.lower() not in _NOT_COPIED and k.lower() not in own]
    out += [(k.encode(), v.encode("latin-1")) for k, v in own.items()]
    return out


class _Usage(msgspec.Struct):
    usage: dict | None = None


_decode_usage = msgspec.json.Decoder(_Usage).decode


def _usage(raw: bytes) -> dict | None:
    """The ``usage`` object of one JSON document (decoding nothing else), if any."""
    try:
        u = _decode_usage(raw).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        u = obj.get("usage") if isinstance(obj, dict) else None
    return u if isinstance(u, dict) else None


def usage_from_sse_tail(tail: bytes) -> dict | None:
    """The last ``usage`` object in the end of an SSE stream (the final usage chunk), if any."""
    for event in reversed(tail.split(b"\n\n")):
        event = event.strip()
        if event.startswith(b"data:") and b'"usage"' in event:
            u = _usage(event[5:])
            if u is not None:
                return u
    return None


def usage_from_body(body: bytes) -> dict | None:
    return _usage(body) if b'"usage"' in body else None


def completion_of(usage: dict | None) -> int | None:
    """The tokens a response generated, from its usage (chat form); None when it does not say."""
    n = usage.get("completion_tokens") if usage else None
    return n if type(n) is int and n >= 0 else None


def error_headers(status: int, length: int) -> list[tuple[bytes, bytes]]:
    """An error's headers; a 408 closes the connection (the rest of a body too slow to wait for is not
    read: kept open, the connection stayed the slow client's)."""
    out = JSON_HEADERS + [(b"content-length", str(length).encode())]
    return out + [(b"connection", b"close")] if status == 408 else out


async def send_error(send, err: APIError) -> None:
    body = json.dumps(error_body(err.status, err.message, param=err.param, code=err.code, type_=err.type))
    await send({"type": "http.response.start", "status": err.status,
                "headers": error_headers(err.status, len(body))})
    await send({"type": "http.response.body", "body": body.encode()})


async def guarded(receive, coro) -> bool:
    """Run ``coro`` (the forwarding) in this task; if the client disconnects first, cancel it. Returns
    False when the client went away. One watcher per request, not one per await."""
    task = asyncio.current_task()
    state = {"gone": False, "done": False}

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not state["done"]:
                    state["gone"] = True
                    task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await coro
        return True
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()
        return False
    finally:
        state["done"] = True
        watcher.cancel()
