"""kvgate in front of two real vLLM servers: every routing claim checked against vLLM's own numbers
(``usage.prompt_tokens_details.cached_tokens``, its KV events, its replay buffer).

The servers and Redis are shared by the session; each test starts its own gateway (fresh Redis index)
and uses prompts nobody sent before, so earlier tests' cache contents cannot make a result.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from pathlib import Path

import httpx
import pytest

from bench.chat_workload import TextMaker, make_sessions, previous_context_ratio, run_sessions
from indexer.hashing import sequence_hashes
from tests.e2e.conftest import E2E_MODEL_NAME as MODEL
from tests.e2e.conftest import e2e_report
from tests.support.vllm_server import stored_chains

pytestmark = pytest.mark.vllm

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def texts(tiny_model_dir) -> TextMaker:
    return TextMaker(tiny_model_dir, seed=int(time.time()))


def _post(url: str, path: str, body: dict) -> httpx.Response:
    r = httpx.post(url + path, json=body, timeout=300.0)
    assert r.status_code == 200, r.text
    return r


def _chat(text: str, max_tokens: int = 1) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def _cached(r: httpx.Response) -> int:
    return int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _tag() -> str:
    return uuid.uuid4().hex[:12]


# 1 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_token_exact_identity(kvgate, texts, path):
    """kvgate's block hashes of a prompt equal the ones derived from the serving worker's BlockStored
    events for it -- through the gateway's own index, and recomputed here from the raw events."""
    gw = kvgate("kv")
    text = f"{_tag()} " + texts.text(400)
    body = _chat(text) if path == CHAT else {"model": MODEL, "prompt": text, "max_tokens": 1}
    plan = gw.plan(body, path)
    assert len(plan.hashes) >= 10

    r = _post(gw.url, path, body)
    worker = r.headers["x-kvgate-worker"]
    assert r.json()["usage"]["prompt_tokens"] == plan.num_tokens  # same tokens as vLLM's

    # The gateway's index, fed by the worker's events, holds exactly kvgate's hashes of the prompt.
    assert gw.wait_held(plan.hashes, worker, lambda n: n == len(plan.hashes)) == len(plan.hashes)

    # Independently: the worker's buffered events for this prompt, re-hashed from their token ids.
    bs = plan.block_size
    chain = next(
        c
        for c in stored_chains(gw.vllm[worker])
        if sequence_hashes(c[0]["token_ids"][:bs], bs)[0] == plan.hashes[0]
    )
    tokens = [t for ev in chain for t in ev["token_ids"]]
    assert all(ev["block_size"] == bs for ev in chain)
    assert sequence_hashes(tokens, bs)[: len(plan.hashes)] == plan.hashes


# 2 ------------------------------------------------------------------------------------------------------
def _two_turns(gw, texts) -> tuple[httpx.Response, httpx.Response]:
    p = f"{_tag()} " + texts.text(1100)
    first = _post(gw.url, CHAT, _chat(p, max_tokens=8))
    answer = first.json()["choices"][0]["message"]["content"]
    body = {
        **_chat(p),
        "messages": [
            {"role": "user", "content": p},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And now a new question about it?"},
        ],
    }
    # Let the first turn's events reach the index before the follow-up is routed.
    gw.wait_held(gw.plan(_chat(p)).hashes, first.headers["x-kvgate-worker"], lambda n: n > 0)
    return first, _post(gw.url, CHAT, body)


def test_routing_pays(kvgate, texts):
    """P (>= 1,000 tokens), then P + a new question: same worker, and vLLM serves >= 90% of P's full
    blocks from its cache."""
    gw = kvgate("kv")
    first, second = _two_turns(gw, texts)
    p_tokens = first.json()["usage"]["prompt_tokens"]
    assert p_tokens >= 1000
    full = p_tokens // 32 * 32
    assert second.headers["x-kvgate-worker"] == first.headers["x-kvgate-worker"]
    assert _cached(second) >= 0.9 * full
    decision = gw.state.decisions.get(second.headers["x-request-id"])
    assert decision is not None and decision.predicted_cached_tokens >= 0.9 * full
    e2e_report(
        f"routing pays (kv): P={p_tokens} tokens, follow-up cached {_cached(second)} tokens "
        f"on {second.headers['x-kvgate-worker']}"
    )


