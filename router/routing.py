"""Planning a request: tokens -> block hashes -> index lookup -> cost model -> policy order.

:meth:`Router.plan` sends nothing, so the proxy and the admin "explain" endpoint share it. The decision
record keeps each candidate's inputs and prediction, the stage timings, and later what vLLM delivered.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from indexer.index.base import LookupResult, WorkerMatch
from router.apis import api_blind
from router.cost import Candidate, CostModel
from router.errors import APIError
from router.index_guard import IndexUnavailable
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
    reused_bytes: int = 0  # prompt text whose ids came from the prefix cache
    new_bytes: int = 0  # prompt text tokenized for this request
    tokens_estimated: bool = False  # the tail was not tokenized (no cached prefix reaches it): num_tokens estimated
    index_error: str | None = None
    g4_blocks: int = 0
    stream: bool = False  # the client asked for a stream: its first token will be seen
    max_tokens: int = 0  # the generation limit the client asked for (0: none given)
    candidates: list[Candidate] = field(default_factory=list)  # best first
    chosen: str | None = None
    attempts: list[str] = field(default_factory=list)
    timings_ms: dict[str, float] = field(default_factory=dict)
    # Outcome, filled by the proxy.
    status: int | None = None
    outcome: str | None = None
    observed_ttft_ms: float | None = None
    gate_wait_ms: float = 0.0  # held at prefill gates (router/admission.py), all attempts together
    # When the request arrived (time.perf_counter; 0: not known), for timings_ms["first_byte"]: the
    # gateway's own time on the way to the client's first response byte (router/proxy.py)
    received_at: float = field(default=0.0, repr=False)
    prompt_tokens: int | None = None
    delivered_cached_tokens: int | None = None
    # (key, UTF-8 text) of a prompt planned on its start only: the pending record keeps it while in flight
    sent_text: tuple | None = field(default=None, repr=False)
    # per worker, the request held at its prefill gate whose blocks the prediction counts (router/load.py
    # Sequence.after): this one is held behind it there
    after: dict = field(default_factory=dict, repr=False)

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
            "reused_bytes": self.reused_bytes, "new_bytes": self.new_bytes,
            "tokens_estimated": self.tokens_estimated,
            "index_error": self.index_error, "g4_blocks": self.g4_blocks, "max_tokens": self.max_tokens,
            "candidates": [c.to_dict() for c in self.candidates], "chosen": self.chosen,
            "attempts": list(self.attempts), "timings_ms": dict(self.timings_ms),
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "predicted_ttft_ms": self.predicted_ttft_ms, "status": self.status, "outcome": self.outcome,
            "observed_ttft_ms": self.observed_ttft_ms, "gate_wait_ms": self.gate_wait_ms,
            "prompt_tokens": self.prompt_tokens,
            "delivered_cached_tokens": self.delivered_cached_tokens,
        }
        if include_hashes:
            d["hashes"] = [str(h) for h in self.hashes]  # 64-bit: strings survive JSON clients
        return d


def max_tokens_of(body: dict) -> int:
    """The generation limit a request body gives (OpenAI's ``max_completion_tokens`` or ``max_tokens``,
    the Responses API's ``max_output_tokens``); 0 when none is a positive integer."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(key)
        if type(v) is int and v > 0:
            return v
    return 0


class DecisionLog:
    """The last N decisions (bounded). Block hashes are dropped on the way in to keep it small."""

    def __init__(self, maxlen: int) -> None:
        self._d: deque[Decision] = deque(maxlen=max(1, maxlen))

    def add(self, d: Decision) -> None:
        d.hashes, d.sent_text, d.after = [], None, {}
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


def kind_of(path: str) -> str:
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completion"
    return "other"


class Router:
    """Plans requests: the registry's candidates, the tokenizers, the index, the pending-block record, the
    cost model and the live policy (``policy()``: the admin API can swap it at run time)."""

    def __init__(self, *, registry, tokenizers, index_guard, pending, routing,
                 policy: Callable[[], Policy]) -> None:
        self.registry, self.tokenizers, self.pending = registry, tokenizers, pending
        self.index_guard = index_guard  # the index behind a deadline and a circuit breaker
        self._policy = policy
        self.cost = CostModel(routing)

    @property
    def policy(self) -> Policy:
        return self._policy()

    def check_model(self, model: str | None):
        """Healthy candidates for ``model`` (any model when None): 404 when nobody serves it, 503 when
        nobody healthy does."""
        reg = self.registry
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
                   request_id: str | None = None, policy: Policy | None = None, view: dict | None = None,
                   api: str | None = None) -> Decision:
        """Score every healthy candidate for this request and order them; sends nothing. ``view``: the chat
        form of another API's body (router/apis), tokenized instead; ``api``: that API, whose failed
        parity probe makes a worker cache-blind for it."""
        reg = self.registry
        t0 = time.perf_counter()
        workers = self.check_model(model)
        policy = policy or self.policy
        headers = {k.lower(): v for k, v in (headers or {}).items()}
        ns, lora = reg.namespace(model) if model else ("", None)
        d = Decision(request_id=request_id or headers.get("x-request-id") or uuid.uuid4().hex,
                     model=model or "", path=path, policy=policy.name, namespace=ns, lora_name=lora,
                     stream=body.get("stream") is True, max_tokens=max_tokens_of(body))
        kind = kind_of(path) if model else "other"
        bs = reg.block_size(model) if model else 0
        d.block_size = bs
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        tok_body = body
        if view is not None and model:
            kind, tok_body = "chat", view
        res = None
        pending = self.pending
        reads = {w.name: w.g4_reads() for w in workers}  # G4 entries each target loads from
        # the G4 pseudo-worker entries (named shared tiers, LOCAL storage) answer in the same lookup
        g4_names = [m for r in reads.values() for m in r if m]
        names = list(dict.fromkeys([w.name for w in workers] + g4_names))
        probed: list = []  # the last reach lookup: (hashes, result), reused when the plan ends on them
        outage: list = []  # the index outage a reach lookup met

        async def reach(hashes: list[int]) -> int:
            """Leading blocks of ``hashes`` the index shows on any candidate or G4 tier. Not the pending
            sends: a deferred prompt's record covers only the start it encoded (the worker got all of it),
            so extending through them would encode one more stage per request and learn nothing."""
            try:
                r = await self.index_guard.lookup(ns, hashes, names)
            except IndexUnavailable as e:
                outage[:] = [e]  # the plan's own lookup is not tried again (one timeout, one breaker count)
                return 0
            probed[:] = [hashes, r]
            return max([r.g4, *(r.match(n).local for n in names)])

        texts: dict[str, bytes] = {}  # the deferred prompt each candidate was sent that shares this one's start

        def sent(data: bytes, pre: tuple) -> dict[str, tuple[int, bytes]]:
            """The deferred prompt in flight on each candidate that shares the prompt's start."""
            shares = pending.shares(ns, (lora, salt, pre), data)
            if not shares:
                return shares
            out = {w.name: shares[w.name] for w in workers if w.name in shares}
            texts.update((k, v[1]) for k, v in out.items())
            return out

        if kind != "other":
            # a worker's /tokenize only when no local tokenizer serves the model: the least busy one
            tok_url = (None if self.tokenizers.for_model(model, ns) is not None
                       else min(workers, key=lambda w: w.inflight).url)
            res = await self.tokenizers.tokenize(model, kind, tok_body, size=size or 0, namespace=ns,
                                               worker_url=tok_url, hashing=(bs, lora, salt), reach=reach,
                                               sent=sent)
            d.tokenizer, d.tokenize_error = res.source, res.error
            d.reused_bytes, d.new_bytes = res.reused_bytes, res.new_bytes
        t1 = time.perf_counter()
        if res is not None and res.tokens:
            d.num_tokens = res.total_tokens or len(res.tokens)
            d.tokens_estimated = res.total_tokens is not None
            try:
                d.hashes = res.block_hashes(bs, lora, salt)
            except (OverflowError, TypeError, ValueError):  # ids outside uint32: vLLM will refuse the prompt
                d.tokenize_error, d.num_tokens = "token ids outside uint32", 0
            d.num_blocks = len(d.hashes)
            if res.text is not None:
                d.sent_text = ((lora, salt, res.pre), res.text)
        shared = {}  # blocks a candidate will hold: sent there in a deferred prompt in flight
        if res is not None and res.shared_ids and d.hashes:
            shared = {w: min(len(d.hashes), (len(res.pre) + n) // bs) for w, n in res.shared_ids.items()}
        t2 = time.perf_counter()
        result = LookupResult(num_blocks=len(d.hashes))
        if probed and probed[0] == d.hashes:
            result = probed[1]
        elif outage:
            d.index_error = str(outage[0])
        elif d.hashes:
            try:  # deadline, breaker, degraded counter and rate-limited log: router/index_guard.py
                result = await self.index_guard.lookup(ns, d.hashes, names)
            except IndexUnavailable as e:  # an index outage degrades to load-only routing, never an error
                d.index_error = str(e)
        t3 = time.perf_counter()

        def g4_run(w) -> int:
            """Leading blocks on the G4 tiers the target mounts (the model-wide set, or a named tier) and
            on its own LOCAL storage."""
            return max((result.g4 if m is None else result.match(m).local for m in reads[w.name]), default=0)

        g4_runs = [g4_run(w) for w in workers]
        d.g4_blocks = max(g4_runs, default=0)

        def match(w) -> tuple[WorkerMatch, int]:
            """The worker's leading blocks, and how many of them were sent there but are not indexed yet."""
            # chat (and the APIs rendered as chat): also when only the chat probe failed, or the API's
            if w.blind_for(kind) or api_blind(w, api):
                return WorkerMatch(), 0
            m = result.match(w.name)
            if d.hashes:
                by_text = shared.get(w.name, 0)
                n = max(pending.leading(ns, d.hashes, w.name, m.local), by_text)
                if n > m.local:  # sent there, events not indexed yet
                    owner = (pending.text_owner(ns, texts[w.name]) if n == by_text and w.name in texts
                             else w.active.gated_sender(d.hashes, n))
                    if owner is not None and owner.gated:  # still held at the gateway: go after it
                        d.after[w.name] = owner
                    return WorkerMatch(gpu=max(m.gpu, n), cpu=m.cpu, local=n), n - m.local
            return m, 0

        score = self.cost.score
        scored = [score(w, m, g4, d.num_tokens, bs, pending_blocks=p, hashes=d.hashes, after=d.after.get(w.name))
                  for w, g4 in zip(workers, g4_runs) for m, p in (match(w),)]
        d.candidates = policy.order(RouteRequest(model, path, headers), scored)
        d.chosen = d.candidates[0].worker if d.candidates else None
        t4 = time.perf_counter()
        d.timings_ms = {"tokenize": (t1 - t0) * 1e3, "hash": (t2 - t1) * 1e3, "lookup": (t3 - t2) * 1e3,
                        "decide": (t4 - t3) * 1e3, "total": (t4 - t0) * 1e3}
        return d
