"""The parity check's decisions (router/parity.py), fast, against a real HTTP server on loopback.

The server answers ``/v1/completions`` like a vLLM worker with its own tokenizer and block size; the KV
event path is emulated: the server hands kvgate's hashes of the tokens it "stored" straight to the
checker's ``observe`` (what the ingestor's observer callback does with real events). The real path --
real vLLM, ZMQ, the ingestor -- is covered by tests/e2e/test_gateway_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi import FastAPI, Request

from indexer.hashing import sequence_hashes
from router.metrics import GatewayMetrics
from router.parity import CACHE_BLIND, OK, SILENT, UNVERIFIED, ParityChecker, chat_probe_body
from tests.support.servers import ThreadServer


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def render(body: dict) -> str:
    """A stand-in chat template: role, then content (content lists joined by newlines), per message."""
    out = []
    for m in body["messages"]:
        c = m.get("content")
        out.append(f"<{m['role']}>" + ("\n".join(p["text"] for p in c) if isinstance(c, list) else c or ""))
    return "".join(out) + ("<assistant>" if body.get("add_generation_prompt") else "")


class Worker:
    """What the fake worker does with a probe: tokenize, and (maybe) announce the stored blocks."""

    def __init__(
        self, tokenize=chars, block_size: int = 16, publish_after: int = 0, status: int = 200
    ) -> None:
        self.tokenize = tokenize
        self.block_size = block_size
        self.publish_after = publish_after  # drop the events of this many probes first (a slow joiner)
        self.status = status
        self.checker: ParityChecker | None = None
        self.probes = 0
        self.render = render  # the worker's chat rendering (its template)
        self.tokenize_requests: list[dict] = []


@pytest.fixture
def worker():
    w = Worker()
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        w.probes += 1
        if w.status != 200:
            return _error(w.status)
        tokens = w.tokenize(body["prompt"])
        if w.probes > w.publish_after:
            w.checker.observe("w", "GPU", sequence_hashes(tokens, w.block_size))
        return {"usage": {"prompt_tokens": len(tokens), "completion_tokens": 1}}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        w.tokenize_requests.append(body)
        if w.status != 200:
            return _error(w.status)
        toks = chars(w.render(body))
        return {"count": len(toks), "max_model_len": 4096, "tokens": toks, "token_strs": None}
    @app.post("/v1/{api}")
    async def other_api(api: str, request: Request):
        """Another API's probe: the worker "renders" the body as the characters of its JSON."""
        body = await request.json()
        tokens = chars(json.dumps(body, sort_keys=True))
        w.checker.observe("w", "GPU", sequence_hashes(tokens, w.block_size))
        return {"usage": {"input_tokens": len(tokens)}}

    srv = ThreadServer(app).start()
    w.url = srv.url
    yield w
    srv.stop()


def _error(status: int):
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
        status_code=status,
    )


async def run(
    worker: Worker, *, kvgate_tokenize=chars, block_size: int = 16, events_seen: bool = True, metrics=None,
    indexed=None, kvgate_render=render, api_probes=None,
):
    async def tokenize(model: str, text: str):
        return kvgate_tokenize(text) if kvgate_tokenize else None

    async def tokenize_chat(model: str, body: dict):
        return (chars(kvgate_render(body)), "") if kvgate_render else (None, "no local chat template")

    async with httpx.AsyncClient() as client:
        checker = ParityChecker(
            client,
            tokenize,
            lambda model: block_size,
            events_seen=lambda w: events_seen,
            indexed=indexed,
            metrics=metrics,
            tokenize_chat=tokenize_chat,
            decode=lambda model, ids: "".join(map(chr, ids)),
            attempts=3,
            settle_s=0.5,
            api_probes=api_probes,
        )
        worker.checker = checker
        return await checker.check("w", worker.url, "tiny")


async def test_matching_worker_is_ok(worker):
    m = GatewayMetrics()
    r = await run(worker, metrics=m)
    assert r.status == OK and not r.cache_blind
    assert r.matched_blocks == r.expected_blocks > 5 and r.worker_tokens == r.kvgate_tokens
    assert m.cache_blind.labels("w")._value.get() == 0.0


async def test_other_tokenizer_is_cache_blind(worker, caplog):
    worker.tokenize = lambda text: [ord(c) for c in text.replace(" ", "")]  # counts differ, ids too
    m = GatewayMetrics()
    with caplog.at_level(logging.WARNING, logger="kvgate.parity"):
        r = await run(worker, metrics=m)
    assert r.status == CACHE_BLIND and r.matched_blocks == 0
    assert "different tokenizer" in r.reason
    assert m.cache_blind.labels("w")._value.get() == 1.0
    assert any("CACHE-BLIND" in rec.getMessage() and "worker w" in rec.getMessage() for rec in caplog.records)


