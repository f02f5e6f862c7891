"""Planning a request: tokens -> block hashes -> index lookup -> cost model -> policy order.

:meth:`Router.plan` sends nothing, so the proxy and the admin "explain" endpoint share it. The decision
record keeps each candidate's inputs and prediction, the stage timings, and later what vLLM delivered.
"""
from __future__ import annotations

import array
import logging
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from indexer.hashing import routable_blocks, sequence_hashes
from indexer.index.base import LookupResult, WorkerMatch
from router.index_guard import IndexUnavailable
from router.cost import Candidate, CostModel
from router.errors import APIError
from router.policies import Policy, RouteRequest

log = logging.getLogger("kvgate.routing")


@dataclass
class Decision:
    """One routing decision and, once the response is seen, its outcome."""

    request_id: str
    model: str
    path: str
    policy: str
    ts: float = field(default_factory=time.time)
    namespace: str = ""
    lora_name: str | None = None
    num_tokens: int = 0
    block_size: int = 0
    num_blocks: int = 0
    hashes: list[int] = field(default_factory=list)
    tokenizer: str = "none"
    tokenize_error: str | None = None
    index_error: str | None = None
    g4_blocks: int = 0
    candidates: list[Candidate] = field(default_factory=list)  # best first
    chosen: str | None = None
    attempts: list[str] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    # Outcome, filled by the proxy.
    status: int | None = None
    outcome: str | None = None
    observed_ttft_ms: float | None = None
    prompt_tokens: int | None = None
    delivered_cached_tokens: int | None = None

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def candidate(self, worker: str) -> Candidate | None:
        for c in self.candidates:
            if c.worker == worker:
                return c
        return None

    @property
    def predicted_cached_tokens(self) -> int:
        c = self.candidate(self.chosen) if self.chosen else None
        return c.cached_tokens if c else 0

    @property
    def predicted_ttft_ms(self) -> float | None:
        c = self.candidate(self.chosen) if self.chosen else None
        return c.predicted_ttft_ms if c else None

    def to_dict(self, include_hashes: bool = False) -> dict:
        d = {
            "request_id": self.request_id, "ts": self.ts, "model": self.model, "path": self.path,
            "policy": self.policy, "namespace": self.namespace, "lora_name": self.lora_name,
            "num_tokens": self.num_tokens, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "tokenizer": self.tokenizer, "tokenize_error": self.tokenize_error,
            "index_error": self.index_error, "g4_blocks": self.g4_blocks,
            "candidates": [c.to_dict() for c in self.candidates], "chosen": self.chosen,
            "attempts": list(self.attempts), "timings_ms": dict(self.timings_ms),
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "predicted_ttft_ms": self.predicted_ttft_ms, "status": self.status, "outcome": self.outcome,
            "observed_ttft_ms": self.observed_ttft_ms, "prompt_tokens": self.prompt_tokens,
            "delivered_cached_tokens": self.delivered_cached_tokens,
        }
        if include_hashes:
            d["hashes"] = [str(h) for h in self.hashes]  # 64-bit: strings survive JSON clients
        return d


class DecisionLog:
    """The last N decisions (bounded). Block hashes are dropped on the way in to keep it small."""

    def __init__(self, maxlen: int) -> None:
        self._d: deque[Decision] = deque(maxlen=max(1, maxlen))

    def add(self, d: Decision) -> None:
        d.hashes = []
        self._d.append(d)

    def recent(self, limit: int | None = None) -> list[Decision]:
        items = list(self._d)
        items.reverse()
        return items[:limit] if limit is not None else items

    def get(self, request_id: str) -> Decision | None:
        for d in reversed(self._d):
            if d.request_id == request_id:
                return d
        return None

    def __len__(self) -> int:
        return len(self._d)


_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _as_u32(tokens: list[int]):
    """Token ids as a uint32 array: array.array converts a list ~4x faster than numpy does."""
    if not _NATIVE_U32:
        return tokens
    try:
        return np.frombuffer(array.array("I", tokens), dtype="<u4")
    except (OverflowError, TypeError):  # ids outside uint32: let the hashing module decide
        return tokens


