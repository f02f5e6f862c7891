"""Parity check of one worker: does the gateway see a prompt the way the worker does?

Two things must agree for cache-aware routing to work, and either can silently drift (a different
tokenizer revision or chat template; an engine whose events do not reach the index, or whose blocks hash
differently):
1. tokenization: the gateway's token ids for a chat probe equal the worker's own (``POST /tokenize``);
2. events: after the worker prefills a probe prompt (a unique nonce, so its blocks are new), the index
   holds exactly the blocks the gateway computes for it, on that worker.

The probe is one ``/v1/completions`` call with ``max_tokens: 1`` sent straight to the worker (not through
the router), run only when an operator asks (``POST /admin/workers/{name}/parity``). The result is kept on
the worker and shown by ``GET /admin/workers``.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx

from indexer.hashing import routable_blocks, sequence_hashes

_FILLER = ("the gateway routes each request to the worker that holds the longest prefix of its cache "
           "blocks ")


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def check_worker(state, worker, *, timeout_s: float = 10.0, min_blocks: int = 4) -> dict:
    """Run both checks against ``worker``; returns the result (also stored as ``worker.parity``)."""
    t0 = time.time()
    model = worker.base_model()
    if model is None:
        raise ValueError(f"worker {worker.name} serves no model yet")
    ns, _ = state.registry.namespace(model)
    bs = worker.block_size or state.registry.block_size(model)
    nonce = uuid.uuid4().hex
    timeout = httpx.Timeout(state.settings.request_timeout_s, connect=state.settings.connect_timeout_s)
    client = state.client

    # 1. Tokenization of a chat request.
    text = f"kvgate parity probe {nonce}: " + _FILLER * 2
    chat = {"model": model, "messages": [{"role": "user", "content": text}]}
    mine = await state.tokenizers.tokenize(model, "chat", chat, size=len(text), namespace=ns,
                                           worker_url=worker.url)
    tok: dict = {"gateway_source": mine.source}
    try:
        r = await client.post(worker.url + "/tokenize", json={**chat, "add_generation_prompt": True},
                              timeout=timeout)
        r.raise_for_status()
        theirs = r.json().get("tokens")
    except (httpx.HTTPError, ValueError) as exc:
        theirs = None
        tok["error"] = f"worker /tokenize: {type(exc).__name__}: {exc}"
    if mine.tokens is not None and isinstance(theirs, list):
        tok.update(match=mine.tokens == theirs, gateway_tokens=len(mine.tokens), worker_tokens=len(theirs),
                   first_difference=_first_difference(mine.tokens, theirs))
    else:
        tok.setdefault("error", mine.error or "the gateway could not tokenize the probe")
        tok["match"] = False

    # 2. Events: the worker prefills a fresh prompt; the index must show its blocks on this worker.
    ev: dict = {}
    if not getattr(worker, "event_sources", None):
        ev = {"match": None, "skipped": "the worker publishes no KV events"}
    else:
        prompt_text = f"kvgate parity probe {nonce} " + _FILLER * (4 + 2 * min_blocks)
        tokens: list[int] | None = None
        try:
            r = await client.post(worker.url + "/tokenize", json={"model": model, "prompt": prompt_text},
                                  timeout=timeout)
            r.raise_for_status()
            tokens = r.json().get("tokens")
        except (httpx.HTTPError, ValueError) as exc:
            ev = {"match": False, "error": f"worker /tokenize: {type(exc).__name__}: {exc}"}
        if tokens:
            n = routable_blocks(len(tokens), bs)
            hashes = sequence_hashes(tokens, bs, max_blocks=n)
            try:
                r = await client.post(worker.url + "/v1/completions", timeout=timeout,
                                      json={"model": model, "prompt": tokens, "max_tokens": 1},
                                      headers={"x-request-id": f"kvgate-parity-{nonce}"})
                sent = r.status_code
            except httpx.HTTPError as exc:
                sent = f"{type(exc).__name__}: {exc}"
            held = 0
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    res = await state.index.lookup(ns, hashes, [worker.name])
                    m = res.match(worker.name)
                    held = max(m.local, m.gpu, m.cpu)
                except Exception as exc:  # index outage: report, do not fail the call
                    ev["index_error"] = f"{type(exc).__name__}: {exc}"
                if held >= len(hashes) or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.05)
            ev.update(match=held == len(hashes) and len(hashes) > 0, expected_blocks=len(hashes),
                      indexed_blocks=held, probe_status=sent)
    ok = bool(tok.get("match")) and ev.get("match") is not False
    result = {"ok": ok, "checked_at": t0, "seconds": round(time.time() - t0, 3), "block_size": bs,
              "tokenization": tok, "events": ev}
    worker.parity = result
    return result
