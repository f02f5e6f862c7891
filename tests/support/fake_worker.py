"""A stand-in for vLLM's *HTTP surface only*, for gateway tests and the overhead benchmark.

It is not an engine: it renders chat prompts with the model's tokenizer the way vLLM does, keeps a simple
prefix cache of full blocks to report ``usage.prompt_tokens_details.cached_tokens``, and answers
``/v1/chat/completions`` and ``/v1/completions`` (streaming SSE and not), non-streamed ``/v1/messages``
(only with ``messages``), non-streamed ``/v1/responses`` (only with ``responses``) and a stored response's
``GET``/``DELETE /v1/responses/{id}``, ``/tokenize``, ``/v1/models``,
``/metrics`` (vllm:* gauges and cache_config_info), ``/health``, ``/kv_event_sources`` and
``/v1/embeddings``. Tests steer it through :class:`FakeState` (fail with 500, hang before the first token,
die mid-stream, report a long queue). With ``dp_publishers`` it plays a data-parallel server: one engine
rank per publisher, each with its own prefix cache and event stream, listed in ``/kv_event_sources`` and
labelled ``engine="r"`` on ``/metrics``; ``X-data-parallel-rank`` picks the rank (else round-robin, where
vLLM balances by load). Real vLLM is exercised by the end-to-end tests.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from indexer.hashing import routable_blocks, sequence_hashes


@dataclass
class FakeState:
    name: str = "w"
    model: str = "tiny"
    block_size: int = 16
    mode: str = "ok"  # ok | error500 | hang | die_mid_stream | unhealthy
    first_token_delay_s: float = 0.0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.25  # vllm:kv_cache_usage_perc
    num_gpu_blocks: int | None = None  # vllm:cache_config_info's num_gpu_blocks label, when set
    events_endpoint: str | None = None
    words: int = 8
    chat_template: str | None = None  # the worker's own template (vLLM's --chat-template), else the model's
    fast: bool = False  # benchmark mode: no tokenizer, no cache bookkeeping
    pause_after: int | None = None  # streaming: stop after this many content chunks until released
    done_delay_s: float = 0.0  # streaming: hold the connection open this long after [DONE]
    metrics_delay_s: float = 0.0  # /metrics answers after this long (a busy server's slow scrape)
    release: threading.Event = field(default_factory=threading.Event)
    publisher: object = None  # a bench.sim.vllm_format.EventPublisher: BlockStored for new blocks
    dp_publishers: list = field(default_factory=list)  # data-parallel: one publisher (and cache) per rank
    dp_waiting: list = field(default_factory=list)  # per rank: vllm:num_requests_waiting{engine="r"}
    sources_status: int = 200  # what /kv_event_sources answers (a 503: its config cannot be read yet)
    sources: object = None  # when set, /kv_event_sources answers this verbatim (odd or malformed input)
    messages: bool = False  # answer non-streamed /v1/messages (usage only); else 404 as before
    echo_request_id: bool = False  # answer with the request's x-request-id (vLLM --enable-request-id-headers)
    # The Responses API's store (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): id -> stored response, answered by
    # GET (and DELETE) /v1/responses/{id}, a 404 in vLLM's shape for any other id. ``responses``: also
    # answer non-streamed POST /v1/responses (stored unless ``store`` is false); else 404 as before.
    responses: bool = False
    stored: dict = field(default_factory=dict)
    lookups: list = field(default_factory=list)  # the ids GET /v1/responses/{id} was asked for, in order
    lookup_status: int | None = None  # GET /v1/responses/{id} answers this status, stored or not
    lookup_delay_s: float = 0.0  # ... after this long (a worker too busy to answer in time)
    requests: list = field(default_factory=list)
    cancelled: int = 0
    active: int = 0
    cache: set = field(default_factory=set)
    # vLLM's per-request histograms (sum, sum, sum, count): computed tokens, prefill seconds, prompt tokens,
    # requests.
    prefill: list = field(default_factory=lambda: [0, 0.0, 0, 0])
    started: float = field(default_factory=time.time)  # process_start_time_seconds; set it anew = a restart


def _vllm_tools(tools):
    """``tools`` as vLLM 0.32 hands them to the chat template: parsed into its request models and dumped
    (its FunctionDefinition / ChatCompletionToolsParam, their fields and serializers, rebuilt here with
    pydantic: vLLM is not importable in this environment)."""
    if tools is None:
        return None
    from typing import Any, Literal

    from pydantic import BaseModel, ConfigDict, model_serializer

    class _Base(BaseModel):
        model_config = ConfigDict(extra="allow")

    class FunctionDefinition(_Base):
        name: str
        description: str | None = None
        parameters: dict[str, Any] | None = None
        strict: bool | None = None
        defer_loading: bool | None = None

        @model_serializer(mode="wrap")
        def _serialize(self, handler):
            data = {k: v for k, v in handler(self).items() if k in type(self).model_fields}
            for k in ("strict", "defer_loading"):
                if getattr(self, k) is None:
                    data.pop(k, None)
            return data

    class ChatCompletionToolsParam(_Base):
        type: Literal["function"] = "function"
        function: FunctionDefinition
        defer_loading: bool | None = None

        @model_serializer(mode="wrap")
        def _serialize(self, handler):
            if self.defer_loading is not None and self.function.defer_loading is None:
                self.function.defer_loading = self.defer_loading
            data = {k: v for k, v in handler(self).items() if k in type(self).model_fields}
            if self.defer_loading is None:
                data.pop("defer_loading", None)
            return data

    return [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]


def _reply_words(st: FakeState, n_prompt: int) -> list[str]:
    return [f"{st.name}-says-{i}" if i else f"Hello({n_prompt})" for i in range(st.words)]


def create_fake_worker(state: FakeState, tokenizer_dir: str | None = None) -> FastAPI:
    tok = None
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    app = FastAPI()
    st = state

    def tokens_for(kind: str, body: dict) -> list[int]:
        if kind == "chat":
            if tok is None:
                return []
            # vLLM's "string" content format: text parts joined by newlines.
            msgs = [{**m, "content": "\n".join(p["text"] for p in m["content"])}
                    if isinstance(m.get("content"), list) else m for m in body["messages"]]
            text = tok.apply_chat_template(
                msgs, tools=_vllm_tools(body.get("tools")),
                chat_template=body.get("chat_template") or st.chat_template,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False), tokenize=False,
                **(body.get("chat_template_kwargs") or {}))
            return tok(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list):
            return list(prompt)
        if tok is None:
            return []
        return tok(prompt, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]

    dp_caches = [set() for _ in st.dp_publishers]

    def cached_tokens(tokens: list[int], rank: int | None = None) -> int:
        if st.fast or not tokens:
            return 0
        cache, publisher = ((st.cache, st.publisher) if rank is None
                            else (dp_caches[rank], st.dp_publishers[rank]))
        hashes = sequence_hashes(tokens, st.block_size, max_blocks=routable_blocks(len(tokens), st.block_size))
        hit = 0
        for h in hashes:
            if h not in cache:
                break
            hit += 1
        new = [i for i, h in enumerate(hashes) if h not in cache]
        cache.update(hashes)
        if publisher is not None and new:
            from bench.sim.vllm_format import stored

            bs = st.block_size
            # Engine block hashes are opaque to kvgate: reuse our own as the engine's.
            publisher.publish([stored([hashes[i] for i in new], tokens[new[0] * bs:(new[-1] + 1) * bs], bs,
                                      parent=hashes[new[0] - 1] if new[0] else None)])
        return hit * st.block_size

    def dp_rank(request: Request) -> int | None:
        """The engine rank of a data-parallel worker that serves this request (None: not data-parallel)."""
        if not st.dp_publishers:
            return None
        pinned = request.headers.get("x-data-parallel-rank")
        return int(pinned) if pinned is not None else len(st.requests) % len(st.dp_publishers)

    async def generate(request: Request, kind: str):
        raw = await request.body()
        body = json.loads(raw)
        rank = dp_rank(request)
        st.requests.append({"headers": dict(request.headers), "body": body, "raw": raw, "kind": kind,
                            "rank": rank})
        if st.mode == "error500":
            return JSONResponse({"error": {"message": "engine died", "type": "InternalServerError",
                                           "param": None, "code": 500}}, status_code=500)
        tokens = [] if st.fast else tokens_for(kind, body)
        n = len(tokens)
        cached = cached_tokens(tokens, rank)
        rid = request.headers.get("x-request-id", "x")
        obj, prefix = ("chat.completion", "chatcmpl-") if kind == "chat" else ("text_completion", "cmpl-")
        usage = {"prompt_tokens": n, "total_tokens": n + st.words, "completion_tokens": st.words,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        words = _reply_words(st, n)
        created = int(time.time())
        if not body.get("stream"):
            if st.first_token_delay_s:
                await asyncio.sleep(st.first_token_delay_s)
            st.prefill[0] += n - cached
            st.prefill[1] += st.first_token_delay_s
            st.prefill[2] += n
            st.prefill[3] += 1
            text = " ".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if kind == "chat" else {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"id": prefix + rid, "object": obj, "created": created, "model": body["model"],
                                 "choices": [choice], "usage": usage},
                                headers={"x-request-id": rid} if st.echo_request_id else None)

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            st.active += 1
            try:
                if st.mode == "hang" or st.first_token_delay_s:
                    deadline = time.monotonic() + (3600 if st.mode == "hang" else st.first_token_delay_s)
                    while time.monotonic() < deadline:
                        if await request.is_disconnected():
                            st.cancelled += 1
                            return
                        await asyncio.sleep(0.02)
                base = {"id": prefix + rid, "object": obj + ".chunk", "created": created, "model": body["model"]}
                if kind == "chat":
                    yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i, w in enumerate(words):
                    if st.pause_after is not None and i == st.pause_after:
                        while not st.release.is_set():
                            if await request.is_disconnected():
                                st.cancelled += 1
                                return
                            await asyncio.sleep(0.02)
                    if st.mode == "die_mid_stream" and i == 2:
                        raise RuntimeError("worker died mid-stream")
                    piece = w if i == 0 else " " + w
                    ch = ({"index": 0, "delta": {"content": piece}} if kind == "chat"
                          else {"index": 0, "text": piece})
                    if i == len(words) - 1:  # vLLM: the last token's event carries the finish reason
                        ch["finish_reason"] = "length"
                    yield _sse({**base, "choices": [ch]})
                    if await request.is_disconnected():
                        st.cancelled += 1
                        return
                if not words:
                    last = ({"index": 0, "delta": {}, "finish_reason": "length"} if kind == "chat"
                            else {"index": 0, "text": "", "finish_reason": "length"})
                    yield _sse({**base, "choices": [last]})
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": usage})
                yield b"data: [DONE]\n\n"
                if st.done_delay_s:
                    await asyncio.sleep(st.done_delay_s)
            except asyncio.CancelledError:
                st.cancelled += 1
                raise
            finally:
                st.active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    async def unstreamed(request: Request, served: bool, kind: str) -> dict | None:
        """The body of a non-streamed request of an API this fake serves (recorded), else None (a 404)."""
        body = await request.json() if served else None
        if not isinstance(body, dict) or body.get("stream"):
            return None
        st.requests.append({"headers": dict(request.headers), "body": body, "kind": kind})
        return body

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await unstreamed(request, st.messages, "messages")
        if body is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        usage = {"input_tokens": 10, "output_tokens": st.words, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        return JSONResponse({"id": "msg_" + request.headers.get("x-request-id", "x"), "type": "message",
                             "role": "assistant", "model": body.get("model"), "stop_reason": "max_tokens",
                             "content": [{"type": "text", "text": " ".join(_reply_words(st, 10))}],
                             "usage": usage})

    def not_found(response_id: str) -> JSONResponse:
        return JSONResponse({"error": {"message": f"Response with id '{response_id}' not found.",
                                       "type": "invalid_request_error", "param": None, "code": 404}},
                            status_code=404)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await unstreamed(request, st.responses, "responses")
        if body is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        prev = body.get("previous_response_id")
        if prev is not None and prev not in st.stored:
            return not_found(prev)
        rid = f"resp_{st.name}_{len(st.requests)}_{int(time.time() * 1e6)}"
        resp = {"id": rid, "object": "response", "model": body.get("model"), "status": "completed",
                "previous_response_id": prev,
                "output": [{"type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": " ".join(_reply_words(st, 10))}]}],
                "usage": {"input_tokens": 10, "output_tokens": st.words, "total_tokens": 10 + st.words,
                          "input_tokens_details": {"cached_tokens": 0}}}
        if body.get("store", True) is not False:
            st.stored[rid] = resp
        return JSONResponse(resp)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        st.lookups.append(response_id)
        if st.lookup_delay_s:
            await asyncio.sleep(st.lookup_delay_s)
        if st.lookup_status is not None:
            return JSONResponse({"error": {"message": "busy", "type": "InternalServerError", "param": None,
                                           "code": st.lookup_status}}, status_code=st.lookup_status)
        resp = st.stored.get(response_id)
        return JSONResponse(resp) if resp is not None else not_found(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if st.stored.pop(response_id, None) is None:
            return not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await request.json()
        st.requests.append({"headers": dict(request.headers), "body": body, "kind": "embeddings"})
        return {"object": "list", "model": body.get("model"), "worker": st.name,
                "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0]}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        kind = "chat" if "messages" in body else "completion"
        toks = tokens_for(kind, body)
        return {"count": len(toks), "max_model_len": 8192, "tokens": toks, "token_strs": None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model, "object": "model", "created": 0, "owned_by": "vllm",
                                            "root": st.model, "parent": None, "max_model_len": 8192}]}

    @app.get("/health")
    async def health():
        return Response(status_code=503 if st.mode == "unhealthy" else 200)

    @app.get("/kv_event_sources")
    async def sources():
        if st.sources_status != 200:
            return Response(status_code=st.sources_status)
        if st.sources is not None:
            return JSONResponse(st.sources)
        pubs = st.dp_publishers or ([st.publisher] if st.publisher is not None else [])
        if pubs:
            return {str(r): {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                             "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint}
                    for r, p in enumerate(pubs)}
        if not st.events_endpoint:
            return {}
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": st.events_endpoint,
                      "replay_endpoint": None, "topic": "kv-events"}}

    @app.get("/metrics")
    async def metrics():
        lbl = f'engine="0",model_name="{st.model}"'
        text = _metrics_page(st, lbl)  # as of the request
        if st.metrics_delay_s:
            await asyncio.sleep(st.metrics_delay_s)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _metrics_page(st: FakeState, lbl: str) -> str:
    """The page vLLM's /metrics would answer with now (the families the gateway reads)."""
    waiting = "".join(f'vllm:num_requests_waiting{{engine="{r}",model_name="{st.model}"}} {float(n)}\n'
                      for r, n in enumerate(st.dp_waiting or [st.waiting]))  # one series per engine
    text = (
        "# TYPE process_start_time_seconds gauge\n"
        f"process_start_time_seconds {st.started}\n"
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{lbl}}} {float(st.running + st.active)}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"{waiting}"
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{lbl}}} {st.kv_usage}\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{st.block_size}",enable_prefix_caching="True",engine="0",'
        f'prefix_caching_hash_algo="sha256"'
        + (f',num_gpu_blocks="{st.num_gpu_blocks}"' if st.num_gpu_blocks else "") + "} 1.0\n"
    )
    for name, i in (("vllm:request_prefill_kv_computed_tokens", 0), ("vllm:request_prefill_time_seconds", 1),
                    ("vllm:request_prompt_tokens", 2)):
        text += (f"# TYPE {name} histogram\n{name}_count{{{lbl}}} {float(st.prefill[3])}\n"
                 f"{name}_sum{{{lbl}}} {float(st.prefill[i])}\n")
    return text


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
