"""Parity check at registration: does kvgate key this worker's blocks the way the worker stores them?

kvgate routes on its own block hashes of the prompt tokens *it* computes (its tokenizer, its block size).
The index learns a worker's blocks from the worker's ``BlockStored`` events, re-hashed from the token ids
*vLLM* computed. If the two disagree -- another tokenizer or chat template, another block size, a salt
rule that differs -- every lookup misses on that worker and kvgate would route on wrong keys without a
sign. So when a worker registers (and after it restarts), kvgate sends it a probe: a completion on a
prompt nobody sent before (a nonce), tokenized by the worker itself. kvgate hashes the same text with
its own tokenizer and block size, and waits for those hashes to come back through the event ingestion
(the ingestor's ``observer`` callback reports the kvgate hashes it derived from each worker's events).

- all of the probe's routable blocks come back: ``ok``;
- events came back but not those blocks (or no events at all after a few probes): ``cache-blind``. The
  worker still serves traffic, but routing ignores its index entries (its predicted hit is 0), a warning
  names the cause, and ``kvgate_worker_cache_blind{worker}`` is 1. A verdict for silence alone is asked
  again (``recheck``) at the worker's first event: its stream was not live, which says nothing of keys;
- kvgate cannot tokenize for the model (no tokenizer at all): ``unverified`` (nothing to compare);
- the worker has no KV event source: ``no-events`` at once, no probe sent (nothing can come back; its
  cache is invisible to routing, which the reason says);
- no new events because the worker already had the probe cached (a tokenizer that maps the nonce to an
  unknown-word token repeats an earlier probe): ``ok`` when the index already holds every probe block for
  that worker -- the keys matched when those blocks were announced.

The probe is retried with a fresh nonce when the ingestor saw no event at all yet, because a new ZMQ
subscription misses what is published before it is live (the ingestor replays the missed batches when
the next message shows the gap).

Chat has a check of its own, because the chat path renders the model's template in the gateway
(router/tokenize.py) and a template, a content list or a tool message handled differently there than in
vLLM changes the tokens without changing the tokenizer: kvgate's token ids of a probe conversation (a
system prompt, a user message given as a content list, an assistant tool call and the tool's answer) are
compared with the worker's own ``/tokenize`` of the same messages (chat form). Identical: chat ``ok``.
Different: chat ``cache-blind`` (``ParityResult.chat_cache_blind``, ``Worker.chat_cache_blind``), with
the first differing position and token of each side; the completions result is left as it is. No local
chat template (chat is tokenized by the workers' ``/tokenize`` anyway), or a probe the worker or kvgate
cannot render: chat ``unverified``.

Other APIs render their bodies through their own conversion (router/apis): when the completion probe
passes, each API in ``api_probes`` gets a probe of its own (a Responses input with instructions and a
function call's output; an Anthropic conversation with a tool use and its tool result), compared the
same way (through the KV events, since vLLM's ``/tokenize`` has no form for them). A mismatch there marks
the worker cache-blind for that API only (``result.apis``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from indexer.hashing import routable_blocks, sequence_hashes

log = logging.getLogger("kvgate.parity")

OK = "ok"
CACHE_BLIND = "cache-blind"
UNVERIFIED = "unverified"
NO_EVENTS = "no-events"
SILENT = "no KV events from the worker"  # the reason of a cache-blind verdict for silence, re-checked

# Plain words, so any tokenizer produces many tokens from them; the nonce makes the prompt new.
_WORDS = (
    "kvgate parity probe checks that the gateway and the worker agree on every token and block "
    "of this prompt before routing on cached prefixes alpha beta gamma delta epsilon zeta eta theta "
    "iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega"
).split()


def probe_prompt(nonce: str, words: int = 160) -> str:
    """A prompt that no client sent before: a nonce, then fixed words (several blocks long)."""
    return f"probe {nonce} " + " ".join(_WORDS[i % len(_WORDS)] + f" {nonce[i % 8]}" for i in range(words))


def chat_probe_body(model: str, nonce: str) -> dict:
    """A chat request exercising what the chat path renders: a system prompt, a content list, an
    assistant tool call and a tool message, then the generation prompt (vLLM's ``/tokenize`` chat form)."""
    call = {"id": "call0", "type": "function",
            "function": {"name": "lookup_weather", "arguments": '{"city": "Paris"}'}}
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": f"You are the kvgate parity probe {nonce}. Answer in one word."},
            {"role": "user", "content": [{"type": "text", "text": f"Probe {nonce}: what is the weather?"},
                                         {"type": "text", "text": "Say what to wear."}]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call0", "content": "sunny, 21 degrees"},
        ],
        "add_generation_prompt": True,
    }


