"""The OpenAI Responses API (``/v1/responses``) as vLLM 0.32 serves it, for routing.

:func:`chat_view` turns a request body into the chat form vLLM renders (``construct_input_messages`` and
``build_chat_params`` of vLLM's non-Harmony path), so the gateway tokenizes it like a chat request:
- ``instructions`` (when non-empty) is a leading system message; a follow-up's history (the owner
  record's, see ``indexer/index/owners.py``) comes next, without system messages, since instructions do
  not carry over; then the input: a string is one user message; items become messages: a role message
  as it is (an assistant one as the text of its first content part), ``function_call`` and
  ``custom_tool_call`` items tool calls merged into the preceding assistant message, ``reasoning`` its
  text as the assistant's ``reasoning``, ``function_call_output`` / ``custom_tool_call_output`` tool
  messages. Other items (``item_reference``, built-in tool calls) are not rendered by vLLM either: the
  request is routed on load and vLLM answers it;
- a last message item with status ``in_progress``/``incomplete`` is continued
  (``continue_final_message``), otherwise a generation prompt is added; ``reasoning.effort`` becomes the
  template's ``reasoning_effort`` (and ``enable_thinking`` unless the request sets it);
- vLLM tokenizes the rendered Responses prompt with the tokenizer's special tokens added (unlike chat).

Function tools are given to the template as vLLM does (namespaced ones flattened to
``<namespace>__<name>``, custom tools as a one-string-argument function). Models that use the Harmony
format (gpt-oss) are rendered by openai-harmony, which this module does not reproduce.

:func:`turn_messages` is what this turn adds to the conversation a follow-up carries, stored with the
response's owner; :func:`history_of` rebuilds a follow-up's conversation from its chain.
"""
from __future__ import annotations

import json
from typing import Any

from router.apis.conversation import Unsupported, vllm_conversation

CUSTOM_INPUT_KEY = "input"
_CUSTOM_PARAMETERS = {"type": "object",
                      "properties": {CUSTOM_INPUT_KEY: {"type": "string",
                                                        "description": "The freeform text payload for this tool."}},
                      "required": [CUSTOM_INPUT_KEY], "additionalProperties": False}
_OUTPUT_TYPES = ("function_call_output", "custom_tool_call_output")