async def test_other_block_size_is_cache_blind(worker):
    worker.block_size = 32
    r = await run(worker, block_size=16)
    assert r.status == CACHE_BLIND and r.matched_blocks == 0
    assert "same token count" in r.reason


async def test_probe_retried_when_the_subscription_missed_it(worker):
    """The first probe's events are lost (a new SUB socket is not live yet) and the ingestor saw nothing:
    a second probe with a fresh nonce settles it."""
    worker.publish_after = 1
    r = await run(worker, events_seen=False)
    assert r.status == OK and r.attempts == 2 and worker.probes == 2


async def test_no_events_at_all_is_cache_blind_after_the_retries(worker):
    worker.publish_after = 99
    r = await run(worker, events_seen=False)
    assert r.status == CACHE_BLIND and r.attempts == 3 and "no KV events" in r.reason


async def test_without_a_tokenizer_nothing_is_verified(worker):
    r = await run(worker, kvgate_tokenize=None)
    assert r.status == UNVERIFIED and worker.probes == 0


async def test_a_failing_probe_does_not_mark_the_worker(worker):
    worker.status = 500
    r = await run(worker)
    assert r.status == UNVERIFIED and "probe failed" in r.reason and not r.cache_blind


async def test_probe_already_cached_and_indexed_is_ok(worker):
    """A worker whose tokenizer maps the nonce to an unknown-word token sees the same probe again: it has
    the blocks cached and publishes nothing new. The index already holding every probe block for that
    worker settles it; an index that holds only part of them does not."""
    worker.publish_after = 99

    async def all_indexed(w, model, hashes):
        return len(hashes)

    async def half_indexed(w, model, hashes):
        return len(hashes) // 2

    r = await run(worker, indexed=all_indexed)
    assert r.status == OK and "already cached" in r.reason and r.matched_blocks == r.expected_blocks
    r = await run(worker, indexed=half_indexed)
    assert r.status == CACHE_BLIND


# -- the chat probe -------------------------------------------------------------------------------------


