"""The simulated worker's HTTP surface matches what kvgate reads from a real vLLM server."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from bench.sim.fleet import FleetConfig, SimFleet
from bench.sim.timing import DEFAULT_TIMING
from bench.sim.tokenizer import ids_to_text
from router.vllm_metrics import parse_metrics


def sse(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            d = block[6:]
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


async def test_completion_reports_cached_tokens_on_repeat(fleet):
    url = fleet.workers[0].url
    prompt = list(range(100, 150))
    async with httpx.AsyncClient(timeout=30) as c:
        r1 = (await c.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 5})).json()
        r2 = (await c.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5},
                           headers={"X-Request-Id": "abc"})).json()
    assert r1["object"] == "text_completion" and r1["choices"][0]["finish_reason"] == "length"
    assert r1["usage"] == {"prompt_tokens": 50, "total_tokens": 55, "completion_tokens": 5,
                           "prompt_tokens_details": {"cached_tokens": 0}}
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 3 full blocks of 16
    assert r2["id"] == "cmpl-abc"
    assert len(r2["choices"][0]["text"].split()) == 5


async def test_streaming_shape_with_final_usage_chunk_and_done(fleet):
    url = fleet.workers[0].url
    body = {"prompt": ids_to_text(range(40)), "max_tokens": 10, "stream": True,
            "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url + "/v1/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 40
    assert usage["usage"]["completion_tokens"] == 10
    text = "".join(ch["choices"][0]["text"] for ch in chunks[:-2])
    assert len(text.split()) == 10
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-3])


async def test_chat_stream_starts_with_the_role_and_text_and_ids_share_blocks(fleet):
    url = fleet.workers[1].url
    msgs = [{"role": "user", "content": ids_to_text(range(200, 260))}]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url + "/v1/chat/completions",
                         json={"messages": msgs, "max_tokens": 3, "stream": True,
                               "stream_options": {"include_usage": True}})
        ids = (await c.post(url + "/tokenize", json={"messages": msgs})).json()["tokens"]
        # the same prompt as token ids now hits the blocks the chat request cached
        r2 = (await c.post(url + "/v1/completions", json={"prompt": ids + [1], "max_tokens": 1})).json()
    chunks = sse(r.text)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1] == "[DONE]" and chunks[-2]["usage"]["prompt_tokens"] == len(ids)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) // 16) * 16


async def test_tokenize_both_forms(fleet):
    url = fleet.workers[0].url
    async with httpx.AsyncClient(timeout=30) as c:
        a = (await c.post(url + "/tokenize", json={"prompt": "w5 w17 w3", "return_token_strs": True})).json()
        b = (await c.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "w5"}]})).json()
        d = (await c.post(url + "/detokenize", json={"tokens": [5, 17]})).json()
    assert a["tokens"] == [5, 17, 3] and a["count"] == 3 and a["token_strs"] == ["w5", "w17", "w3"]
    assert a["max_model_len"] > 0
    assert 5 in b["tokens"] and len(b["tokens"]) == 4  # <|user|> w5 <|end|> <|assistant|>
    assert d == {"prompt": "w5 w17"}


async def test_metrics_use_vllms_names_and_labels(fleet):
    url = fleet.workers[0].url
    async with httpx.AsyncClient(timeout=30) as c:
        await c.post(url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2})
        await c.post(url + "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2})
        text = (await c.get(url + "/metrics")).text
    def val(name):
        m = re.search(rf'^{re.escape(name)}\{{engine="0",model_name="sim-model"\}} (\S+)$', text, re.M)
        assert m, name
        return float(m.group(1))
    assert val("vllm:num_requests_running") == 0 and val("vllm:num_requests_waiting") == 0
    assert 0 <= val("vllm:kv_cache_usage_perc") <= 1
    assert val("vllm:prefix_cache_queries_total") == 80 and val("vllm:prefix_cache_hits_total") == 32
    info = re.search(r'^vllm:cache_config_info\{([^}]*)\} 1\.0$', text, re.M)
    assert info and 'block_size="16"' in info.group(1) and 'engine="0"' in info.group(1)
    # vLLM's per-request prefill histograms, as the gateway's calibration reads them: the second prompt
    # computed only its 8 tokens past the 2 cached blocks.
    load, block_size = parse_metrics(text)
    assert block_size == 16 and load.prefill_requests == 2 and load.prefill_tokens == 40 + 8
    assert load.prefill_seconds > 0
    # per step, as vLLM counts them: the prompt tokens computed and the steps; at finish: e2e and the
    # running phase, which bound the time outside the engine
    assert load.computed_tokens == 40 + 8 and load.steps >= 2
    assert load.e2e[1] == load.inference[1] == 2 and load.e2e[0] >= load.inference[0] > 0


async def test_metrics_read_from_the_kept_lines_equal_those_of_the_whole_page(fleet, monkeypatch):
    """The scrape keeps only the families the gateway reads, without buckets (router.vllm_metrics.wanted_metrics),
    before prometheus_client parses them: every figure must be what the whole page gives, for the server and
    for each engine of a data-parallel page, with other families that share a prefix beside them."""
    import dataclasses

    import router.vllm_metrics as reg

    url = fleet.workers[0].url
    async with httpx.AsyncClient(timeout=30) as c:
        for n in (40, 72):
            await c.post(url + "/v1/completions", json={"prompt": list(range(n)), "max_tokens": 3})
        text = (await c.get(url + "/metrics")).text
    # a second engine (a DP rank) and look-alike families
    lines = []
    for line in text.splitlines():
        lines.append(line)
        if 'engine="0"' in line:
            lines.append(line.replace('engine="0"', 'engine="1"'))
    text = "\n".join(lines) + "\n"
    text += ('# TYPE vllm:num_requests_running_extra gauge\nvllm:num_requests_running_extra{engine="0"} 9.0\n'
             'vllm:kv_cache_usage_perc_bucket{le="1"} 7.0\n')
    kept = reg.wanted_metrics(text)
    assert len(kept) < len(text) / 3 and "_bucket" not in kept and "# HELP" not in kept

    def figures(engine=None, page=text, **kw):
        load, bs = reg.parse_metrics(page, engine, **kw)
        return {k: v for k, v in dataclasses.asdict(load).items() if k != "updated_at"}, bs

    kept_figures = [figures(), figures("0"), figures("1")]
    # the scrape filters once for the server and its ranks, then parses the kept lines as they are
    assert kept_figures == [figures(e, kept, kept=True) for e in (None, "0", "1")]
    monkeypatch.setattr(reg, "wanted_metrics", lambda t: t)
    assert kept_figures == [figures(), figures("0"), figures("1")]
    assert kept_figures[0][0]["prefill_requests"] == 4 and kept_figures[1][0]["prefill_requests"] == 2


async def test_discovery_models_health(fleet):
    w = fleet.workers[0]
    async with httpx.AsyncClient(timeout=30) as c:
        src = (await c.get(w.url + "/kv_event_sources")).json()
        models = (await c.get(w.url + "/v1/models")).json()
        health = await c.get(w.url + "/health")
    assert src["0"]["endpoint"] == w.events_endpoint and src["0"]["replay_endpoint"] == w.replay_endpoint
    assert src["0"]["enable_kv_cache_events"] is True and src["0"]["topic"]
    assert models["data"][0]["id"] == "sim-model" and models["data"][0]["owned_by"] == "vllm"
    assert health.status_code == 200 and health.content == b""


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", {"model": "nope", "prompt": "w1"}, 404),
    ("/v1/completions", {"prompt": {"x": 1}}, 400),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": list(range(2000)), "max_tokens": 1}, 400),  # more than the 64-block pool
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/completions", {"prompt": "w1", "cache_salt": "a/b"}, 400),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400),
])
async def test_bad_requests_get_openai_errors(fleet, path, body, status):
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.workers[0].url + path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]


async def test_waiting_queue_and_concurrency_cap():
    timing = DEFAULT_TIMING.with_(time_scale=20, max_num_seqs=1)
    async with SimFleet(FleetConfig(workers=1, num_blocks=256, timing=timing)) as f:
        url = f.workers[0].url
        async with httpx.AsyncClient(timeout=60) as c:
            reqs = [asyncio.create_task(c.post(url + "/v1/completions",
                                               json={"prompt": list(range(k * 500, k * 500 + 400)), "max_tokens": 32}))
                    for k in range(3)]
            seen_waiting = 0
            while not all(t.done() for t in reqs):
                m = (await c.get(url + "/metrics")).text
                w = re.search(r'^vllm:num_requests_waiting\{[^}]*\} (\S+)', m, re.M)
                seen_waiting = max(seen_waiting, float(w.group(1)))
                await asyncio.sleep(0.005)
            assert all(t.result().status_code == 200 for t in reqs)
    assert seen_waiting >= 1


async def test_32_workers_in_one_process():
    async with SimFleet(FleetConfig(workers=32, num_blocks=64)) as f:
        async with httpx.AsyncClient(timeout=30) as c:
            rs = await asyncio.gather(*(c.get(w.url + "/health") for w in f.workers))
            srcs = await asyncio.gather(*(c.get(w.url + "/kv_event_sources") for w in f.workers))
    assert all(r.status_code == 200 for r in rs)
    assert len({s.json()["0"]["endpoint"] for s in srcs}) == 32


def test_tokenizer_dir_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    from bench.sim.tokenizer import SimTokenizer, save_model_dir

    d = save_model_dir(tmp_path / "m")
    hf = AutoTokenizer.from_pretrained(str(d))
    sim = SimTokenizer()
    text = "w1 w31999 w42"
    assert hf(text, add_special_tokens=True)["input_ids"] == sim.encode(text) == [1, 31999, 42]
    msgs = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w9"}]
    ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert list(ids) == sim.encode_chat(msgs)
    assert hf.decode([1, 2]) == "w1 w2"


async def test_a_long_text_is_tokenized_off_the_loop_in_both_forms(fleet):
    """One process hosts every simulated worker: /tokenize encodes a long text on a thread, as the
    completion routes do (vllm-router's cache_aware tokenizes each long text prompt on every worker, and
    the encode on the event loop stalled the whole simulated fleet). Same ids either way."""
    text = " ".join(f"w{i % 97}" for i in range(20_000))
    async with httpx.AsyncClient(timeout=120) as c:
        a = (await c.post(fleet.workers[0].url + "/tokenize", json={"prompt": text})).json()
        b = (await c.post(fleet.workers[0].url + "/tokenize",
                          json={"messages": [{"role": "user", "content": text}]})).json()
    assert a["count"] == 20_000 and a["tokens"][:3] == [0, 1, 2]
    assert b["count"] == 20_003 and b["tokens"][1:4] == [0, 1, 2]  # <|user|> ... <|end|> <|assistant|>


async def test_scale_out_routes_answer_403_as_vllm_without_enable_scale_out(fleet):
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(fleet.workers[0].url + "/v1/completions/render", json={"prompt": "w5"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
