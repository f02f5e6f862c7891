"""vLLM's own conversion of Responses and Messages bodies into the conversation its chat template sees.

Run with the vLLM environment's Python (``python vllm_reference.py`` reads a JSON list of
``{"api": "responses"|"messages", "body": {...}}`` (``history``: a Responses follow-up's stored
messages; ``merge_system``: Messages' inline-system rule) on stdin and writes one JSON list of results): it calls
vLLM 0.32's own functions (``construct_input_messages``, ``ResponsesRequest.build_chat_params``,
``construct_tool_dicts``, ``AnthropicServingMessages.to_chat_completion_request``, and
``parse_chat_messages`` with the "string" content format), so kvgate's re-implementation in
``router/apis`` is compared with the code it reproduces, case by case. Each result is
``{"messages", "tools", "kwargs"}`` or ``{"error": "..."}`` when vLLM rejects the body.
"""
import json
import sys
from types import SimpleNamespace


def _conversation(messages):
    from vllm.renderers.chat_utils import parse_chat_messages

    model_config = SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None)
    conv, _, _ = parse_chat_messages(messages, model_config, "string")
    return [dict(m) for m in conv]


def responses(body, merge_system, history=None):
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages, construct_tool_dicts

    req = ResponsesRequest.model_validate(body)
    messages = construct_input_messages(request_instructions=req.instructions, request_input=req.input,
                                        prev_msg=history)
    kwargs = req.build_chat_params(None, "auto").chat_template_kwargs
    return {"messages": _conversation(messages), "tools": construct_tool_dicts(req.tools, req.tool_choice),
            "kwargs": kwargs}


def messages(body, merge_system):
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    req = AnthropicMessagesRequest.model_validate(body)
    chat = AnthropicServingMessages.to_chat_completion_request(req, merge_inline_system=merge_system)
    params = chat.build_chat_params(None, "auto")
    tools = [t.model_dump() for t in chat.tools] if chat.tools else None
    kwargs = {k: v for k, v in params.chat_template_kwargs.items() if v is not None}
    return {"messages": _conversation(chat.messages), "tools": tools, "kwargs": kwargs}


def main():
    out = []
    for case in json.load(sys.stdin):
        try:
            if case["api"] == "responses":
                out.append(responses(case["body"], False, case.get("history")))
            else:
                out.append(messages(case["body"], case.get("merge_system", False)))
        except Exception as e:  # vLLM rejects the body: the comparison expects kvgate not to tokenize it
            out.append({"error": f"{type(e).__name__}: {e}"[:300]})
    json.dump(out, sys.stdout, default=str)


if __name__ == "__main__":
    main()
