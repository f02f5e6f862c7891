"""The Anthropic Messages API (``/v1/messages``) as vLLM 0.32 serves it, for routing.

:func:`chat_view` turns a request body into the chat form vLLM renders (its
``AnthropicServingMessages.to_chat_completion_request``):
- the top-level ``system`` (a string, or its text blocks concatenated, Claude Code's billing-header block
  dropped) is one leading system message; a template that rejects a system message after the first
  (vLLM renders ``[system, user, system, user]`` to find out) gets the inline system messages merged into
  it, otherwise they stay in place;
- a message with string content is kept; blocks: ``text`` blocks are text parts, ``thinking`` the
  message's ``reasoning``, ``tool_use`` tool calls (arguments as JSON), a user's ``tool_result`` a tool
  message placed before the user's own message (its text blocks joined with newlines), an assistant's a
  ``Tool result: ...`` text part; a message that is left with nothing (a user message of tool results
  only) is not emitted; one text part is the content as a string;
- ``tools`` become function tools (after the conversation's ``tool_addition``/``tool_removal`` blocks);
  ``output_config.effort`` is the template's ``reasoning_effort``.
Images need the multimodal processor: such requests are routed on load alone, like unrenderable chats.

:func:`validate` answers a malformed body with a 400 in Anthropic's error shape before any worker sees it.
"""
from __future__ import annotations

import json
from typing import Any

from router.apis.conversation import BILLING_HEADER, Unsupported, vllm_conversation
from router.errors import APIError

BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                         "tool_reference", "tool_addition", "tool_removal", "server_tool_use",
                         "web_search_tool_result", "document", "search_result"})
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def sse_error_event(message: str) -> bytes:
    return b"event: error\ndata: " + json.dumps(error_body(500, message)).encode() + b"\n\n"


