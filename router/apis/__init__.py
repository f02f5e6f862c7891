"""The generation APIs vLLM serves besides chat and completions: the OpenAI Responses API
(``responses.py``) and Anthropic Messages (``messages.py``). Each turns its body into the chat form vLLM
renders, so the router tokenizes and routes it like chat; ``routes.py`` mounts them and ``hooks.py``
reads their responses (usage, response ids) and keeps their error shapes.
"""
from __future__ import annotations

import weakref

RESPONSES = "responses"
MESSAGES = "messages"
APIS = (RESPONSES, MESSAGES)

_templates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def api_blind(worker, api: str | None) -> bool:
    """The worker's parity probe for ``api`` failed: routing counts no cached blocks on it for that API."""
    if api is None or not worker.parity:
        return False
    res = (worker.parity.get("apis") or {}).get(api)
    return bool(res and res.get("status") == "cache-blind")


def template_traits(local) -> tuple[bool, bool]:
    """(merge inline system messages, template reads the reasoning effort) for a local tokenizer, as
    vLLM's Messages serving decides them from the templates it would apply (with and without tools)."""
    if local is None:
        return False, True
    cached = _templates.get(local)
    if cached is None:
        from router.apis.messages import merge_inline_system

        templates = []
        for tools in (None, []):
            try:
                templates.append(local.hf.get_chat_template(None, tools))
            except Exception:
                templates.append(None)
        merge = any(merge_inline_system(t) for t in templates)
        effort = any(t and ("reasoning_effort" in t or "enable_thinking" in t) for t in templates)
        cached = _templates[local] = (merge, effort)
    return cached


def fit_template(local, view: dict) -> dict:
    """vLLM's last step before the template (``safe_apply_chat_template``): a template that never names
    the ``developer`` role gets developer messages as system ones (without their ``tools``), and then
    all system messages merged into one leading message (joined by blank lines)."""
    msgs = view["messages"]
    if local is None or not any(m.get("role") == "developer" for m in msgs):
        return view
    try:
        template = local.hf.get_chat_template(view.get("chat_template"), view.get("tools"))
    except Exception:
        return view
    if '"developer"' in template or "'developer'" in template:
        return view
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m.get("role") == "developer"
                 else m for m in msgs]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems and (systems[0] > 0 or len(systems) > 1):
        merged = {"role": "system", "content": "\n\n".join(converted[i]["content"] for i in systems
                                                           if converted[i].get("content"))}
        converted = [merged] + [m for m in converted if m["role"] != "system"]
    return {**view, "messages": converted}