def test_round_robin_misses(kvgate, texts):
    """The same sequence under round_robin lands on the other worker, which has none of P."""
    gw = kvgate("round_robin")
    first, second = _two_turns(gw, texts)
    full = first.json()["usage"]["prompt_tokens"] // 32 * 32
    assert second.headers["x-kvgate-worker"] != first.headers["x-kvgate-worker"]
    assert _cached(second) < 0.1 * full
    e2e_report(
        f"routing pays (round_robin): follow-up cached {_cached(second)} of {full} tokens "
        f"({first.headers['x-kvgate-worker']} -> {second.headers['x-kvgate-worker']})"
    )


# 3 ------------------------------------------------------------------------------------------------------
def test_multi_turn_sessions(kvgate, tiny_model_dir):
    """6 concurrent sessions x 4 turns: every turn after the first is served with cached_tokens >= 80% of
    its previous context under kv; round_robin's figure is reported beside it.

    A user reads an answer before typing the next turn; here each session instead waits, before its next
    turn, until the gateway's index has the previous prompt (the time its events take through ZMQ and
    Redis on this loaded machine), so the figure measures routing, not that race."""
    figures = {}
    for policy in ("kv", "round_robin"):
        gw = kvgate(policy)

        async def think(messages, last, gw=gw):
            body = {"model": MODEL, "messages": messages}
            hashes = await asyncio.to_thread(lambda: gw.plan(body).hashes)
            await asyncio.to_thread(gw.wait_held, hashes, last.worker, lambda n: n == len(hashes), 15.0)

        sessions = make_sessions(
            tiny_model_dir, 6, 4, first_tokens=500, turn_tokens=200, seed=1, tag=f"{policy}-{_tag()}-"
        )
        results = asyncio.run(
            run_sessions(gw.url, MODEL, sessions, max_tokens=8, stagger_s=0.2, before_turn=think)
        )
        assert len(results) == 24 and all(r.prompt_tokens > 0 for r in results)
        ratios = previous_context_ratio(results)
        figures[policy] = ratios
        if policy == "kv":
            assert min(ratios) >= 0.8, _turns_table(results, gw)
        gw.stop()
    kv, rr = figures["kv"], figures["round_robin"]
    line = (
        f"multi-turn 6x4: cached/previous context  kv: min {min(kv):.0%} mean {sum(kv) / len(kv):.0%}  |  "
        f"round_robin: min {min(rr):.0%} mean {sum(rr) / len(rr):.0%}"
    )
    print(line)
    e2e_report(line)


def _turns_table(results, gw) -> str:
    """Per turn: where it went, what vLLM served from cache, and what the gateway predicted per worker (cached
    tokens / TTFT, and the prefix the index showed [gpu blocks, eviction model, blocks it expected evicted,
    the free KV tokens]: enough to tell a lost index from a pessimistic eviction model when it fails)."""
    lines = []
    for r in sorted(results, key=lambda r: (r.session, r.turn)):
        d = gw.state.decisions.get(r.request_id) if r.request_id else None
        pred = (
            " ".join(f"{c.worker}:{c.cached_tokens}/{c.predicted_ttft_ms:.0f}ms"
                     f"[{c.gpu_blocks} {c.eviction_model or '-'} -{c.evicted_blocks} free {c.kv_free_tokens}]"
                     for c in d.candidates)
            if d
            else "?"
        )
        lines.append(
            f"{r.session} turn {r.turn}: {r.worker} prompt {r.prompt_tokens} cached {r.cached_tokens} "
            f"ttft {r.ttft_s:.2f}s  predicted {pred}"
        )
    return "\n".join(lines)