def validate(body: dict) -> None:
    """The structure vLLM's request model requires (a 400 here rather than a worker's): ``model``,
    ``max_tokens`` (an integer), ``messages`` (a list of {role, content}), well-formed ``system``."""
    def bad(msg: str, param: str):
        raise APIError(400, msg, param=param, type_="invalid_request_error")

    if not isinstance(body.get("model"), str) or not body["model"]:
        bad("`model` is required (a non-empty string).", "model")
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int):
        bad("`max_tokens` is required (an integer).", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        bad("`messages` is required (a list of messages).", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            bad(f"messages.{i}: each message needs a `role` of user, assistant or system.", f"messages.{i}")
        _check_content(m.get("content"), f"messages.{i}.content", bad, required=True)
    system = body.get("system")
    if system is not None:
        _check_content(system, "system", bad, required=False)
    for key in ("tools", "stop_sequences"):
        if body.get(key) is not None and not isinstance(body[key], list):
            bad(f"`{key}` must be a list.", key)
    for key in ("stream",):
        if body.get(key) is not None and not isinstance(body[key], bool):
            bad(f"`{key}` must be a boolean.", key)


def _check_content(content: Any, where: str, bad, *, required: bool) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        bad(f"{where} must be a string or a list of content blocks.", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            bad(f"{where}.{j}: a content block needs a known `type`.", f"{where}.{j}")
        if block.get("type") == "text" and not isinstance(block.get("text"), (str, type(None))):
            bad(f"{where}.{j}.text must be a string.", f"{where}.{j}.text")


def merge_inline_system(template: str | None) -> bool:
    """vLLM's test: does the template render a system message after the first one?"""
    if not template:
        return True
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    conv = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=conv, add_generation_prompt=False)
        return False
    except jinja2.TemplateError:
        return True


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = [b["text"] for b in content if isinstance(b, dict) and b.get("type") == "text" and b.get("text")
             and not b["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def input_messages(body: dict, merge_system: bool) -> list[dict]:
    """The OpenAI chat messages vLLM converts the request into."""
    out: list[dict] = []
    system_parts: list[str] = []
    system = body.get("system")
    if system:
        if isinstance(system, str):
            system_parts.append(system)
        else:
            system_parts += [b["text"] for b in system if isinstance(b, dict) and b.get("type") == "text"
                             and b.get("text") and not b["text"].startswith(BILLING_HEADER)]
    msgs = body.get("messages") or []
    if merge_system:
        system_parts += [t for m in msgs if m.get("role") == "system" for t in [_system_text(m["content"])] if t]
    if system_parts:
        out.append({"role": "system", "content": "".join(system_parts)})
    for m in msgs:
        role, content = m.get("role"), m.get("content")
        if role == "system":
            text = None if merge_system else _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        msg: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            msg["content"] = content
        else:
            _blocks(content, role, msg, out)
        if not (role == "user" and "content" not in msg):
            out.append(msg)
    return out


def _blocks(blocks: list, role: str, msg: dict, out: list) -> None:
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text" and b.get("text"):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and b.get("source"):
            raise Unsupported("an image block")
        elif kind == "thinking" and b.get("thinking") is not None:
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            if not b.get("id"):
                raise Unsupported("a tool_use block without an id")  # vLLM names it by the clock
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(b, out)
            else:
                text = str(b.get("content")) if b.get("content") else ""
                if not isinstance(b.get("content"), (str, type(None))):
                    raise Unsupported("an assistant tool_result with structured content")
                parts.append({"type": "text", "text": f"Tool result: {text}"})
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        msg["content"] = parts[0]["text"] if len(parts) == 1 else parts


def _user_tool_result(b: dict, out: list) -> None:
    content = b.get("content")
    text = ""
    refs = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image":
                raise Unsupported("an image in a tool result")
            elif item.get("type") == "tool_reference" and (item.get("tool_name") or item.get("name")):
                refs.append(item)
        text = "\n".join(texts)
    if refs:
        raise Unsupported("tool references (expanded by the chat template)")
    out.append({"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": text or ""})


def tools_for_template(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    changes = [b for m in body.get("messages") or [] if isinstance(m.get("content"), list)
               for b in m["content"] if b.get("type") in ("tool_addition", "tool_removal")]
    if changes:
        raise Unsupported("tool_addition/tool_removal blocks")
    if tools is None:
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise Unsupported("a tool that is not an object")
        schema = t.get("input_schema")
        if isinstance(schema, dict) and "type" not in schema:
            schema = {**schema, "type": "object"}  # vLLM's default
        fn: dict[str, Any] = {"name": t.get("name"), "description": t.get("description"), "parameters": schema}
        for key in ("strict", "defer_loading"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_view(body: dict, merge_system: bool = False, effort_matters: bool = True) -> dict:
    """The chat body that tokenizes to the prompt vLLM renders for this Messages request (raises
    :class:`Unsupported` when it cannot be reproduced). ``effort_matters``: the template reads
    ``reasoning_effort`` or ``enable_thinking``."""
    thinking = body.get("thinking")
    if effort_matters and isinstance(thinking, dict) and thinking.get("type") == "disabled":
        raise Unsupported("thinking disabled (vLLM probes the template for the effort it maps to)")
    view: dict[str, Any] = {"messages": vllm_conversation(input_messages(body, merge_system))}
    oc = body.get("output_config")
    # the template's kwargs as for a chat completion with this effort (router/local_tokenizer.py
    # template_kwargs): it and enable_thinking over the client's chat_template_kwargs
    view["reasoning_effort"] = oc.get("effort") if isinstance(oc, dict) else None
    if body.get("chat_template_kwargs"):
        view["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = tools_for_template(body)
    if tools is not None:
        view["tools"] = tools
    if isinstance(body.get("cache_salt"), str):
        view["cache_salt"] = body["cache_salt"]
    return view


def usage_as_chat(usage: Any) -> dict | None:
    """Anthropic usage in the chat form the decision record reads: vLLM reports ``input_tokens`` net of
    the cache (prompt = input + cache read + cache creation) and the hit as ``cache_read_input_tokens``."""
    if not isinstance(usage, dict) or "cache_read_input_tokens" not in usage:
        return None
    read = usage.get("cache_read_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + read + (usage.get("cache_creation_input_tokens") or 0)
    out = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": read}}
    if isinstance(usage.get("output_tokens"), int):
        out["completion_tokens"] = usage["output_tokens"]
    return out
