"""Workloads for the replayer: the Mooncake conversation trace and synthetic multi-turn chat, RAG and agent
loops. Each yields ``WorkItem``s: an arrival time in workload seconds and a prompt as token ids.

Token ids come from the simulator's vocabulary (``w{k}`` words), so a prompt can be sent as ids or as text
and describe the same blocks either way."""
from __future__ import annotations

import json
import lzma
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512
TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_FILE = TRACE_NAME + ".xz"
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def trace_path() -> Path:
    """The Mooncake conversation trace carried in the repository (xz-compressed, see bench/traces/NOTICE)."""
    return Path(__file__).resolve().parent / "traces" / TRACE_FILE


@dataclass
class WorkItem:
    at: float                       # arrival, workload seconds from the start
    tokens: np.ndarray              # prompt token ids (uint32)
    max_tokens: int
    session: str | None = None
    tag: str = ""
    meta: dict = field(default_factory=dict)


@dataclass
class TraceRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_trace(path: str | Path | None = None) -> list[TraceRow]:
    """Rows of a trace in Mooncake's JSONL format (an ``.xz`` file is read compressed)."""
    path = Path(path or trace_path())
    opener = lzma.open if path.suffix == ".xz" else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                rows.append(TraceRow(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                     list(d["hash_ids"])))
    return rows


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, vectorized."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def block_tokens(block_id: int, vocab_size: int = 32000, n: int = TRACE_BLOCK, salt: int = 0) -> np.ndarray:
    """The fixed run of ``n`` token ids standing for one trace hash id (same id -> same tokens)."""
    base = np.uint64((block_id * 0x9E3779B97F4A7C15 + salt * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        x = _mix(base + np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return (x % np.uint64(vocab_size)).astype(np.uint32)


def trace_prompt(row: TraceRow, vocab_size: int = 32000) -> np.ndarray:
    parts = [block_tokens(h, vocab_size) for h in row.hash_ids]
    toks = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return toks[: row.input_length]


class LRUPrefixCache:
    """Prefix blocks in least-recently-used order, the order vLLM's free queue evicts them in (``capacity``
    blocks; None: unlimited): what the benches' ceilings and LRU references replay prompts through."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """The leading run of ``hashes`` cached (at most ``limit`` blocks), then all of them the most
        recently used, the least recently used evicted down to the capacity. vLLM frees a request's blocks
        tail first, so its first block is the last to go."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        k = 0
        while k < n and hashes[k] in self._blocks:
            k += 1
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while self.capacity is not None and len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return k


def trace_ceiling(rows: Iterable[TraceRow], capacity_tokens: int | None = None) -> float:
    """Share of prompt tokens an unlimited single cache would serve: the leading blocks whose hash ids all
    appeared before (block-granular, as the trace describes sharing). 37.4% on the full trace.

    With ``capacity_tokens``: the same for one cache of that size evicting the least recently used block
    first (vLLM's rule, at the trace's 512-token blocks), the whole fleet's KV as one cache: the *LRU
    reference* the fleet bench prints. Cache-aware routers in front of LRU engines of that total size get
    about that much: where a router puts a prefix mostly picks among partitions of that one cache (on the
    fleet bench's slice 16.3% at 4 workers, measured routers 15.5-16.6%; the ceiling's 20.7%, which 16
    reach). Not a strict bound: placement could keep one-off prompts away from hot prefixes (Belady's
    eviction reaches the ceiling at 4 workers). Outputs and running requests' blocks are not counted.
    """
    cache = LRUPrefixCache(None if capacity_tokens is None else max(1, capacity_tokens // TRACE_BLOCK))
    total = hit = 0
    for r in rows:
        hit += min(r.input_length, TRACE_BLOCK * cache.serve(r.hash_ids))
        total += r.input_length
    return hit / total if total else 0.0


def token_ceiling(items: Sequence[WorkItem], block_size: int) -> float:
    """The same ceiling for any workload, at an engine's block size and with vLLM's rules (full blocks only,
    the last prompt token is never a hit): an unbounded single prefix cache over the prompts in order."""
    return prefix_hit_rate([(chained_hashes(it.tokens, block_size), len(it.tokens)) for it in items], block_size)


def prefix_hit_rate(prompts: Iterable[tuple[Sequence[int], int]], block_size: int,
                    capacity: int | None = None) -> float:
    """Cached over prompt tokens of ``prompts`` ((chained block hashes, prompt length) in order) through one
    :class:`LRUPrefixCache` of ``capacity`` blocks, with vLLM's rules (the last prompt token is never a hit)."""
    cache = LRUPrefixCache(capacity)
    hit = total = 0
    for hashes, n in prompts:
        hit += cache.serve(hashes, (n - 1) // block_size) * block_size
        total += n
    return hit / total if total else 0.0


def chained_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The prompt's full blocks, each hash chained on its parent's (as vLLM's prefix cache keys them)."""
    import xxhash

    raw = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    out, h = [], 0
    for i in range(len(raw) // step):
        h = xxhash.xxh3_64_intdigest(raw[i * step:(i + 1) * step], seed=h)
        out.append(h)
    return out


def select_rows(rows: Sequence[TraceRow], *, start_s: float = 0.0, duration_s: float | None = None,
                limit: int | None = None, max_prompt_tokens: int | None = None) -> list[TraceRow]:
    """A slice of the trace: arrivals in [start_s, start_s + duration_s), prompts up to max_prompt_tokens."""
    out = []
    for r in rows:
        t = r.timestamp_ms / 1000.0
        if t < start_s or (duration_s is not None and t >= start_s + duration_s):
            continue
        if max_prompt_tokens is not None and r.input_length > max_prompt_tokens:
            continue
        out.append(r)
        if limit is not None and len(out) >= limit:
            break
    return out


def conversation_ids(rows: Sequence[TraceRow]) -> list[str]:
    """A conversation id per row, as a client that keeps a session would send it: a row whose hash ids
    begin with the whole of an earlier prompt (its full blocks, or all its blocks: the last may be partial)
    continues that prompt's conversation; any other row starts one. Matches of one block are not
    continuations (a shared system prompt); a longer prompt that is only a shared prefix would join its
    readers into one conversation (on the fleet's slice the largest has 6 requests). The trace itself
    carries no session, and without one the ``session`` policy is the ``kv`` policy."""
    seen: dict[tuple[int, ...], str] = {}
    out = []
    for r in rows:
        h = r.hash_ids
        sid = next((s for k in range(len(h), 1, -1) if (s := seen.get(tuple(h[:k]))) is not None),
                   f"conv-{len(out)}")
        out.append(sid)
        seen[tuple(h[: r.input_length // TRACE_BLOCK])] = sid
        seen[tuple(h)] = sid
    return out


def trace_items(rows: Sequence[TraceRow], *, start_s: float = 0.0, duration_s: float | None = None,
                limit: int | None = None, max_prompt_tokens: int | None = None, max_tokens_cap: int | None = None,
                vocab_size: int = 32000) -> list[WorkItem]:
    """Work items for ``select_rows(...)``, arrival times re-based to the slice start, each with its
    conversation's id (:func:`conversation_ids`; sent as ``x-session-id``)."""
    out = []
    sel = select_rows(rows, start_s=start_s, duration_s=duration_s, limit=limit, max_prompt_tokens=max_prompt_tokens)
    for r, sid in zip(sel, conversation_ids(sel)):
        mt = max(1, r.output_length if max_tokens_cap is None else min(r.output_length, max_tokens_cap))
        out.append(WorkItem(at=r.timestamp_ms / 1000.0 - start_s, tokens=trace_prompt(r, vocab_size),
                            max_tokens=mt, session=sid, tag="trace", meta={"hash_ids": r.hash_ids}))
    return out


def _words(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, size=n).astype(np.uint32)


def chat_items(sessions: int = 32, turns: int = 6, system_tokens: int = 1000, user_tokens: int = 200,
               reply_tokens: int = 300, think_s: float = 20.0, spread_s: float = 60.0, max_tokens: int = 100,
               vocab_size: int = 32000, seed: int = 1) -> list[WorkItem]:
    """Multi-turn chat: each session resends its whole history plus a new user turn; a few system prompts
    are shared between sessions."""
    rng = np.random.default_rng(seed)
    systems = [_words(rng, system_tokens, vocab_size) for _ in range(4)]
    out = []
    for s in range(sessions):
        t = float(rng.uniform(0, spread_s))
        hist = systems[s % len(systems)]
        for k in range(turns):
            hist = np.concatenate([hist, _words(rng, user_tokens, vocab_size)])
            out.append(WorkItem(at=t, tokens=hist.copy(), max_tokens=max_tokens, session=f"chat-{s}",
                                tag="chat"))
            hist = np.concatenate([hist, _words(rng, reply_tokens, vocab_size)])
            t += float(rng.exponential(think_s))
    return sorted(out, key=lambda w: w.at)


def rag_items(users: int = 64, docs: int = 4, doc_tokens: int = 8000, question_tokens: int = 100,
              rate_per_s: float = 2.0, max_tokens: int = 100, vocab_size: int = 32000, seed: int = 2) -> list[WorkItem]:
    """Many users asking about a few shared long documents: prompt = document + question."""
    rng = np.random.default_rng(seed)
    corpus = [_words(rng, doc_tokens, vocab_size) for _ in range(docs)]
    out, t = [], 0.0
    for u in range(users):
        d = int(rng.zipf(1.5) - 1) % docs
        out.append(WorkItem(at=t, tokens=np.concatenate([corpus[d], _words(rng, question_tokens, vocab_size)]),
                            max_tokens=max_tokens, session=f"rag-{u}", tag="rag", meta={"doc": d}))
        t += float(rng.exponential(1.0 / rate_per_s))
    return out


def agent_items(agents: int = 16, steps: int = 10, prompt_tokens: int = 2000, tool_tokens: int = 600,
                step_s: float = 8.0, spread_s: float = 30.0, max_tokens: int = 150, vocab_size: int = 32000,
                seed: int = 3) -> list[WorkItem]:
    """Agent loops: every step resends the growing context (instructions + all tool outputs so far)."""
    rng = np.random.default_rng(seed)
    tools = _words(rng, prompt_tokens, vocab_size)  # shared instructions / tool schema
    out = []
    for a in range(agents):
        t = float(rng.uniform(0, spread_s))
        ctx = np.concatenate([tools, _words(rng, 200, vocab_size)])
        for k in range(steps):
            out.append(WorkItem(at=t, tokens=ctx.copy(), max_tokens=max_tokens, session=f"agent-{a}", tag="agent"))
            ctx = np.concatenate([ctx, _words(rng, tool_tokens, vocab_size)])
            t += step_s * float(rng.uniform(0.5, 1.5))
    return sorted(out, key=lambda w: w.at)


WORKLOADS = ("trace", "chat", "rag", "agent")
