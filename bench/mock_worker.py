"""A minimal, fast mock of vLLM's HTTP surface for overhead benchmarks (plain ASGI, no framework): fixed
completion bodies, SSE when ``"stream": true``, and the discovery endpoints the gateway reads. Several
servers run in one process: ``python -m bench.mock_worker --ports 9001,9002``."""
from __future__ import annotations

import argparse
import asyncio
import json

from bench.sim.asgi import read_body, serve_lifespan

MODEL = "bench"

_CHAT = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 8}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 10, "total_tokens": 18, "completion_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
_CHUNK = b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",' \
         b'"choices":[{"index":0,"delta":{"content":"ok "}}]}\n\n'
_SSE = _CHUNK * 8 + b"data: [DONE]\n\n"
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm",
                                                  "root": MODEL, "parent": None, "max_model_len": 131072}]}).encode()
_METRICS = (b'vllm:num_requests_running{engine="0",model_name="bench"} 0.0\n'
            b'vllm:num_requests_waiting{engine="0",model_name="bench"} 0.0\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="bench"} 0.0\n'
            b'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n')


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await serve_lifespan(receive, send)
    body = await read_body(receive)
    path = scope["path"]
    ctype = b"application/json"
    if path in ("/v1/chat/completions", "/v1/completions"):
        if b'"stream":true' in body or b'"stream": true' in body:
            out, ctype = _SSE, b"text/event-stream"
        else:
            out = _CHAT
    elif path == "/v1/models":
        out = _MODELS
    elif path == "/metrics":
        out, ctype = _METRICS, b"text/plain"
    elif path == "/kv_event_sources":
        out = b"{}"
    else:
        out = b""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


async def serve(ports: list[int]) -> None:
    import uvicorn

    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p, log_level="error", access_log=False,
                                             lifespan="on")) for p in ports]
    await asyncio.gather(*(s.serve() for s in servers))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True)
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve([int(x) for x in args.ports.split(",")]))


if __name__ == "__main__":
    main()