def input_messages(body: dict, history: list | None = None) -> list[dict]:
    """The chat messages (before vLLM's per-message parsing) vLLM builds for this request."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise Unsupported("instructions must be a string")
        messages.append({"role": "system", "content": instructions})
    if history:
        messages.extend(m for m in history if m.get("role") != "system")
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        converted: list[dict] = []  # merged only with each other, never into the history (as vLLM does)
        for item in items:
            msg = _item_message(item, converted[-1] if converted else None)
            if msg is not None:
                converted.append(msg)
        messages.extend(converted)
    else:
        raise Unsupported("input must be a string or a list")
    return messages


def _item_message(item: Any, prev: dict | None) -> dict | None:
    if not isinstance(item, dict):
        raise Unsupported("an input item that is not an object")
    kind = item.get("type")
    prev_asst = prev if prev is not None and prev.get("role") == "assistant" else None
    call = None
    if kind == "function_call":
        name = item.get("name")
        if item.get("namespace"):
            name = f"{item['namespace']}__{name}"
        call = {"id": item.get("call_id"), "function": {"name": name, "arguments": item.get("arguments")},
                "type": "function"}
    elif kind == "custom_tool_call":
        call = {"id": item.get("call_id"),
                "function": {"name": item.get("name"),
                             "arguments": json.dumps({CUSTOM_INPUT_KEY: item.get("input") or ""},
                                                     ensure_ascii=False)},
                "type": "function"}
    if call is not None:
        if prev_asst is not None:
            calls = prev_asst.get("tool_calls")
            if calls is None:
                prev_asst["tool_calls"] = [call]
                return None
            if isinstance(calls, list):
                prev_asst["tool_calls"] = [*calls, call]  # a copy: the body's own list stays as sent
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise Unsupported("encrypted reasoning")
        content, summary = item.get("content") or [], item.get("summary") or []
        src = content if content else summary
        reasoning = src[0].get("text", "") if src and isinstance(src[0], dict) else ""
        if prev_asst is not None and prev_asst.get("reasoning") is None:
            prev_asst["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in _OUTPUT_TYPES:
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if role == "assistant":
        content = item.get("content")
        text = None
        if isinstance(content, str):
            text = content
        elif isinstance(content, list) and content:
            text = content[0].get("text") if isinstance(content[0], dict) else None
        if text is not None:
            if prev_asst is not None and prev_asst.get("content") is None:
                prev_asst["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if role is not None and kind in (None, "message"):
        return dict(item)
    raise Unsupported(f"input item of type {kind!r}")


def _continue_final(body: dict) -> bool:
    items = body.get("input")
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    if last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def tools_for_template(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise Unsupported("tools must be a list")
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise Unsupported("a tool that is not an object")
        if t.get("type") == "function":
            out.append(_function(t, t.get("name")))
        elif t.get("type") == "custom":
            out.append({"type": "function", "function": {"name": t.get("name"),
                                                         "description": t.get("description"),
                                                         "parameters": _CUSTOM_PARAMETERS}})
        elif t.get("type") == "namespace":
            for inner in t.get("tools") or []:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    out.append(_function(inner, f"{t.get('name')}__{inner.get('name')}"))
    return out or None


def _function(t: dict, name: Any) -> dict:
    fn = {"name": name, "description": t.get("description"), "parameters": t.get("parameters")}
    if t.get("strict") is not None:
        fn["strict"] = t["strict"]
    return {"type": "function", "function": fn}


def chat_view(body: dict, history: list | None = None) -> dict:
    """The chat body that tokenizes to the prompt vLLM renders for this Responses request (raises
    :class:`Unsupported` when it cannot be reproduced)."""
    messages = vllm_conversation(input_messages(body, history))
    cont = _continue_final(body)
    reasoning = body.get("reasoning")
    # the template's kwargs as for a chat completion with these fields (router/local_tokenizer.py
    # template_kwargs): the effort and enable_thinking from it, over the client's chat_template_kwargs
    view: dict[str, Any] = {"messages": messages, "add_generation_prompt": not cont,
                            "continue_final_message": cont, "add_special_tokens": True,
                            "reasoning_effort": reasoning.get("effort") if isinstance(reasoning, dict) else None}
    if body.get("chat_template_kwargs"):
        view["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = tools_for_template(body)
    if tools is not None:  # also with tool_choice "none" (vLLM's default)
        view["tools"] = tools
    if isinstance(body.get("cache_salt"), str):
        view["cache_salt"] = body["cache_salt"]
    return view


def turn_messages(body: dict, response: dict) -> list[dict] | None:
    """What this turn adds to the conversation a follow-up carries: vLLM keeps the request's messages and
    drops the system ones when it prepends them (instructions do not carry over), then adds the text of
    each output message part as an assistant message. None when the turn cannot be reproduced."""
    try:
        messages = [m for m in input_messages({**body, "instructions": None}) if m.get("role") != "system"]
    except Unsupported:
        return None
    output = response.get("output")
    if not isinstance(output, list):
        return None
    for item in output:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or []:
                text = part.get("text") if isinstance(part, dict) else None
                if not isinstance(text, str):
                    return None
                messages.append({"role": "assistant", "content": text})
    return messages


def history_of(chain: list[dict]) -> list[dict] | None:
    """A follow-up's conversation from its chain of owner records (newest first): the turns in order;
    None when a turn is unknown or the chain does not reach its first response."""
    if not chain or chain[-1].get("parent") is not None:
        return None
    history: list[dict] = []
    for rec in reversed(chain):
        delta = rec.get("delta")
        if not isinstance(delta, list):
            return None
        history.extend(delta)
    return history


def usage_as_chat(usage: Any) -> dict | None:
    """Responses usage (``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``) in the
    chat form the decision record and the load tracker read (``prompt_tokens``,
    ``prompt_tokens_details.cached_tokens``, ``completion_tokens``)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    out: dict[str, Any] = {"prompt_tokens": usage.get("input_tokens")}
    if isinstance(usage.get("output_tokens"), int):
        out["completion_tokens"] = usage["output_tokens"]
    if isinstance(details, dict):
        out["prompt_tokens_details"] = {"cached_tokens": details.get("cached_tokens")}
    return out
