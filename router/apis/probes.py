"""Parity probes of the Responses and Messages APIs (router/parity.py ``api_probes``): a request nobody
sent before, with the parts whose rendering is the API's own (instructions, a function call and its
output; a system prompt, a tool use and its tool result), and kvgate's tokens for it."""
from __future__ import annotations

import json

from router.apis import MESSAGES, RESPONSES, fit_template, template_traits
from router.apis import messages as msg_api
from router.apis import responses as resp_api
from router.parity import probe_prompt

_TOOL = {"name": "lookup", "description": "Look a word up.",
         "schema": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}


def responses_probe(model: str, nonce: str) -> dict:
    call = f"call_{nonce[:8]}"
    return {"model": model, "instructions": "kvgate parity probe", "max_output_tokens": 1, "temperature": 0.0,
            "store": False,
            "tools": [{"type": "function", "name": _TOOL["name"], "description": _TOOL["description"],
                       "parameters": _TOOL["schema"]}],
            "input": [{"role": "user", "content": probe_prompt(nonce, 60)},
                      {"type": "function_call", "call_id": call, "name": _TOOL["name"],
                       "arguments": json.dumps({"q": nonce[:8]})},
                      {"type": "function_call_output", "call_id": call, "output": probe_prompt(nonce[::-1], 40)}]}


def messages_probe(model: str, nonce: str) -> dict:
    use = f"toolu_{nonce[:8]}"
    return {"model": model, "max_tokens": 1, "temperature": 0.0, "system": "kvgate parity probe",
            "tools": [{"name": _TOOL["name"], "description": _TOOL["description"], "input_schema": _TOOL["schema"]}],
            # "auto" needs a tool parser on the worker (--enable-auto-tool-choice): not the probe's business
            "tool_choice": {"type": "none"},
            "messages": [{"role": "user", "content": probe_prompt(nonce, 60)},
                         {"role": "assistant", "content": [{"type": "text", "text": "Looking it up."},
                                                           {"type": "tool_use", "id": use, "name": _TOOL["name"],
                                                            "input": {"q": nonce[:8]}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use,
                                                       "content": probe_prompt(nonce[::-1], 40)},
                                                      {"type": "text", "text": "Go on."}]}]}


def _responses_count(answer: dict) -> int | None:
    u = resp_api.usage_as_chat(answer.get("usage"))
    return u.get("prompt_tokens") if u else None


def _messages_count(answer: dict) -> int | None:
    u = msg_api.usage_as_chat(answer.get("usage"))
    return u.get("prompt_tokens") if u else None


def make_probes(state) -> dict:
    """The ``api_probes`` of the gateway's parity checker: kvgate's tokens come from its own tokenizers."""

    async def tokens(model: str, view: dict) -> list[int] | None:
        ns, _ = state.registry.namespace(model)
        w = next((w for w in state.registry.workers() if model in w.models), None)
        res = await state.tokenizers.tokenize(model, "chat", view, size=0, namespace=ns,
                                              worker_url=w.url if w else None)
        return res.tokens

    async def responses(model: str, nonce: str):
        body = responses_probe(model, nonce)
        ns, _ = state.registry.namespace(model)
        view = fit_template(state.tokenizers.for_model(model, ns), resp_api.chat_view(body))
        return "/v1/responses", body, await tokens(model, view), _responses_count

    async def messages(model: str, nonce: str):
        body = messages_probe(model, nonce)
        ns, _ = state.registry.namespace(model)
        local = state.tokenizers.for_model(model, ns)
        merge, effort = template_traits(local)
        view = fit_template(local, msg_api.chat_view(body, merge, effort))
        return "/v1/messages", body, await tokens(model, view), _messages_count

    return {RESPONSES: responses, MESSAGES: messages}