def kind_of(path: str) -> str:
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completion"
    return "other"


class Router:
    """Plans requests against the registry, tokenizers, index, cost model and policy of a gateway."""

    def __init__(self, state) -> None:
        self.state = state
        self.cost = CostModel(state.settings.routing)

    @property
    def policy(self) -> Policy:
        return self.state.policy

    def check_model(self, model: str | None):
        """Healthy candidates for ``model`` (any model when None): 404 when nobody serves it, 503 when
        nobody healthy does."""
        reg = self.state.registry
        if model is None:
            workers = [w for w in reg.workers() if w.routable]
            if not workers:
                raise APIError(503, "No healthy worker.", code="no_healthy_worker")
            return workers
        if not reg.knows_model(model):
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        workers = reg.candidates(model)
        if not workers:
            raise APIError(503, f"No healthy worker serves the model `{model}`.", code="no_healthy_worker")
        return workers

    async def plan(self, model: str | None, body: dict, headers: dict[str, str] | None = None,
                   path: str = "/v1/chat/completions", *, size: int | None = None,
                   request_id: str | None = None, policy: Policy | None = None) -> Decision:
        """Score every healthy candidate for this request and order them; sends nothing."""
        st = self.state
        t0 = time.perf_counter()
        workers = self.check_model(model)
        policy = policy or st.policy
        headers = {k.lower(): v for k, v in (headers or {}).items()}
        ns, lora = st.registry.namespace(model) if model else ("", None)
        d = Decision(request_id=request_id or headers.get("x-request-id") or uuid.uuid4().hex,
                     model=model or "", path=path, policy=policy.name, namespace=ns, lora_name=lora)
        kind = kind_of(path) if model else "other"
        tokens = None
        if kind != "other":
            tok_worker = min(workers, key=lambda w: w.inflight)
            res = await st.tokenizers.tokenize(model, kind, body, size=size or 0, namespace=ns,
                                               worker_url=tok_worker.url)
            tokens, d.tokenizer, d.tokenize_error = res.tokens, res.source, res.error
        t1 = time.perf_counter()
        bs = st.registry.block_size(model) if model else 0
        d.block_size = bs
        if tokens:
            d.num_tokens = len(tokens)
            salt = body.get("cache_salt")
            d.hashes = sequence_hashes(_as_u32(tokens), bs, lora_name=lora,
                                       cache_salt=salt if isinstance(salt, str) else None,
                                       max_blocks=routable_blocks(len(tokens), bs))
            d.num_blocks = len(d.hashes)
        t2 = time.perf_counter()
        result = LookupResult(num_blocks=len(d.hashes))
        if d.hashes:
            try:  # deadline, breaker, degraded counter and rate-limited log: router/index_guard.py
                result = await st.index_guard.lookup(ns, d.hashes, [w.name for w in workers])
            except IndexUnavailable as e:  # an index outage degrades to load-only routing, never an error
                d.index_error = str(e)
        t3 = time.perf_counter()
        d.g4_blocks = result.g4
        pending_worker, pending_n = st.pending.leading(ns, d.hashes) if d.hashes else (None, 0)

        def match(w) -> WorkerMatch:
            if w.cache_blind:
                return WorkerMatch()
            m = result.match(w.name)
            if w.name == pending_worker and pending_n > m.local:  # sent there, events not indexed yet
                return WorkerMatch(gpu=max(m.gpu, pending_n), cpu=m.cpu, local=pending_n)
            return m

        scored = [self.cost.score(w, match(w), result.g4, d.num_tokens, bs) for w in workers]
        d.candidates = policy.order(RouteRequest(model, path, headers), scored)
        d.chosen = d.candidates[0].worker if d.candidates else None
        t4 = time.perf_counter()
        d.timings_ms = {"tokenize": (t1 - t0) * 1e3, "hash": (t2 - t1) * 1e3, "lookup": (t3 - t2) * 1e3,
                        "decide": (t4 - t3) * 1e3, "total": (t4 - t0) * 1e3}
        return d
