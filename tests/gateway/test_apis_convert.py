"""kvgate's conversion of Responses and Messages bodies into the conversation vLLM renders, compared case
by case with vLLM 0.32's own conversion code (run in the vLLM environment by
``tests/support/vllm_reference.py``: no server, no model). The end-to-end tests compare the tokens too
(tests/e2e/test_apis_vllm.py)."""
from __future__ import annotations

import json
import subprocess

import pytest

from bench.vllm_server import vllm_python
from router.apis import messages as msg_api
from router.apis import responses as resp_api
from router.apis.conversation import Unsupported
from router.local_tokenizer import template_kwargs

pytestmark = pytest.mark.vllm

FN = {"type": "function", "name": "lookup", "description": "Find a thing.",
      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}

RESPONSES = [
    {"model": "m", "input": "hello"},
    {"model": "m", "input": "hello", "instructions": "Be brief."},
    {"model": "m", "input": "", "instructions": ""},
    {"model": "m", "input": [{"role": "user", "content": "hi"}]},
    {"model": "m", "input": [{"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]},
    {"model": "m", "input": [{"type": "message", "role": "user", "content": [  # vLLM leaves empty parts out
        {"type": "input_text", "text": ""}, {"type": "input_text", "text": "a"},
        {"type": "input_text", "text": ""}, {"type": "input_text", "text": "b"}]}]},
    {"model": "m", "input": [{"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
                             {"role": "user", "content": "q"}]},
    {"model": "m", "input": [
        {"role": "user", "content": "q1"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "a1", "annotations": []}]},
        {"role": "user", "content": "q2"}]},
    {"model": "m", "tools": [FN], "input": [
        {"role": "user", "content": "find x"},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\": \"x\"}",
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "function_call_output", "call_id": "c2", "output": "43"},
        {"role": "user", "content": "thanks"}]},
    {"model": "m", "input": [
        {"role": "user", "content": "think"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "m2", "status": "completed",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]}]},
    {"model": "m", "input": [{"role": "assistant", "content": "plain"},
                             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]}]},
    {"model": "m", "input": [{"type": "message", "role": "assistant", "id": "m3", "status": "incomplete",
                              "content": [{"type": "output_text", "text": "to be cont", "annotations": []}]}]},
    {"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c3", "name": "sh", "input": "ls -l ü"},
                             {"type": "custom_tool_call_output", "call_id": "c3", "output": "file"}],
     "tools": [{"type": "custom", "name": "sh", "description": "shell"}]},
    {"model": "m", "input": "x", "reasoning": {"effort": "low"}},
    {"model": "m", "input": "x", "reasoning": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": False}},
    {"model": "m", "input": "x", "tools": [FN, {"type": "function", "name": "g", "parameters": None, "strict": True},
                                            {"type": "namespace", "name": "ns", "description": "d",
                                             "tools": [{"type": "function", "name": "h", "parameters": {}}]}]},
    {"model": "m", "input": [{"type": "item_reference", "id": "x"}]},
]

# Follow-ups with a stored conversation (system messages in it are dropped; new items never merge into it).
HISTORY = [{"role": "system", "content": "old instructions"}, {"role": "user", "content": "q0"},
           {"role": "assistant", "content": "a0"}]
FOLLOW_UPS = [
    ({"model": "m", "input": "next", "instructions": "new"}, HISTORY),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c9", "name": "f", "arguments": "{}"},
                              {"type": "function_call_output", "call_id": "c9", "output": "ok"}]}, HISTORY),
    ({"model": "m", "input": [{"type": "reasoning", "id": "rs_9", "summary": [],
                               "content": [{"type": "reasoning_text", "text": "r"}]}]}, HISTORY),
]

TOOL_USE = {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                             {"type": "tool_use", "id": "tu_1", "name": "lookup",
                                              "input": {"q": "x"}}]}
