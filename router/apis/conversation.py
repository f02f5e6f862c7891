"""Chat messages as vLLM 0.32 hands them to the chat template (its ``parse_chat_messages`` with the
"string" content format, text only), so a converted Responses or Messages body tokenizes as vLLM's does.

- content: None -> ""; a string stays; a list of parts -> its text parts joined with newlines (``text``,
  ``input_text``, ``output_text`` use ``text``, ``refusal`` and ``thinking`` their own key; a text or
  refusal part without its text is skipped, and so is an empty part: vLLM keeps only non-empty ones).
  Any other part (images, audio, embeddings) has placeholder tokens only the multimodal processor knows:
  :class:`Unsupported`, and the request is routed on load;
- a system message drops Claude Code's ``x-anthropic-billing-header`` line;
- an assistant message keeps ``tool_calls`` (arguments decoded to an object, ``{}`` when empty or not a
  JSON object; an empty list is dropped) and ``reasoning`` (also as ``reasoning_content``); a tool
  message keeps ``tool_call_id``; ``name`` and ``task`` (strings) are kept; a developer message carries
  ``tools`` (None when absent). Every other key is dropped.
"""
from __future__ import annotations

import json
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_KEY = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
             "thinking": "thinking"}


class Unsupported(Exception):
    """The body holds something whose tokens the gateway cannot reproduce (routed on load alone)."""


def _parts(content: Any) -> list:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    raise Unsupported(f"content of type {type(content).__name__}")


def _strip_billing(parts: list) -> list:
    out = []
    for p in parts:
        text = p if isinstance(p, str) else (p.get("text") if isinstance(p, dict) and p.get("type") == "text"
                                             else None)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(p)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(p, str) else {**p, "text": rest})
    return out


def _text(parts: list) -> str:
    texts = []
    for p in parts:
        if isinstance(p, str):
            if p:
                texts.append(p)
            continue
        if not isinstance(p, dict):
            raise Unsupported("a content part that is not an object")
        key = _TEXT_KEY.get(p.get("type")) if p.get("uuid") is None else None
        if key is None:
            raise Unsupported(f"content part of type {p.get('type')!r}")
        value = p.get(key)
        if value is None and p.get("type") in ("text", "refusal"):
            continue
        if not isinstance(value, str):
            raise Unsupported(f"{p.get('type')} part without text")
        if value:
            texts.append(value)
    return "\n".join(texts)


def _arguments(value: Any) -> dict:
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _tool_calls(calls: Any) -> list | None:
    if not isinstance(calls, list):
        return calls
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function":
            raise Unsupported("a tool call vLLM rejects")
        out.append({**c, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}})
    return out


def vllm_conversation(messages: list) -> list[dict]:
    """``messages`` (OpenAI chat form) as the conversation vLLM renders."""
    out: list[dict] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Unsupported("a message without a role")
        role = m["role"]
        parts = _parts(m.get("content"))
        if role == "system":
            parts = _strip_billing(parts)
        msg: dict[str, Any] = {"role": role, "content": _text(parts)}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                calls = _tool_calls(list(m["tool_calls"]) if isinstance(m["tool_calls"], (list, tuple))
                                    else m["tool_calls"])
                if calls is not None:
                    msg["tool_calls"] = calls
            if m.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if role == "developer":
            msg["tools"] = m.get("tools")
        out.append(msg)
    return out
