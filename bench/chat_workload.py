"""Multi-turn chat sessions against an OpenAI-compatible endpoint (kvgate or a vLLM server), measured
the way a user sees them: time to first token of each streamed turn, and vLLM's own
``usage.prompt_tokens_details.cached_tokens``.

Used by the real-vLLM benchmark (``bench.bench_vllm_policies``) and the end-to-end multi-turn test.
Texts are deterministic (seeded word lists) and sized in the model's own tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

_WORDS = (
    "cache block prefix token route worker gateway latency memory storage tier event index hash "
    "session turn prompt answer model layer head vector value key query batch queue load core "
    "thread socket stream request response server client metric window context summary report "
    "table figure ratio speed time cost plan order chain parent child node graph shard replica "
    "region zone cluster volume file path name label field record entry column row page"
).split()


class TextMaker:
    """Seeded filler text of (about) a given number of the model's tokens."""

    def __init__(self, tokenizer_path: str, seed: int = 0) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(
            tokenizer_path.rstrip("/") + "/tokenizer.json"
            if not tokenizer_path.endswith(".json")
            else tokenizer_path
        )
        self.rng = random.Random(seed)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, tokens: int, tag: str = "") -> str:
        words: list[str] = [tag] if tag else []
        # ~1.5 tokens per word with these tokenizers; refine once.
        words += [self.rng.choice(_WORDS) for _ in range(max(1, int(tokens / 1.5)))]
        text = " ".join(words)
        n = self.count(text)
        while n < tokens:
            extra = " ".join(self.rng.choice(_WORDS) for _ in range(max(1, int((tokens - n) / 1.5))))
            text += " " + extra
            n = self.count(text)
        return text


@dataclass
class Session:
    """One conversation: a system prompt, then one user message per turn."""

    sid: str
    system: str
    users: list[str]
    messages: list[dict] = field(default_factory=list)


def make_sessions(
    tokenizer_path: str,
    n_sessions: int,
    n_turns: int,
    first_tokens: int,
    turn_tokens: int,
    seed: int = 0,
    tag: str = "",
) -> list[Session]:
    """Sessions whose first turn carries ``first_tokens`` of context and each later turn ``turn_tokens``
    more (plus the assistant's answers)."""
    tm = TextMaker(tokenizer_path, seed)
    out = []
    for s in range(n_sessions):
        sid = f"{tag}s{s}"
        system = f"You are assistant {sid}. " + tm.text(64)
        users = [f"Session {sid} turn 0. " + tm.text(first_tokens)]
        users += [f"Session {sid} turn {t}. " + tm.text(turn_tokens) for t in range(1, n_turns)]
        out.append(Session(sid, system, users))
    return out


@dataclass
class TurnResult:
    session: str
    turn: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    worker: str | None = None  # from kvgate's response header, when there is one
    request_id: str | None = None


async def chat_turn(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    extra_headers: dict | None = None,
) -> tuple[str, TurnResult]:
    """One streamed chat completion: (assistant text, measurements)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict = {}
    async with client.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=extra_headers or {}
    ) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"chat turn failed with {r.status_code}: {text[:500]}")
        worker = r.headers.get("x-kvgate-worker")
        request_id = r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                delta = ch.get("delta") or {}
                if ttft is None and ("content" in delta or "role" in delta):
                    ttft = time.perf_counter() - t0
                if delta.get("content"):
                    parts.append(delta["content"])
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return "".join(parts), TurnResult(
        session="",
        turn=0,
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        worker=worker,
        request_id=request_id,
    )


async def run_session(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    session: Session,
    max_tokens: int = 16,
    think_s: float = 0.0,
    before_turn=None,
) -> list[TurnResult]:
    """All turns of one session in order, each resending the whole conversation. ``before_turn(messages,
    last_result)`` (async, optional) runs before every turn after the first: a user's think time."""
    session.messages = [{"role": "system", "content": session.system}]
    results = []
    for t, user in enumerate(session.users):
        if before_turn is not None and results:
            await before_turn(list(session.messages[:-1]), results[-1])
        session.messages.append({"role": "user", "content": user})
        answer, res = await chat_turn(
            client, base_url, model, session.messages, max_tokens, {"x-session-id": session.sid}
        )
        res.session, res.turn = session.sid, t
        session.messages.append({"role": "assistant", "content": answer})
        results.append(res)
        if think_s:
            await asyncio.sleep(think_s)
    return results


async def run_sessions(base_url: str, model: str, sessions: list[Session], **kw) -> list[TurnResult]:
    """Run sessions concurrently (one client each; options of ``run_clients``); results of every turn,
    session by session."""
    return await run_clients(base_url, model, [[s] for s in sessions], **kw)


async def run_clients(
    base_url: str,
    model: str,
    clients: list[list[Session]],
    max_tokens: int = 16,
    timeout_s: float = 600.0,
    stagger_s: float = 0.0,
    think_s: float = 0.0,
    before_turn=None,
) -> list[TurnResult]:
    """Run clients concurrently, each one's sessions one after another (a user asking several one-turn
    questions is a client of one-turn sessions); results of every turn, client by client."""
    limits = httpx.Limits(max_connections=len(clients) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:

        async def one(i: int, sessions: list[Session]) -> list[TurnResult]:
            if stagger_s:
                await asyncio.sleep(i * stagger_s)
            out = []
            for s in sessions:
                out += await run_session(client, base_url, model, s, max_tokens, think_s, before_turn)
            return out

        per = await asyncio.gather(*(one(i, c) for i, c in enumerate(clients)))
    return [r for rs in per for r in rs]


def previous_context_ratio(results: list[TurnResult]) -> list[float]:
    """For every turn after the first: cached tokens / the previous turn's prompt tokens."""
    by_session: dict[str, list[TurnResult]] = {}
    for r in results:
        by_session.setdefault(r.session, []).append(r)
    out = []
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, cur in zip(turns, turns[1:]):
            out.append(cur.cached_tokens / max(1, prev.prompt_tokens))
    return out
