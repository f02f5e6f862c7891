"""Tokenization is token-exact: local tokenizer == the worker's /tokenize, and the prefix cache ==
encoding the whole rendered text."""
from __future__ import annotations

import os

import httpx
import pytest

from indexer.hashing import sequence_hashes
from router.config import ModelConfig, Settings, TokenizerConfig
from router.local_tokenizer import LocalTokenizer
from router.tokenize import Tokenizers
from tests.gateway.conftest import BLOCK, MODEL

CONVERSATION = [
    {"role": "system", "content": "You are a cache block gateway."},
    {"role": "user", "content": "Hello the gateway, how are you?"},
    {"role": "assistant", "content": " Fine.\n\nThanks  for  asking"},
    {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
]

BODIES = [
    {"messages": CONVERSATION},
    {"messages": CONVERSATION, "add_generation_prompt": False},
    {"messages": CONVERSATION[:3], "continue_final_message": True, "add_generation_prompt": False},
    {"messages": CONVERSATION, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": CONVERSATION, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"messages": CONVERSATION, "add_special_tokens": True},
]


@pytest.fixture(scope="module")
def local(tokenizer_dir):
    return LocalTokenizer(tokenizer_dir, TokenizerConfig())


def test_prefix_cache_equals_whole_text(local):
    assert local.prefix is not None and local.fast_render
    turns = list(CONVERSATION) + [{"role": "user", "content": "A long document about caches. " * 300}]
    for i in range(6):
        turns = turns + [{"role": "assistant", "content": f"answer {i} " * (i + 1)},
                         {"role": "user", "content": f"question {i}\n with  spaces "}]
        body = {"messages": turns}
        text = local.render_chat(body)
        got = local.tokenize_chat(body)
        assert list(got.tokens) == local.encode(text, False)
        if i:
            # The earlier turns came from the cache: only the last cut's worth and the new turn were encoded.
            assert got.reused_bytes > 0.9 * len(text.encode()) and got.new_bytes < 1024


async def test_local_and_remote_tokenize_give_same_hashes(fleet, tokenizer_dir):
    fleet.add("a")
    settings = Settings(models={MODEL: ModelConfig(tokenizer=tokenizer_dir)})
    async with httpx.AsyncClient() as client:
        remote = Tokenizers(Settings(models={MODEL: ModelConfig()}), client)
        local = Tokenizers(settings, client)
        local.load()
        for body in BODIES + [{"prompt": "the cache block prefix " * 20},
                              {"prompt": "no bos here", "add_special_tokens": False},
                              # /tokenize takes no reasoning_effort: sent as the template's kwargs
                              {"messages": [{"role": "user", "content": "think"}], "reasoning_effort": "none"}]:
            kind = "chat" if "messages" in body else "completion"
            lt = await local.tokenize(MODEL, kind, dict(body, model=MODEL), size=10)
            rt = await remote.tokenize(MODEL, kind, dict(body, model=MODEL), size=10, worker_url=fleet.url(0))
            assert lt.source == "local" and rt.source == "remote"
            assert list(lt.tokens) == rt.tokens, body
            assert sequence_hashes(lt.tokens, BLOCK) == sequence_hashes(rt.tokens, BLOCK)
        # A large prompt takes the thread pool; same result.
        big = {"model": MODEL, "messages": [{"role": "user", "content": "the worker " * 3000}]}
        a = await local.tokenize(MODEL, "chat", big, size=10**6)
        b = await remote.tokenize(MODEL, "chat", big, size=10**6, worker_url=fleet.url(0))
        assert list(a.tokens) == b.tokens and len(a.tokens) > 3000
        local.close()
        remote.close()


async def test_token_ids_and_untokenizable(tokenizer_dir):
    t = Tokenizers(Settings(models={MODEL: ModelConfig(tokenizer=tokenizer_dir)}))
    t.load()
    assert (await t.tokenize(MODEL, "completion", {"prompt": [5, 6, 7]}, size=1)).tokens == [5, 6, 7]
    assert (await t.tokenize(MODEL, "completion", {"prompt": [[1, 2], [3]]}, size=1)).tokens == [1, 2]
    img = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    r = await t.tokenize(MODEL, "chat", img, size=1)
    assert r.tokens is None and r.error
    # No tokenizer and no worker: routed on load only, not an error.
    r = await Tokenizers(Settings()).tokenize("m", "chat", {"messages": []}, size=1)
    assert r.tokens is None
    t.close()


def _document(seed: int, n_words: int) -> str:
    import random

    rng = random.Random(seed)
    words = ["cache", "block", "prefix", "worker", "gateway", "tier", "storage", "token", "Lustre", "12", "x9"]
    return " ".join(rng.choice(words) + ("\n" if rng.random() < 0.05 else "") for _ in range(n_words))


async def test_a_long_new_tail_no_cached_prefix_reaches_is_not_tokenized(tokenizer_dir):
    """Routing needs a prompt's ids only as far as some worker's (or G4's, or a pending send's) prefix can
    reach: past that, the text is estimated, not encoded. ``reach`` stands for the index here: a plain
    function saying how many leading blocks some holder has (the gateway test below uses the real one)."""
    t = Tokenizers(Settings(models={MODEL: ModelConfig(tokenizer=tokenizer_dir)}))
    t.load()
    local = t.for_model(MODEL)
    text = _document(1, 20_000)  # ~150 KB, never seen
    whole = local.encode(text, True)
    whole_hashes = sequence_hashes(whole, BLOCK)
    asked: list[int] = []

    def holder(blocks: int):
        async def reach(hashes):
            asked.append(len(hashes))
            assert hashes == whole_hashes[:len(hashes)], "the start's blocks are the whole prompt's"
            return min(blocks, len(hashes))
        return reach

    stage = t.settings.tokenizer.defer_tail_bytes
    body = {"prompt": text}
    res = await t.tokenize(MODEL, "completion", body, size=len(text), hashing=(BLOCK, None, None), reach=holder(0))
    # nobody holds even its first block: one stage encoded, the rest estimated
    assert len(asked) == 1 and res.new_bytes < stage + 1024
    assert list(res.tokens) == whole[:len(res.tokens)]
    assert 0.8 < res.total_tokens / len(whole) < 1.25
    assert res.block_hashes(BLOCK, None, None) == whole_hashes[:len(res.tokens) // BLOCK]
    assert t.cache_stats()[MODEL]["deferred_bytes"] == len(text.encode()) - res.new_bytes
    # Again, still held nowhere: the known start is not extended (nothing encoded).
    first = len(res.tokens)
    asked.clear()
    res = await t.tokenize(MODEL, "completion", body, size=len(text), hashing=(BLOCK, None, None), reach=holder(0))
    assert len(asked) == 1 and res.new_bytes == 0 and len(res.tokens) == first and res.total_tokens
    # A holder of the first 300 blocks: encoded in stages until past them, no further.
    asked.clear()
    res = await t.tokenize(MODEL, "completion", body, size=len(text), hashing=(BLOCK, None, None), reach=holder(300))
    n = len(res.block_hashes(BLOCK, None, None))
    assert res.total_tokens is not None and 300 < n < len(whole_hashes) and asked[-1] == n
    assert res.reused_bytes > 0, "the first request's start came from the prefix cache"
    # A holder of everything: the whole prompt, exact, its length known.
    res = await t.tokenize(MODEL, "completion", body, size=len(text), hashing=(BLOCK, None, None),
                           reach=holder(10**9))
    assert res.total_tokens is None and list(res.tokens) == whole
    # Without a reach (explain's probes, the tokenizer check), or a short text: the whole prompt.
    res = await t.tokenize(MODEL, "completion", {"prompt": text + " more"}, size=len(text), hashing=(BLOCK, None, None))
    assert res.total_tokens is None and list(res.tokens) == local.encode(text + " more", True)
    t.close()


@pytest.mark.parametrize("offload", [4096, 0], ids=["compared-on-loop", "compared-on-pool"])
async def test_a_prompt_sharing_a_deferred_prompt_in_flight_is_encoded_as_far_as_they_share(tokenizer_dir, offload):
    """A deferred prompt (its tail never encoded) was sent to worker "w" and is still being prefilled: a
    second question over the same document is encoded up to the last safe cut inside the bytes the two
    share, and ``shared_ids`` says so; "w" will hold exactly the blocks the two whole encodings have in
    common. ``sent`` stands for router/pending.py here (the gateway test in test_pending.py uses it). The
    comparison runs on the event loop within ``offload_chars`` bytes, on the pool past them: the same ids."""
    t = Tokenizers(Settings(models={MODEL: ModelConfig(tokenizer=tokenizer_dir)},
                            tokenizer=TokenizerConfig(offload_chars=offload)))
    t.load()
    local = t.for_model(MODEL)
    pooled: list[str] = []
    off_loop = t._off_loop

    async def spy(fn, *args):
        pooled.append(getattr(fn, "__name__", ""))
        return await off_loop(fn, *args)

    t._off_loop = spy
    doc = _document(2, 8_000)  # ~60 KB, never seen
    first, second = doc + "\nQuestion: what is kept?", doc + "\nQuestion: Which tier?"

    async def nobody(hashes):
        return 0

    hashing = (BLOCK, None, None)
    r1 = await t.tokenize(MODEL, "completion", {"prompt": first}, size=1, hashing=hashing, reach=nobody)
    assert r1.total_tokens is not None and r1.text == first.encode()  # deferred: its start only
    pre = local.wrap[0]
    seen: list[tuple] = []

    other = first.encode()[:1000] + b" and then another text"  # sent to "v": shares a 1000-byte start

    def sent(data, ids_before):
        seen.append(ids_before)
        return {"w": (len(os.path.commonprefix([data, r1.text])), r1.text),
                "v": (len(os.path.commonprefix([data, other])), other)}

    r2 = await t.tokenize(MODEL, "completion", {"prompt": second}, size=1, hashing=hashing, reach=nobody,
                          sent=sent)
    assert seen == [pre]
    a, b = local.encode(first, True), local.encode(second, True)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    # encoded as far as "w" holds, then the short rest: the whole prompt
    assert r2.total_tokens is None and r2.new_bytes > len(doc) / 2 and list(r2.tokens) == b
    assert len(pre) + r2.shared_ids["w"] == common  # "w" will hold exactly the blocks of these ids
    c = local.encode(other.decode(), True)  # "v" was sent less: exactly the ids the two have in common
    assert len(pre) + r2.shared_ids["v"] == next(i for i, (x, y) in enumerate(zip(b, c)) if x != y)
    # A long new tail after the shared part: deferred just past it (nobody indexes more).
    third = doc + "\nQuestion: Which tier?\n" + _document(3, 2_000)
    r3 = await t.tokenize(MODEL, "completion", {"prompt": third}, size=1, hashing=hashing, reach=nobody,
                          sent=sent)
    assert r3.total_tokens is not None and r3.text == third.encode()
    assert r3.new_bytes < 4096 and len(pre) + r3.shared_ids["w"] == common <= len(r3.tokens) < common + 200
    assert list(r3.tokens) == local.encode(third, True)[:len(r3.tokens)]
    # Once something indexes the document, the stages go on past the shared part as before.
    r4 = await t.tokenize(MODEL, "completion", {"prompt": third}, size=1, hashing=hashing, reach=_all, sent=sent)
    assert r4.total_tokens is None and list(r4.tokens) == local.encode(third, True)
    assert len(pre) + r4.shared_ids["w"] == common
    assert ("_shared_ids" in pooled) == (offload == 0)
    t.close()


async def _all(hashes):
    return len(hashes)


def test_tools_are_rendered_as_vllm_dumps_them(tokenizer_dir):
    """vLLM renders ``tools`` from its request models (``tool.model_dump()``): ``type``, then the function's
    ``name``, ``description`` and ``parameters`` in that order, null when absent, unknown keys dropped.
    The client's own dicts rendered other text for a tool without a description or with its keys in
    another order, and every block from the tools on missed vLLM's. (vLLM's models are not importable
    here: the dump below is what vLLM 0.32's ChatCompletionToolsParam gives for these tools.)"""
    lt = LocalTokenizer(tokenizer_dir, TokenizerConfig())
    msgs = [{"role": "system", "content": "You are a helpful agent. " * 20},
            {"role": "user", "content": "What is the weather in Paris?"}]
    client_tools = [{"function": {"parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                                  "name": "get_weather", "x-extra": 1}, "type": "function"}]
    vllm_dump = [{"type": "function", "function": {
        "name": "get_weather", "description": None,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    theirs = lt.hf.apply_chat_template(msgs, tools=vllm_dump, add_generation_prompt=True, tokenize=False)
    assert lt.render_chat({"messages": msgs, "tools": client_tools}) == theirs
    assert "null" in theirs or "None" in theirs  # the template prints the tool: the dump's shape shows


def test_empty_text_parts_are_left_out_as_vllm_leaves_them_out(local):
    """vLLM's "string" content format keeps only non-empty parts (``if parse_res:`` in its
    ``_parse_chat_message_content_parts``): an empty text part adds no line. kvgate joined it, one
    newline more, and the prompt's tokens parted from vLLM's from there (the cache after it never matched).
    The expected contents are what vLLM 0.32 renders for these messages (tests/support/vllm_reference.py
    for Responses; ChatCompletionRequest then parse_chat_messages for chat)."""
    from router.apis import responses as resp_api
    from router.local_tokenizer import normalize_messages

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, "", {"type": "text", "text": "b"}]
    assert normalize_messages([{"role": "user", "content": parts}]) == [{"role": "user", "content": "a\nb"}]
    assert normalize_messages([{"role": "user", "content": parts[1:]}]) == [{"role": "user", "content": "b"}]
    texts = [{"type": "input_text", "text": t} for t in ("a", "", "b")]
    body = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": texts}]}
    assert resp_api.chat_view(body)["messages"] == [{"role": "user", "content": "a\nb"}]
    body["input"][0]["content"] = body["input"][0]["content"][1:]
    assert resp_api.chat_view(body)["messages"] == [{"role": "user", "content": "b"}]
    rendered = local.render_chat({"messages": [{"role": "user", "content": parts}]})
    assert rendered == local.render_chat({"messages": [{"role": "user", "content": "a\nb"}]})


@pytest.mark.parametrize("path,body,key", [
    ("/v1/completions", {"prompt": "the cache block prefix number is long " * 40}, "add_special_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the cache block prefix " * 40}]},
     "add_generation_prompt"),
])
async def test_request_flags_are_read_as_vllm_reads_them(fleet, start_gateway, path, body, key):
    """vLLM reads its boolean fields in pydantic's lax mode: the string "false" is False. ``bool("false")``
    is True: a BOS token or a generation prompt vLLM did not render, and every block differed. A value
    vLLM refuses is routed on load."""
    fleet.add("a")
    gw = start_gateway(fleet)

    def plan(b):
        return gw.call(gw.state.router.plan(MODEL, {"model": MODEL, **b}, {}, path))

    want = plan({**body, key: False})
    got = plan({**body, key: "false"})
    assert got.hashes and (got.num_tokens, got.hashes) == (want.num_tokens, want.hashes)
    assert plan({**body, key: "perhaps"}).tokenize_error == f"{key}: not a boolean vLLM accepts"


async def test_a_truncated_prompt_is_routed_on_load(fleet, start_gateway):
    """vLLM prefills only the last ``truncate_prompt_tokens`` ids: the whole prompt's blocks are neither
    what it computes nor what it caches. Hashing them matched nothing and recorded a pending claim on
    blocks never computed; the request is routed on load and the decision says why."""
    fleet.add("a")
    gw = start_gateway(fleet)
    ids = list(range(10, 10 + 20 * BLOCK))
    d = gw.call(gw.state.router.plan(MODEL, {"model": MODEL, "prompt": ids, "truncate_prompt_tokens": 100},
                                     {}, "/v1/completions"))
    assert d.hashes == [] and "truncate_prompt_tokens" in d.tokenize_error
    d = gw.call(gw.state.router.plan(MODEL, {"model": MODEL, "prompt": ids}, {}, "/v1/completions"))
    assert len(d.hashes) == 19


async def test_a_chat_with_documents_is_not_tokenized_by_a_workers_tokenize(fleet, start_gateway):
    """Without a local tokenizer the chat's ids come from a worker's /tokenize, which takes no documents:
    they were the ids of another prompt (the documents left out), routed on and recorded as sent."""
    fleet.add("a")
    gw = start_gateway(fleet, local_tokenizer=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What does the manual say?"}],
            "documents": [{"title": "Manual", "text": "the cache block prefix number is long " * 30}]}
    d = gw.call(gw.state.router.plan(MODEL, body, {}, "/v1/chat/completions"))
    assert d.hashes == [] and "documents" in d.tokenize_error


# a reasoning model's template: it reads the effort and the thinking switch, as gpt-oss's and Qwen3's do
THINKING = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
            "{% if enable_thinking is defined %}thinking={{ enable_thinking }}\n{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("fast", [True, False])
def test_the_template_gets_the_reasoning_effort_as_vllm_gives_it(tokenizer_dir, fast):
    """vLLM 0.32 renders a chat completion with its ``reasoning_effort`` as a template variable, and
    ``enable_thinking`` = effort != "none" unless the client's ``chat_template_kwargs`` set it
    (``ChatCompletionRequest.build_chat_params``); the request's own fields override the client's kwargs
    where set (``merge_kwargs``). kvgate rendered without them: for a reasoning model every block after
    the conversation's start differed from vLLM's. Both render paths (direct and apply_chat_template)."""
    from router.local_tokenizer import template_kwargs

    lt = LocalTokenizer(tokenizer_dir, TokenizerConfig())
    lt.fast_render = fast and lt.fast_render
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]

    def render(**kw):
        return lt.render_chat({"messages": msgs, "chat_template": THINKING, **kw})

    assert render() == "<|user|>Why is the sky blue?\n<|assistant|>"
    assert render(reasoning_effort="low") == "<|user|>Why is the sky blue?\neffort=low\nthinking=True\n<|assistant|>"
    assert render(reasoning_effort="none").endswith("effort=none\nthinking=False\n<|assistant|>")
    assert render(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}).endswith(
        "effort=high\nthinking=False\n<|assistant|>")  # the client's switch stays
    assert render(chat_template_kwargs={"reasoning_effort": "medium"}).endswith("effort=medium\n<|assistant|>")
    # the request's field over the client's kwargs; a generation prompt given in both: the field's
    assert render(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).count("effort=low") == 1
    assert not render(add_generation_prompt=False, chat_template_kwargs={"add_generation_prompt": True}).endswith(
        "<|assistant|>")
    assert template_kwargs({"reasoning_effort": None, "documents": None}) == {
        "add_generation_prompt": True, "continue_final_message": False}