@dataclass
class ParityResult:
    worker: str
    status: str  # ok | cache-blind | unverified
    reason: str
    model: str | None = None
    block_size: int = 0
    expected_blocks: int = 0
    matched_blocks: int = 0
    kvgate_tokens: int = 0
    worker_tokens: int | None = None
    attempts: int = 0
    elapsed_s: float = 0.0
    checked_at: float = field(default_factory=time.time)
    # The chat probe (module docstring): status, reason, token counts, first_mismatch; None: not run.
    chat: dict | None = None
    apis: dict[str, dict] = field(default_factory=dict)  # per-API probe results (same keys, fewer)

    @property
    def cache_blind(self) -> bool:
        return self.status == CACHE_BLIND

    @property
    def chat_cache_blind(self) -> bool:
        return self.cache_blind or bool(self.chat and self.chat.get("status") == CACHE_BLIND)

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "reason": self.reason,
            "model": self.model,
            "block_size": self.block_size,
            "expected_blocks": self.expected_blocks,
            "matched_blocks": self.matched_blocks,
            "kvgate_tokens": self.kvgate_tokens,
            "worker_tokens": self.worker_tokens,
            "attempts": self.attempts,
            "elapsed_s": round(self.elapsed_s, 3),
            "checked_at": self.checked_at,
            "chat": self.chat,
            "apis": dict(self.apis),
        }