# 4 ------------------------------------------------------------------------------------------------------
def test_eviction_drops_entries_and_predictions(kvgate, vllm_servers, texts):
    """Filling one worker's small KV cache evicts P; BlockRemoved drops P from kvgate's index, the gateway
    stops predicting a hit there, and vLLM agrees (P is a miss again)."""
    gw = kvgate("kv")
    server = vllm_servers[0]
    p = f"{_tag()} " + texts.text(600)
    body = {"model": MODEL, "prompt": p, "max_tokens": 1}
    _post(server.url, COMPLETIONS, body)  # straight to the worker: the index learns from its events
    hashes = gw.plan(body, COMPLETIONS).hashes
    assert gw.wait_held(hashes, server.name, lambda n: n == len(hashes)) == len(hashes)
    assert gw.plan(body, COMPLETIONS).candidate(server.name).cached_tokens == len(hashes) * 32
    removed_before = gw.state.ingestor.status(server.name)["blocks_removed"]

    # More new tokens than the cache holds (E2E_GPU_BLOCKS blocks): LRU evicts P.
    from tests.e2e.conftest import E2E_GPU_BLOCKS

    for _ in range(E2E_GPU_BLOCKS * 32 // 3000 + 2):
        _post(
            server.url,
            COMPLETIONS,
            {"model": MODEL, "prompt": f"{_tag()} " + texts.text(3000), "max_tokens": 1},
        )

    assert gw.wait_held(hashes, server.name, lambda n: n == 0) == 0
    assert gw.state.ingestor.status(server.name)["blocks_removed"] > removed_before
    assert gw.plan(body, COMPLETIONS).candidate(server.name).cached_tokens == 0
    assert _cached(_post(server.url, COMPLETIONS, body)) == 0  # vLLM: evicted indeed


# 5 ------------------------------------------------------------------------------------------------------
def test_restart_drops_entries_and_routes_after(kvgate, vllm_servers, texts):
    """Restarting a server: kvgate drops its entries (no predicted hit on a cache that is gone), and once
    the server is back its new blocks are indexed and routed to."""
    gw = kvgate("kv")
    server = vllm_servers[1]
    p = f"{_tag()} " + texts.text(600)
    body = {"model": MODEL, "prompt": p, "max_tokens": 1}
    _post(server.url, COMPLETIONS, body)
    hashes = gw.plan(body, COMPLETIONS).hashes
    assert gw.wait_held(hashes, server.name, lambda n: n == len(hashes)) == len(hashes)

    t_restart = time.time()
    server.restart()
    worker = gw.state.registry.get(server.name)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        worker.healthy and worker.parity and worker.parity["checked_at"] > t_restart
    ):
        time.sleep(0.2)
    assert worker.healthy and worker.parity["status"] == "ok"
    status = gw.state.ingestor.status(server.name)
    assert worker.restarts >= 1 or status["resets"] >= 1
    assert gw.held(hashes, server.name) == 0
    assert gw.plan(body, COMPLETIONS).candidate(server.name).cached_tokens == 0

    # Back in service: a prompt it now holds is routed to it and served from its cache.
    q = f"{_tag()} " + texts.text(1100)
    _post(server.url, CHAT, _chat(q))
    q_hashes = gw.plan(_chat(q)).hashes
    assert gw.wait_held(q_hashes, server.name, lambda n: n == len(q_hashes)) == len(q_hashes)
    r = _post(gw.url, CHAT, _chat(q + " One more question?"))
    assert r.headers["x-kvgate-worker"] == server.name
    assert _cached(r) >= 0.9 * (len(q_hashes) * 32)


