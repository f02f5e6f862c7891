"""Helpers shared by the real-vLLM G4 tests: a tiny-model server with kvgate's connector, requests, the
store of a G4 directory."""

from __future__ import annotations

import glob
import os
import random
import time

import httpx

from bench.vllm_server import VllmServer
from cache_tier.store import G4Store, store_for_dir

BLOCK = 32
MODEL = "tiny"  # the served model name


def g4_server(model, g4: str, name: str, **kw) -> VllmServer:
    """A vLLM CPU server of the tiny model running kvgate's connector on the G4 directory ``g4``."""
    return VllmServer(
        model, name=name, served_model_name=MODEL, block_size=BLOCK, max_model_len=8192,
        extra_args=["--dtype", "bfloat16"], g4_path=g4, **kw,
    )


def complete(srv: VllmServer, prompt_ids: list[int], max_tokens: int = 8, **extra) -> dict:
    r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "logprobs": 2, **extra})  # logprobs: same_greedy_output
    r.raise_for_status()
    return r.json()


def same_greedy_output(got: dict, ref: dict, tie_logprob: float = 0.05) -> tuple[bool, str]:
    """Whether two greedy completions of one prompt (``logprobs`` >= 2), one with KV loaded from G4, one
    recomputed, are the same output: equal tokens, or equal up to a position where the reference itself
    was at a numeric near-tie and the other took its runner-up (within ``tie_logprob``), after which the
    two continuations differ by construction. Why: bfloat16 KV from another server's prefill (another
    batch shape, so another GEMM blocking) differs from a recompute in its last bits, and the tiny random
    model's top two logits can be that close. KV that was really wrong moves the distribution far more.
    Returns (same, what differed)."""
    g, r = got["choices"][0], ref["choices"][0]
    if g["token_ids"] == r["token_ids"]:
        return True, "equal"
    i = next(k for k, (x, y) in enumerate(zip(g["token_ids"], r["token_ids"])) if x != y)
    g_tok, r_tok = g["logprobs"]["tokens"][i], r["logprobs"]["tokens"][i]
    top = r["logprobs"]["top_logprobs"][i] or {}
    if g_tok not in top or r_tok not in top:
        return False, f"token {i}: {g_tok!r} is not the reference's runner-up ({top})"
    gap = top[r_tok] - top[g_tok]
    return gap <= tie_logprob, f"token {i}: a near-tie of {gap:.4f} in the reference ({top})"


def assert_same_output(got: dict, ref: dict) -> None:
    same, why = same_greedy_output(got, ref)
    assert same, why


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def wait_for(cond, timeout=60.0, every=0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every)
    return cond()


def store_of(g4: str) -> G4Store:
    dirs = [d for d in glob.glob(os.path.join(g4, "*")) if os.path.isdir(d)]
    assert len(dirs) == 1, dirs
    return store_for_dir(dirs[0], scan=False)


def g4_metrics(srv: VllmServer) -> dict[str, float]:
    """The connector's ``/metrics`` as ``{'name{reason="r"}' or 'name': value}`` (the ``model`` label
    dropped), parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(srv.g4_metrics()):
        for smp in fam.samples:
            reason = smp.labels.get("reason")
            out[smp.name + (f'{{reason="{reason}"}}' if reason else "")] = smp.value
    return out


def failures(before: dict, after: dict, side: str = "load") -> dict[str, float]:
    """The rise of ``kvgate_g4_{side}_failures_total`` per reason between two :func:`g4_metrics`."""
    pre = f"kvgate_g4_{side}_failures_total{{reason=\""
    return {k[len(pre) : -2]: after[k] - before.get(k, 0) for k in after if k.startswith(pre)}


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def corrupt(path: str) -> None:
    """Flip one byte of a block file's payload."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))
