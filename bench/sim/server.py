"""The HTTP face of one simulated vLLM server: the routes, bodies, SSE chunks, errors and metric names a
real vLLM 0.32 server with ``--enable-prompt-tokens-details`` and KV events serves."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from bench.sim.engine import RequestError, SimEngine
from bench.sim.tokenizer import SimTokenizer

VLLM_VERSION = "0.32.0"


@dataclass
class WorkerInfo:
    name: str
    model: str
    engine: SimEngine
    tokenizer: SimTokenizer
    default_max_tokens: int = 16
    topic: str = ""
    started: float = field(default_factory=time.time)  # process_start_time_seconds (a restart changes it)


def _error(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


SCALE_OUT_ROUTES = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                    "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                    "/inference/v1/generate")


async def scale_out_disabled() -> JSONResponse:
    return _error(403, "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable "
                       "them.", type_="PermissionDeniedError")


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def render_metrics(w: WorkerInfo) -> str:
    """Prometheus text in vLLM's names and labels (model_name, engine)."""
    e, c = w.engine, w.engine.cache
    lab = f'engine="0",model_name="{w.model}"'
    now = time.time()
    out: list[str] = ["# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
                      "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {w.started}"]

    def gauge(name, value, help_, labels=lab):
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"])

    def counter(name, value, help_):
        out.extend([f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter",
                    f"{name}_total{{{lab}}} {float(value)}", f"{name}_created{{{lab}}} {now}"])

    gauge("vllm:num_requests_running", e.running, "Number of requests in model execution batches.")
    gauge("vllm:num_requests_waiting", e.num_waiting, "Number of requests waiting to be processed.")
    gauge("vllm:kv_cache_usage_perc", c.usage(), "KV-cache usage. 1 means 100 percent usage.")
    counter("vllm:prefix_cache_queries", c.queries,
            "Prefix cache queries, in terms of number of queried tokens.")
    counter("vllm:prefix_cache_hits", c.hits, "Prefix cache hits, in terms of number of cached tokens.")
    counter("vllm:external_prefix_cache_queries", c.external_queries,
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number "
            "of queried tokens.")
    counter("vllm:external_prefix_cache_hits", c.external_hits,
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.")
    counter("vllm:prompt_tokens", e.stats.prompt_tokens, "Number of prefill tokens processed.")
    counter("vllm:generation_tokens", e.stats.generation_tokens, "Number of generation tokens processed.")
    counter("vllm:num_preemptions", e.stats.preemptions, "Cumulative number of preemption from the engine.")
    name = "vllm:prompt_tokens_by_source"
    out.extend([f"# HELP {name}_total Number of prompt tokens by source.", f"# TYPE {name}_total counter"])
    for source, value in (("local_compute", e.stats.computed_tokens), ("local_cache_hit", e.stats.cached_tokens),
                          ("external_kv_transfer", e.stats.external_tokens)):
        out.append(f'{name}_total{{{lab},source="{source}"}} {float(value)}')

    def histogram(name, h, help_):
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
        out.extend(f'{name}_bucket{{{lab},le="{le}"}} {float(n)}' for le, n in h.cumulative())
        out.extend([f"{name}_count{{{lab}}} {float(h.count)}", f"{name}_sum{{{lab}}} {float(h.sum)}"])

    histogram("vllm:request_prefill_time_seconds", e.h_prefill_time,
              "Histogram of time spent in PREFILL phase for request.")
    histogram("vllm:request_queue_time_seconds", e.h_queue_time,
              "Histogram of time spent in WAITING phase for request.")
    histogram("vllm:request_prefill_kv_computed_tokens", e.h_prefill_kv_computed,
              "Histogram of new KV tokens computed during prefill (excluding cached tokens).")
    histogram("vllm:request_prompt_tokens", e.h_prompt_tokens, "Number of prefill tokens processed.")
    histogram("vllm:e2e_request_latency_seconds", e.h_e2e, "Histogram of e2e request latency in seconds.")
    histogram("vllm:request_inference_time_seconds", e.h_inference,
              "Histogram of time spent in RUNNING phase for request.")
    histogram("vllm:time_to_first_token_seconds", e.h_ttft, "Histogram of time to first token in seconds.")
    histogram("vllm:inter_token_latency_seconds", e.h_itl, "Histogram of inter-token latency in seconds.")
    histogram("vllm:iteration_tokens_total", e.h_iteration_tokens,
              "Histogram of number of tokens per engine_step.")
    info = {
        "block_size": c.block_size, "cache_dtype": "auto", "calculate_kv_scales": "False",
        "enable_prefix_caching": "True", "engine": "0", "gpu_memory_utilization": "0.9",
        "hash_block_size": c.block_size, "num_cpu_blocks": "None", "num_gpu_blocks": c.num_blocks,
        "prefix_caching_hash_algo": "sha256",
    }
    labels = ",".join(f'{k}="{v}"' for k, v in info.items())
    gauge("vllm:cache_config_info", 1, "Information of the LLMEngine CacheConfig", labels=labels)
    return "\n".join(out) + "\n"


def create_worker_app(w: WorkerInfo, kv_event_sources: dict | None = None) -> FastAPI:
    app = FastAPI(title=f"simulated vLLM {w.name}", docs_url=None, redoc_url=None, openapi_url=None)
    engine, tok = w.engine, w.tokenizer
    sources = kv_event_sources or {}

    async def encode(text: str) -> list[int]:
        return await tok.encode_off_loop(text) if len(text) > 4096 else tok.encode(text)

    def check_model(body: dict) -> JSONResponse | None:
        m = body.get("model")
        if m not in (None, w.model):
            return _error(404, f"The model `{m}` does not exist.", "NotFoundError", "model")
        return None

    async def read_json(request: Request) -> dict | JSONResponse:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            return _error(400, "Invalid JSON body.")
        if not isinstance(body, dict):
            return _error(400, "The request body must be a JSON object.")
        return body

    def request_id(request: Request, body: dict) -> str:
        return request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex

    def max_tokens_of(body: dict) -> int | JSONResponse:
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        if mt is None:
            return w.default_max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            return _error(400, "max_tokens must be at least 1, got {}.".format(mt), param="max_tokens")
        return mt

    async def run(body: dict, tokens: list[int], rid: str, chat: bool):
        mt = max_tokens_of(body)
        if isinstance(mt, JSONResponse):
            return mt
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 128
                                 or any(ch in salt for ch in "@/\\\x00")):
            return _error(400, "Invalid cache_salt.", param="cache_salt")
        try:
            req = engine.submit(tokens, mt, salt)
        except RequestError as e:
            return _error(400, str(e))
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        cid = ("chatcmpl-" if chat else "cmpl-") + rid
        model = w.model
        if not body.get("stream"):
            try:
                while await req.out.get() is not None:  # drain to the end: the whole answer
                    pass
            finally:
                if not req.done:
                    engine.abort(req)
            text = tok.decode(req.generated)
            n_out = len(req.generated)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                                  "annotations": None, "audio": None, "function_call": None,
                                                  "tool_calls": [], "reasoning_content": None},
                          "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                          "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                          "prompt_token_ids": None}
            return JSONResponse({"id": cid, "object": obj, "created": created, "model": model,
                                 "choices": [choice], "service_tier": None, "system_fingerprint": None,
                                 "usage": _usage(len(tokens), n_out, req.cached_tokens),
                                 "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None})
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def stream():
            sent = 0
            try:
                if chat:
                    yield _sse({"id": cid, "object": chunk_obj, "created": created, "model": model,
                                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
                while (chunk := await req.out.get()) is not None:
                    sent += len(chunk)
                    last = sent >= req.max_tokens
                    text = tok.decode(chunk) + ("" if last else " ")
                    fin = "length" if last else None
                    if chat:
                        ch = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": fin}
                    else:
                        ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin,
                              "stop_reason": None}
                    if last:
                        ch["stop_reason"] = None
                    yield _sse({"id": cid, "object": chunk_obj, "created": created, "model": model,
                                "choices": [ch]})
                if include_usage:
                    yield _sse({"id": cid, "object": chunk_obj, "created": created, "model": model, "choices": [],
                                "usage": _usage(len(tokens), sent, req.cached_tokens)})
                yield b"data: [DONE]\n\n"
            finally:
                if not req.done:
                    engine.abort(req)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        if (err := check_model(body)) is not None:
            return err
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            tokens = prompt
        else:
            return _error(400, "prompt must be a string or a list of token ids (one prompt per request in the "
                               "simulator).", param="prompt")
        return await run(body, tokens, request_id(request, body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        if (err := check_model(body)) is not None:
            return err
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return _error(400, "messages must be a non-empty list of objects.", param="messages")
        tokens = await encode(tok.render_chat(msgs, bool(body.get("add_generation_prompt", True))))
        return await run(body, tokens, request_id(request, body), chat=True)

    # vLLM without --enable-scale-out answers its scale-out routes with 403 (a router that tries them, as
    # vllm-router's cache_aware does, then falls back to /tokenize)
    for path in SCALE_OUT_ROUTES:
        app.add_api_route(path, scale_out_disabled, methods=["POST"], include_in_schema=False)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        if (err := check_model(body)) is not None:
            return err
        # a long text off the loop, as the completion routes: one process hosts every simulated worker, and a
        # router that tokenizes every prompt on every worker (vllm-router's cache_aware on text) stalled them
        if "messages" in body:
            if not isinstance(body["messages"], list):
                return _error(400, "messages must be a list.", param="messages")
            ids = await encode(tok.render_chat(body["messages"], bool(body.get("add_generation_prompt", True))))
        elif isinstance(body.get("prompt"), str):
            ids = await encode(body["prompt"])
        else:
            return _error(400, "Either prompt (a string) or messages is required.", param="prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": tok.token_strs(ids) if body.get("return_token_strs") else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return _error(400, "tokens must be a list of integers.", param="tokens")
        return {"prompt": tok.decode(ids)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": w.model, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": w.model,
            "parent": None, "max_model_len": engine.max_model_len,
            "permission": [{"id": f"modelperm-{w.name}", "object": "model_permission", "created": 0,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]}

    fault = {"health": 200}

    @app.get("/health")
    async def health():
        return Response(status_code=fault["health"])

    # Test hooks (not vLLM's surface): fault injection and the engine's cache as vLLM holds it.
    @app.post("/sim/fault")
    async def sim_fault(request: Request):
        body = await read_json(request)
        if isinstance(body, JSONResponse):
            return body
        if "health" in body:
            fault["health"] = int(body["health"])
        if "drop_events" in body and engine.publisher is not None:
            engine.publisher.drop_next = int(body["drop_events"])
        return {"health": fault["health"]}

    @app.get("/sim/cached")
    async def sim_cached():
        """Engine block hashes the prefix cache holds (what the index must reflect)."""
        return {"hashes": sorted(engine.cache.cached_hashes())}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200)

    @app.get("/load")
    async def load():
        return {"server_load": engine.running + engine.num_waiting}

    @app.get("/version")
    async def version():
        return {"version": VLLM_VERSION}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(w), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv_event_sources")
    async def kv_event_sources():
        return sources

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"success": engine.reset_prefix_cache()}

    return app