# 6 ------------------------------------------------------------------------------------------------------
def _metric(gw, name: str, worker: str) -> float | None:
    text = httpx.get(gw.url + "/metrics", timeout=30.0).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_parity_check_passes_on_matching_workers(kvgate, vllm_servers):
    gw = kvgate("kv")
    for s in vllm_servers:
        w = gw.state.registry.get(s.name)
        assert w.parity["status"] == "ok" and not w.cache_blind, w.parity
        assert w.parity["matched_blocks"] == w.parity["expected_blocks"] > 0
        assert _metric(gw, "kvgate_worker_cache_blind", s.name) == 0.0
        # the chat probe (system prompt, content list, tool call, tool message): kvgate's token ids are
        # vLLM's own /tokenize ids
        chat = w.parity["chat"]
        assert chat["status"] == "ok" and not w.chat_cache_blind, chat
        assert chat["kvgate_tokens"] == chat["worker_tokens"] > 30
        assert _metric(gw, "kvgate_worker_chat_cache_blind", s.name) == 0.0


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> str:
    """A different byte-level BPE (another vocabulary size) with the same chat template."""
    from bench.tiny_model import build_tokenizer

    out = tmp_path_factory.mktemp("other-tokenizer")
    build_tokenizer(out, vocab_size=3000)
    return str(out)


@pytest.fixture(scope="module")
def other_chat_template(tiny_model_dir, tmp_path_factory) -> str:
    """The workers' own tokenizer with another chat template (a newline after each role marker): the
    completion tokens are the workers', the chat tokens are not."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("other-chat-template")
    shutil.copy(Path(tiny_model_dir) / "tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((Path(tiny_model_dir) / "tokenizer_config.json").read_text())
    role_end = "'|>' + message['content']"
    assert role_end in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(role_end, "'|>\\n' + message['content']")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def test_chat_parity_catches_another_chat_template_against_real_vllm(kvgate, vllm_servers,
                                                                     other_chat_template):
    """kvgate renders chat with another template than vLLM's: the completions probe still matches (same
    tokenizer, same block keys), the chat probe does not, and the admin view says where the ids part."""
    gw = kvgate("kv", tokenizer=other_chat_template)
    for s in vllm_servers:
        w = gw.state.registry.get(s.name)
        assert w.parity["status"] == "ok" and not w.cache_blind, w.parity
        chat = w.parity["chat"]
        assert chat["status"] == "cache-blind" and w.chat_cache_blind and w.blind_for("chat"), chat
        assert not w.blind_for("completion")
        first = chat["first_mismatch"]
        # BOS, then "<|system|>": the templates part right after the first role marker
        assert first["index"] == 2 and first["kvgate_text"].startswith("\n"), first
        assert _metric(gw, "kvgate_worker_chat_cache_blind", s.name) == 1.0
        assert _metric(gw, "kvgate_worker_cache_blind", s.name) == 0.0


@pytest.mark.parametrize("mismatch", ["tokenizer", "block_size"])
def test_parity_mismatch_marks_worker_cache_blind(
    kvgate, vllm_servers, texts, other_tokenizer, caplog, mismatch
):
    """kvgate configured with another tokenizer, or another block size, than the workers: the probe's
    hashes never come back, so each worker is marked cache-blind (log line, metric) and routing ignores
    its index entries instead of trusting wrong keys."""
    caplog.set_level(logging.WARNING, logger="kvgate.parity")
    kw = {"tokenizer": other_tokenizer} if mismatch == "tokenizer" else {"block_size": 16}
    gw = kvgate("kv", **kw)
    for s in vllm_servers:
        w = gw.state.registry.get(s.name)
        assert w.parity["status"] == "cache-blind" and w.cache_blind, w.parity
        assert w.parity["matched_blocks"] == 0
        assert _metric(gw, "kvgate_worker_cache_blind", s.name) == 1.0
        assert any(s.name in rec.getMessage() and "CACHE-BLIND" in rec.getMessage() for rec in caplog.records)
    if mismatch == "tokenizer":
        assert "different tokenizer" in gw.state.registry.get(vllm_servers[0].name).parity["reason"]
    # A prompt the gateway sent to a worker is in that worker's cache, yet no hit is predicted there.
    body = _chat(f"{_tag()} " + texts.text(300))
    r = _post(gw.url, CHAT, body)
    worker = r.headers["x-kvgate-worker"]
    time.sleep(1.0)
    assert gw.plan(body).candidate(worker).cached_tokens == 0