MESSAGES = [
    {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "max_tokens": 5,
     "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "A"},
                {"type": "text", "text": "B"}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    {"model": "m", "max_tokens": 5, "tools": [{"name": "lookup", "description": "d",
                                               "input_schema": {"type": "object"}},
                                              {"name": "g", "input_schema": {}, "strict": True}],
     "messages": [{"role": "user", "content": "find x"}, TOOL_USE,
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "42"}]},
                  {"role": "assistant", "content": "It is 42."},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "tu_2",
                       "content": [{"type": "text", "text": "l1"}, {"type": "text", "text": "l2"}]},
                      {"type": "text", "text": "and now?"}]}]},
    {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "a"},
                                          {"type": "tool_result", "tool_use_id": "t", "content": "r"}]},
        {"role": "system", "content": "inline"}, {"role": "user", "content": "again"}]},
    {"model": "m", "max_tokens": 5, "output_config": {"effort": "low"},
     "messages": [{"role": "user", "content": [{"type": "redacted_thinking", "data": "x"},
                                               {"type": "text", "text": ""}, {"type": "text", "text": "t"}]}]},
    {"model": "m", "max_tokens": 5, "chat_template_kwargs": {"k": 1}, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
]


def reference(cases: list[dict]) -> list[dict]:
    proc = subprocess.run([str(vllm_python()), "tests/support/vllm_reference.py"], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def kvgate(case: dict) -> dict | None:
    try:
        if case["api"] == "responses":
            view = resp_api.chat_view(case["body"], case.get("history"))
        else:
            view = msg_api.chat_view(case["body"], case.get("merge_system", False))
    except Unsupported:
        return None
    return {"messages": view["messages"], "tools": view.get("tools"), "kwargs": template_kwargs(view)}


def test_conversion_matches_vllm():
    cases = ([{"api": "responses", "body": b} for b in RESPONSES]
             + [{"api": "responses", "body": b, "history": h} for b, h in FOLLOW_UPS]
             + [{"api": "messages", "body": b} for b in MESSAGES]
             + [{"api": "messages", "body": b, "merge_system": True} for b in MESSAGES])
    want = reference(cases)
    # JSON round trip: the reference's output went through JSON too
    got = [json.loads(json.dumps(kvgate(c))) for c in cases]
    mismatches = []
    for case, w, g in zip(cases, want, got):
        if "error" in w:
            continue  # vLLM rejects it; whatever kvgate routes on, vLLM answers the client
        if g is None:
            mismatches.append((case, "kvgate cannot convert what vLLM renders", w))
        elif g != w:
            mismatches.append((case, g, w))
    assert not mismatches, json.dumps(mismatches, indent=1)[:6000]
    accepted = sum("error" not in w for w in want)
    assert accepted >= len(cases) - 2  # the cases are meant to be valid, but for item_reference


def test_unsupported_parts_are_not_guessed():
    with pytest.raises(Unsupported):
        resp_api.chat_view({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]})
    with pytest.raises(Unsupported):
        msg_api.chat_view({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "u"}}]}]})


CHAT_KWARGS_REF = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

out = []
for body in json.loads(sys.stdin.read()):
    r = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)
    out.append(r.build_chat_params(None, "auto").chat_template_kwargs)
print(json.dumps(out))
"""


def test_chat_template_kwargs_are_built_as_vllm_builds_them():
    """A chat completion's template kwargs (router/local_tokenizer.py ``template_kwargs``) against vLLM
    0.32's own ``ChatCompletionRequest.build_chat_params``: the client's chat_template_kwargs, the request's
    fields over them where set, enable_thinking from reasoning_effort unless the client set it."""
    bodies = [{}, {"reasoning_effort": "low"}, {"reasoning_effort": "none"},
              {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
              {"chat_template_kwargs": {"reasoning_effort": "medium", "add_generation_prompt": True},
               "add_generation_prompt": False},
              {"continue_final_message": True, "add_generation_prompt": False,
               "documents": [{"title": "t", "text": "x"}], "chat_template_kwargs": {"custom": 1}}]
    out = subprocess.run([str(vllm_python()), "-c", CHAT_KWARGS_REF], input=json.dumps(bodies),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert [template_kwargs(b) for b in bodies] == theirs
