"""Reading the Responses and Messages answers as they pass through (router/apis/hooks.py): SSE events split
anywhere, oversized events skipped, usage in the decision record's chat form, response owners recorded,
and worker errors of the Messages API turned into Anthropic's shape. Real vLLM streams are read by the
same code in tests/e2e/test_apis_vllm.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

from indexer.index.owners import MemoryOwners
from router.apis.hooks import MessagesHooks, ResponsesHooks, SSEReader
from router.config import Settings


def sse(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


def state():
    return SimpleNamespace(settings=Settings(), owners=MemoryOwners(60, 10))


def test_sse_reader_splits_anywhere_and_skips_oversized_events():
    stream = (sse("a", {"x": 1}) + sse("big", {"pad": "p" * 5000}) + sse("b", {"y": 2}) + sse("a", {"x": 3}))
    for step in (1, 7, 4096, len(stream)):
        r = SSEReader((b"a", b"b", b"big"), max_event=1024)
        got = [ev for i in range(0, len(stream), step) for ev in r.feed(stream[i:i + step])]
        assert [(n, json.loads(d)) for n, d in got] == [("a", {"x": 1}), ("b", {"y": 2}), ("a", {"x": 3})], step


def test_an_oversized_event_cut_between_the_newlines_of_its_end_does_not_take_the_next_event_with_it():
    # the first chunk outgrows the limit and ends with the first newline of the event's blank line: the
    # newline that starts the next chunk ends the skipped event, not the normal one after it
    big = sse("big", {"pad": "p" * 2000})
    stream = big + sse("a", {"x": 1}) + sse("b", {"y": 2})
    for cut in (len(big) - 1, len(big) - 2, len(big), 1500):
        r = SSEReader((b"a", b"b", b"big"), max_event=1024)
        got = list(r.feed(stream[:cut])) + list(r.feed(stream[cut:]))
        assert [(n, json.loads(d)) for n, d in got] == [("a", {"x": 1}), ("b", {"y": 2})], cut


async def test_responses_stream_records_the_owner_before_the_id_is_seen_and_the_usage_at_the_end():
    st = state()
    d = SimpleNamespace(chosen="w1", model="m")
    body = {"model": "m", "input": "hi", "instructions": "sys"}
    h = ResponsesHooks(st, d, body)
    created = sse("response.created", {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}})
    await h.on_chunk(created[:20])
    assert await st.owners.get("resp_1") is None
    await h.on_chunk(created[20:])
    assert await st.owners.get("resp_1") == {"worker": "w1", "model": "m", "parent": None, "delta": None}
    done = {"id": "resp_1", "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "hello"}]}],
            "usage": {"input_tokens": 70, "input_tokens_details": {"cached_tokens": 64}}}
    await h.on_chunk(sse("response.output_text.delta", {"delta": "hello"}))
    assert not h.complete  # a client that leaves now did disconnect (router/proxy.py)
    await h.on_chunk(sse("response.completed", {"response": done}))
    assert h.complete  # ... after this, it had the whole response
    assert h.usage == {"prompt_tokens": 70, "prompt_tokens_details": {"cached_tokens": 64}}
    rec = await st.owners.get("resp_1")
    # instructions do not carry over to a follow-up: the turn is the user's message and the answer
    assert rec["delta"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


async def test_store_false_records_nothing():
    st = state()
    h = ResponsesHooks(st, SimpleNamespace(chosen="w1", model="m"), {"input": "x", "store": False})
    await h.on_body(200, json.dumps({"id": "resp_2", "status": "completed", "output": []}).encode())
    assert await st.owners.get("resp_2") is None


async def test_messages_usage_and_error_shape():
    h = MessagesHooks(state())
    await h.on_chunk(sse("message_start", {"message": {"usage": {"input_tokens": 100, "output_tokens": 0}}}))
    assert h.usage is None  # message_start carries no cache figures in vLLM 0.32
    await h.on_chunk(sse("message_delta", {"usage": {"input_tokens": 4, "cache_read_input_tokens": 96,
                                                     "cache_creation_input_tokens": 0, "output_tokens": 5}}))
    assert h.usage == {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 96},
                       "completion_tokens": 5}  # the load tracker counts what it generated
    assert not h.complete
    await h.on_chunk(sse("message_stop", {"type": "message_stop"}))
    assert h.complete
    raw = json.dumps({"error": {"message": "bad messages", "type": "Bad Request", "code": 400}}).encode()
    assert json.loads(await h.on_body(400, raw)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad messages"}}
    already = json.dumps({"type": "error", "error": {"type": "x", "message": "y"}}).encode()
    assert await h.on_body(400, already) == already
    assert h.stream_error("gone").startswith(b"event: error\ndata: ")