async def test_chat_probe_sends_system_content_list_and_tool_message_and_matches(worker):
    m = GatewayMetrics()
    r = await run(worker, metrics=m)
    assert r.chat["status"] == OK and r.chat["kvgate_tokens"] == r.chat["worker_tokens"] > 50, r.chat
    assert not r.chat_cache_blind and m.chat_cache_blind.labels("w")._value.get() == 0.0
    (body,) = worker.tokenize_requests
    roles = [msg["role"] for msg in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool"] and body["add_generation_prompt"] is True
    assert isinstance(body["messages"][1]["content"], list) and body["messages"][2]["tool_calls"]
    assert body["model"] == "tiny"


async def test_chat_template_difference_marks_chat_only_with_the_first_differing_token(worker, caplog):
    """The worker flattens content lists with a space where kvgate uses a newline: completions still
    match (ok), chat is cache-blind, and the report points at the first token that differs."""
    def spaced(body):
        return render({**body, "messages": [
            {**m, "content": " ".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list)
            else m for m in body["messages"]]})
    worker.render = spaced
    m = GatewayMetrics()
    with caplog.at_level(logging.WARNING, logger="kvgate.parity"):
        r = await run(worker, metrics=m)
    assert r.status == OK and not r.cache_blind  # completions stay cache-aware
    assert r.chat["status"] == CACHE_BLIND and r.chat_cache_blind
    first = r.chat["first_mismatch"]
    mine = render(chat_probe_body("tiny", "x" * 12))
    assert first["kvgate_token"] == ord("\n") and first["worker_token"] == ord(" ")
    assert first["kvgate_text"].startswith("\nSay") and first["worker_text"].startswith(" Say")
    assert first["index"] == mine.index("\nSay")  # the nonce has a fixed length
    assert "from token" in r.chat["reason"] and "chat prompts miss this worker's cache" in r.chat["reason"]
    assert m.chat_cache_blind.labels("w")._value.get() == 1.0
    assert m.cache_blind.labels("w")._value.get() == 0.0
    assert any("chat parity" in rec.getMessage() and "CACHE-BLIND" in rec.getMessage()
               for rec in caplog.records)
    assert r.to_dict()["chat"]["first_mismatch"] == first


async def test_chat_probe_with_one_side_a_prefix_of_the_other(worker):
    worker.render = lambda body: render(body) + "<extra>"
    r = await run(worker)
    first = r.chat["first_mismatch"]
    assert r.chat["status"] == CACHE_BLIND
    assert first["kvgate_token"] is None and first["worker_token"] == ord("<")
    assert first["index"] == r.chat["kvgate_tokens"] == r.chat["worker_tokens"] - len("<extra>")


async def test_chat_unverified_without_a_local_template_or_when_the_worker_refuses(worker):
    r = await run(worker, kvgate_render=None)
    assert r.chat == {"status": UNVERIFIED, "reason": "no local chat template"}
    assert not worker.tokenize_requests
    assert not r.chat_cache_blind
    worker.status = 400
    r = await run(worker)
    assert r.chat["status"] == UNVERIFIED and "answered 400" in r.chat["reason"] and not r.chat_cache_blind


async def test_a_cache_blind_worker_is_chat_blind_too(worker):
    worker.block_size = 32
    r = await run(worker, block_size=16)
    assert r.cache_blind and r.chat["status"] == OK and r.chat_cache_blind


def test_a_worker_is_blind_per_request_kind_by_its_last_parity_result():
    from router.config import WorkerConfig
    from router.worker import Worker

    w = Worker(name="w", url="http://w:8000", config=WorkerConfig(url="http://w:8000"))
    assert not w.blind_for("chat") and not w.blind_for("completion")
    w.parity = {"status": "ok", "chat": {"status": "cache-blind"}}
    assert w.blind_for("chat") and w.chat_cache_blind and not w.blind_for("completion") and not w.cache_blind
    w.parity = {"status": "cache-blind", "chat": {"status": "ok"}}
    assert w.blind_for("chat") and w.blind_for("completion")
    w.parity = {"status": "ok", "chat": {"status": "unverified"}}
    assert not w.blind_for("chat")
def api_probe(api: str, render):
    """An API probe whose kvgate side renders the body with ``render`` (the worker renders its JSON)."""

    async def probe(model: str, nonce: str):
        body = {"model": model, "input": f"probe {nonce} " + "words " * 40}
        return f"/v1/{api}", body, chars(render(body)), lambda answer: answer["usage"]["input_tokens"]

    return probe


async def test_api_probe_mismatch_marks_only_that_api(worker):
    same = lambda body: json.dumps(body, sort_keys=True)  # noqa: E731
    other = lambda body: json.dumps(body)  # noqa: E731  (key order differs: other tokens, same count)
    r = await run(worker, api_probes={"responses": api_probe("responses", same),
                                      "messages": api_probe("messages", other)})
    assert r.status == OK and not r.cache_blind
    assert r.apis["responses"]["status"] == OK
    assert r.apis["messages"]["status"] == CACHE_BLIND and "same token count" in r.apis["messages"]["reason"]
    assert r.to_dict()["apis"]["messages"]["status"] == CACHE_BLIND


async def test_api_probes_wait_for_the_completion_probe(worker):
    worker.tokenize = lambda text: [ord(c) for c in text.replace(" ", "")]
    r = await run(worker, api_probes={"responses": api_probe("responses", str)})
    assert r.status == CACHE_BLIND and r.apis["responses"]["status"] == UNVERIFIED


async def test_blind_for_silence_is_checked_again_at_the_first_event(worker):
    """Cache-blind because no event came back (a stream that was not live yet): the worker's first event
    later asks for the check again (``recheck``), which then passes; a verdict for a real mismatch is not
    re-checked by events."""
    worker.publish_after = 99
    asked: list[str] = []
    r = await run(worker, events_seen=False)
    assert r.status == CACHE_BLIND and r.reason.startswith(SILENT)
    worker.checker.recheck = asked.append
    worker.checker.observe("w", "GPU", [1, 2])
    worker.checker.observe("w", "GPU", [3])  # once, not per event
    await asyncio.sleep(0.05)
    assert asked == ["w"]
    worker.publish_after = 0
    assert (await run(worker)).status == OK  # what the recheck then finds
    mismatch = await run(worker, block_size=8)  # the worker publishes 16-token blocks
    assert mismatch.status == CACHE_BLIND and not mismatch.reason.startswith(SILENT)
    worker.checker.recheck = asked.append
    worker.checker.observe("w", "GPU", [4])
    await asyncio.sleep(0.05)
    assert asked == ["w"]