class _Watch:
    """Hashes seen from one worker while a probe is out."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expected: set[int]) -> None:
        self.loop = loop
        self.expected = expected
        self.seen: set[int] = set()
        self.events = 0
        self.done = asyncio.Event()

    def add(self, hashes: list[int]) -> None:
        self.events += 1
        self.seen.update(h for h in hashes if h in self.expected)
        if self.expected <= self.seen:
            self.done.set()


# An API probe: (model, nonce) -> (path, body, kvgate's tokens, answer -> the worker's prompt token count).
ApiProbe = Callable[[str, str], Awaitable[tuple[str, dict, "list[int] | None", Callable[[dict], "int | None"]]]]


class ParityChecker:
    """Runs parity probes. Plug :meth:`observe` into the ingestor as its ``observer``.

    ``tokenize(model, text)`` returns kvgate's token ids of a completion prompt (None: cannot tokenize);
    ``block_size(model)`` is the block size kvgate routes ``model`` with; ``events_seen(worker)`` says
    whether the ingestor has received any message from the worker (retries the probe while it has not).
    ``tokenize_chat(model, body)`` returns kvgate's own token ids of a chat request and, when it has none,
    why (``(None, reason)``); without it the chat probe is not run. ``decode(model, ids)`` turns token ids
    into text for the mismatch report (optional).
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        tokenize: Callable[[str, str], Awaitable[list[int] | None]],
        block_size: Callable[[str], int],
        *,
        events_seen: Callable[[str], bool] | None = None,
        has_events: Callable[[str], bool] | None = None,
        indexed: Callable[[str, str, list[int]], Awaitable[int]] | None = None,
        metrics=None,
        tokenize_chat: Callable[[str, dict], Awaitable[tuple[list[int] | None, str]]] | None = None,
        decode: Callable[[str, list[int]], str | None] | None = None,
        attempts: int = 3,
        settle_s: float = 5.0,
        request_timeout_s: float = 60.0,
        api_probes: dict[str, ApiProbe] | None = None,
    ) -> None:
        self.client = client
        self.tokenize = tokenize
        self.block_size = block_size
        self.events_seen = events_seen or (lambda worker: True)
        self.has_events = has_events or (lambda worker: True)  # an event source is subscribed
        self.indexed = indexed
        self.metrics = metrics
        self.tokenize_chat = tokenize_chat
        self.decode = decode
        self.attempts = attempts
        self.settle_s = settle_s
        self.request_timeout_s = request_timeout_s
        self.api_probes = api_probes or {}
        self._watches: dict[str, list[_Watch]] = {}
        # Workers last found cache-blind only because no event came back, with the loop the check ran
        # on: their first event calls ``recheck(worker)`` (the gateway runs the check again).
        self._silent: dict[str, asyncio.AbstractEventLoop] = {}
        self.recheck: Callable[[str], None] | None = None
        self.results: dict[str, ParityResult] = {}

    # -- the ingestor's observer (called on the event loop, or from another thread) ---------------------
    def observe(self, worker: str, tier: str, hashes: list[int]) -> None:
        for w in self._watches.get(worker, ()):
            w.loop.call_soon_threadsafe(w.add, list(hashes))
        loop = self._silent.pop(worker, None)
        if loop is not None and self.recheck is not None:
            # Blind only because nothing came back: its stream is alive now, so ask again.
            loop.call_soon_threadsafe(self.recheck, worker)

    # -- the check --------------------------------------------------------------------------------------
    async def check(self, worker: str, url: str, model: str, timeout_s: float | None = None,
                    headers: dict[str, str] | None = None) -> ParityResult:
        """Probe ``worker`` (serving ``model`` at ``url``); record, log and export the outcome. With
        ``timeout_s`` the whole check (probe request, event wait, retries) takes at most that long.
        ``headers`` go with every probe that watches events (``X-data-parallel-rank``: the rank whose
        stream ``worker`` names)."""
        t0 = time.monotonic()
        bs = self.block_size(model)
        result = ParityResult(worker=worker, status=UNVERIFIED, reason="", model=model, block_size=bs)
        try:
            if not self.has_events(worker):
                result.status = NO_EVENTS
                result.reason = "the worker publishes no KV events: nothing to compare, routing cannot see its cache"
            elif timeout_s is None:
                await self._run(result, url, model, bs, headers=headers)
            else:  # the event wait shrinks to fit; wait_for is the hard stop (a probe that hangs)
                deadline = time.monotonic() + timeout_s * 0.9
                await asyncio.wait_for(self._run(result, url, model, bs, deadline, headers), timeout_s)
        except TimeoutError:
            result.status, result.reason = UNVERIFIED, f"no answer within {timeout_s:g} s"
        except Exception as e:  # a failed probe must never break registration
            result.status, result.reason = UNVERIFIED, f"probe failed: {type(e).__name__}: {e}"
        if self.tokenize_chat is not None:
            try:
                result.chat = await self._chat(url, model)
            except Exception as e:
                result.chat = {"status": UNVERIFIED, "reason": f"chat probe failed: {type(e).__name__}: {e}"}
        for api, probe in self.api_probes.items():
            if result.status != OK:
                result.apis[api] = {"status": UNVERIFIED, "reason": f"the completion probe was {result.status}"}
                continue
            try:
                result.apis[api] = await self._run_api(result.worker, url, model, bs, probe, headers)
            except Exception as e:
                result.apis[api] = {"status": UNVERIFIED, "reason": f"probe failed: {type(e).__name__}: {e}"}
        result.elapsed_s = time.monotonic() - t0
        self._record(result)
        return result

    async def _run(self, result: ParityResult, url: str, model: str, bs: int,
                   deadline: float | None = None, headers: dict[str, str] | None = None) -> None:
        for attempt in range(1, self.attempts + 1):
            if deadline is not None and attempt > 1 and time.monotonic() >= deadline:
                result.attempts = attempt - 1
                break
            result.attempts = attempt
            text = probe_prompt(uuid.uuid4().hex)
            tokens = await self.tokenize(model, text)
            if not tokens:
                result.status, result.reason = UNVERIFIED, "kvgate has no tokenizer for this model"
                return
            expected = sequence_hashes(tokens, bs, max_blocks=routable_blocks(len(tokens), bs))
            result.kvgate_tokens, result.expected_blocks = len(tokens), len(expected)
            if not expected:
                result.status, result.reason = UNVERIFIED, "probe shorter than one block"
                return
            # BlockStored is published when the prompt is scheduled, before the answer: a short wait
            # covers the trip through ZMQ and the ingestor (shrunk to fit the time budget).
            settle = self.settle_s if deadline is None else max(0.0, min(self.settle_s, deadline - time.monotonic()))
            watch, answer = await self._send_watched(
                result.worker, url, "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1,
                                                        "temperature": 0.0}, expected, settle, headers)
            result.worker_tokens = (answer.get("usage") or {}).get("prompt_tokens")
            result.matched_blocks = _leading(expected, watch.seen)
            if watch.done.is_set():
                result.status, result.reason = OK, f"{len(expected)} probe blocks matched"
                return
            if self.indexed is not None and await self.indexed(result.worker, model, expected) == len(expected):
                result.matched_blocks = len(expected)
                result.status = OK
                result.reason = f"{len(expected)} probe blocks were already cached and indexed for this worker"
                return
            if watch.events or self.events_seen(result.worker):
                result.status = CACHE_BLIND
                result.reason = _mismatch_reason(result, bool(watch.events))
                return
        if result.attempts < self.attempts:  # the time budget ended the retries: too early to tell
            result.status = UNVERIFIED
            result.reason = f"no KV events from the worker within the time budget ({result.attempts} probe(s))"
            return
        result.status = CACHE_BLIND
        result.reason = f"{SILENT} after {result.attempts} probes"
        self._silent[result.worker] = asyncio.get_running_loop()

    async def _chat(self, url: str, model: str) -> dict:
        """kvgate's token ids of the chat probe against the worker's ``/tokenize`` of the same messages."""
        body = chat_probe_body(model, uuid.uuid4().hex[:12])
        mine, why = await self.tokenize_chat(model, body)
        if mine is None:
            return {"status": UNVERIFIED, "reason": why}
        r = await self.client.post(f"{url}/tokenize", json=body, timeout=self.request_timeout_s)
        if r.status_code != 200:
            return {"status": UNVERIFIED, "kvgate_tokens": len(mine),
                    "reason": f"the worker's /tokenize answered {r.status_code}: {r.text[:300]}"}
        theirs = (r.json() or {}).get("tokens")
        if not isinstance(theirs, list):
            return {"status": UNVERIFIED, "reason": "the worker's /tokenize answered no tokens"}
        out = {"kvgate_tokens": len(mine), "worker_tokens": len(theirs)}
        if mine == theirs:
            return {"status": OK, "reason": f"{len(mine)} tokens identical", **out}
        i = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        first = {"index": i, "kvgate_token": mine[i] if i < len(mine) else None,
                 "worker_token": theirs[i] if i < len(theirs) else None}
        if self.decode is not None:
            first["kvgate_text"] = self.decode(model, mine[i:i + 8])
            first["worker_text"] = self.decode(model, theirs[i:i + 8])
        reason = (f"kvgate's chat token ids differ from the worker's /tokenize from token {i} on (kvgate "
                  f"{first['kvgate_token']}, worker {first['worker_token']}; {len(mine)} vs {len(theirs)} "
                  "tokens): another chat template or message handling, so kvgate's block keys of chat "
                  "prompts miss this worker's cache (completions are checked separately)")
        return {"status": CACHE_BLIND, "reason": reason, "first_mismatch": first, **out}

    async def _send_watched(self, worker: str, url: str, path: str, payload: dict,
                            expected: list[int], settle: float | None = None,
                            headers: dict[str, str] | None = None) -> tuple[_Watch, dict]:
        """Send a probe and collect the expected hashes the worker's events bring back (a few seconds)."""
        watch = _Watch(asyncio.get_running_loop(), set(expected))
        self._watches.setdefault(worker, []).append(watch)
        try:
            r = await self.client.post(f"{url}{path}", timeout=self.request_timeout_s, json=payload,
                                       headers=headers)
            r.raise_for_status()
            answer = r.json() or {}
            try:
                await asyncio.wait_for(watch.done.wait(), self.settle_s if settle is None else settle)
            except TimeoutError:
                pass
        finally:
            self._watches[worker].remove(watch)
            if not self._watches[worker]:
                del self._watches[worker]
        return watch, answer if isinstance(answer, dict) else {}

    async def _run_api(self, worker: str, url: str, model: str, bs: int, probe: ApiProbe,
                       headers: dict[str, str] | None = None) -> dict:
        """One API's probe: ``probe(model, nonce)`` gives (path, body, kvgate's tokens, the worker's prompt
        token count from its answer)."""
        path, body, tokens, count = await probe(model, uuid.uuid4().hex)
        if not tokens:
            return {"status": UNVERIFIED, "reason": "kvgate cannot tokenize the probe for this API"}
        expected = sequence_hashes(tokens, bs, max_blocks=routable_blocks(len(tokens), bs))
        watch, answer = await self._send_watched(worker, url, path, body, expected, headers=headers)
        out = {"kvgate_tokens": len(tokens), "worker_tokens": count(answer), "expected_blocks": len(expected),
               "matched_blocks": _leading(expected, watch.seen)}
        if watch.done.is_set():
            return {"status": OK, "reason": f"{len(expected)} probe blocks matched", **out}
        if not watch.events:
            return {"status": UNVERIFIED, "reason": "no KV events during the probe", **out}
        why = ("the worker counts another number of prompt tokens" if out["worker_tokens"] not in
               (None, len(tokens)) else "same token count, other tokens")
        log.warning("parity check of worker %s: CACHE-BLIND for %s: %s", worker, path, why)
        return {"status": CACHE_BLIND, "reason": f"kvgate's rendering of {path} differs from the worker's: {why}",
                **out}

    def _record(self, result: ParityResult) -> None:
        self.results[result.worker] = result
        if not (result.status == CACHE_BLIND and result.reason.startswith(SILENT)):
            self._silent.pop(result.worker, None)
        m = self.metrics
        if m is not None and hasattr(m, "cache_blind"):
            m.cache_blind.labels(result.worker).set(1.0 if result.cache_blind else 0.0)
            m.parity_checks.labels(result.worker, result.status).inc()
            m.chat_cache_blind.labels(result.worker).set(1.0 if result.chat_cache_blind else 0.0)
        if result.status == OK:
            log.info(
                "parity check of worker %s: ok (%d blocks of %d tokens, block size %d)",
                result.worker,
                result.expected_blocks,
                result.kvgate_tokens,
                result.block_size,
            )
        else:
            log.warning(
                "parity check of worker %s: %s: %s; routing ignores its cache entries",
                result.worker,
                result.status.upper(),
                result.reason,
            )
        if result.chat:
            log.log(logging.WARNING if result.chat.get("status") == CACHE_BLIND else logging.INFO,
                    "chat parity check of worker %s: %s: %s", result.worker,
                    str(result.chat.get("status")).upper(), result.chat.get("reason"))

    def forget(self, worker: str) -> None:
        self.results.pop(worker, None)
        self._silent.pop(worker, None)
        if self.metrics is not None and hasattr(self.metrics, "cache_blind"):
            for gauge in (self.metrics.cache_blind, self.metrics.chat_cache_blind):
                try:
                    gauge.remove(worker)
                except KeyError:
                    pass


def _leading(expected: list[int], seen: set[int]) -> int:
    n = 0
    for h in expected:
        if h not in seen:
            break
        n += 1
    return n


def _mismatch_reason(r: ParityResult, events_during_probe: bool) -> str:
    parts = [
        f"kvgate's hashes of the probe ({r.expected_blocks} blocks, block size {r.block_size}) "
        f"{'do not match' if events_during_probe else 'never came back in'} the worker's KV events"
        f" (leading blocks matched: {r.matched_blocks})"
    ]
    if r.worker_tokens is not None and r.worker_tokens != r.kvgate_tokens:
        parts.append(
            f"the worker counts {r.worker_tokens} prompt tokens where kvgate counts "
            f"{r.kvgate_tokens}: different tokenizer"
        )
    elif r.worker_tokens is not None:
        parts.append("same token count: different block size, tokens or hash salt")
    return "; ".join(parts)
