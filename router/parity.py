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
  names the cause, and ``kvgate_worker_cache_blind{worker}`` is 1;
- kvgate cannot tokenize for the model (no tokenizer at all): ``unverified`` (nothing to compare);
- the worker has no KV event source: ``no-events`` at once, no probe sent (nothing can come back; its
  cache is invisible to routing, which the reason says);
- no new events because the worker already had the probe cached (a tokenizer that maps the nonce to an
  unknown-word token repeats an earlier probe): ``ok`` when the index already holds every probe block for
  that worker -- the keys matched when those blocks were announced.

The probe is retried with a fresh nonce when the ingestor saw no event at all yet, because a new ZMQ
subscription misses what is published before it is live (the ingestor replays the missed batches when
the next message shows the gap).
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

# Plain words, so any tokenizer produces many tokens from them; the nonce makes the prompt new.
_WORDS = (
    "kvgate parity probe checks that the gateway and the worker agree on every token and block "
    "of this prompt before routing on cached prefixes alpha beta gamma delta epsilon zeta eta theta "
    "iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon phi chi psi omega"
).split()


def probe_prompt(nonce: str, words: int = 160) -> str:
    """A prompt that no client sent before: a nonce, then fixed words (several blocks long)."""
    return f"probe {nonce} " + " ".join(_WORDS[i % len(_WORDS)] + f" {nonce[i % 8]}" for i in range(words))


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

    @property
    def cache_blind(self) -> bool:
        return self.status == CACHE_BLIND

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


class ParityChecker:
    """Runs parity probes. Plug :meth:`observe` into the ingestor as its ``observer``.

    ``tokenize(model, text)`` returns kvgate's token ids of a completion prompt (None: cannot tokenize);
    ``block_size(model)`` is the block size kvgate routes ``model`` with; ``events_seen(worker)`` says
    whether the ingestor has received any message from the worker (retries the probe while it has not).
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
        attempts: int = 3,
        settle_s: float = 5.0,
        request_timeout_s: float = 60.0,
    ) -> None:
        self.client = client
        self.tokenize = tokenize
        self.block_size = block_size
        self.events_seen = events_seen or (lambda worker: True)
        self.has_events = has_events or (lambda worker: True)  # an event source is subscribed
        self.indexed = indexed
        self.metrics = metrics
        self.attempts = attempts
        self.settle_s = settle_s
        self.request_timeout_s = request_timeout_s
        self._watches: dict[str, list[_Watch]] = {}
        self.results: dict[str, ParityResult] = {}

    # -- the ingestor's observer (called on the event loop, or from another thread) ---------------------
    def observe(self, worker: str, tier: str, hashes: list[int]) -> None:
        for w in self._watches.get(worker, ()):
            w.loop.call_soon_threadsafe(w.add, list(hashes))

    # -- the check --------------------------------------------------------------------------------------
    async def check(self, worker: str, url: str, model: str, timeout_s: float | None = None) -> ParityResult:
        """Probe ``worker`` (serving ``model`` at ``url``); record, log and export the outcome. With
        ``timeout_s`` the whole check (probe request, event wait, retries) takes at most that long."""
        t0 = time.monotonic()
        bs = self.block_size(model)
        result = ParityResult(worker=worker, status=UNVERIFIED, reason="", model=model, block_size=bs)
        try:
            if not self.has_events(worker):
                result.status = NO_EVENTS
                result.reason = "the worker publishes no KV events: nothing to compare, routing cannot see its cache"
            elif timeout_s is None:
                await self._run(result, url, model, bs)
            else:  # the event wait shrinks to fit; wait_for is the hard stop (a probe that hangs)
                deadline = time.monotonic() + timeout_s * 0.9
                await asyncio.wait_for(self._run(result, url, model, bs, deadline), timeout_s)
        except TimeoutError:
            result.status, result.reason = UNVERIFIED, f"no answer within {timeout_s:g} s"
        except Exception as e:  # a failed probe must never break registration
            result.status, result.reason = UNVERIFIED, f"probe failed: {type(e).__name__}: {e}"
        result.elapsed_s = time.monotonic() - t0
        self._record(result)
        return result

    async def _run(self, result: ParityResult, url: str, model: str, bs: int,
                   deadline: float | None = None) -> None:
        loop = asyncio.get_running_loop()
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
            watch = _Watch(loop, set(expected))
            self._watches.setdefault(result.worker, []).append(watch)
            try:
                r = await self.client.post(
                    f"{url}/v1/completions",
                    timeout=self.request_timeout_s,
                    json={"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0},
                )
                r.raise_for_status()
                usage = (r.json() or {}).get("usage") or {}
                result.worker_tokens = usage.get("prompt_tokens")
                # BlockStored is published when the prompt is scheduled, before the answer: a short
                # wait covers the trip through ZMQ and the ingestor.
                settle = self.settle_s if deadline is None else max(0.0, min(self.settle_s,
                                                                                 deadline - time.monotonic()))
                try:
                    await asyncio.wait_for(watch.done.wait(), settle)
                except TimeoutError:
                    pass
            finally:
                self._watches[result.worker].remove(watch)
                if not self._watches[result.worker]:
                    del self._watches[result.worker]
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
        result.reason = f"no KV events from the worker after {result.attempts} probes"

    def _record(self, result: ParityResult) -> None:
        self.results[result.worker] = result
        m = self.metrics
        if m is not None and hasattr(m, "cache_blind"):
            m.cache_blind.labels(result.worker).set(1.0 if result.cache_blind else 0.0)
            m.parity_checks.labels(result.worker, result.status).inc()
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

    def forget(self, worker: str) -> None:
        self.results.pop(worker, None)
        if self.metrics is not None and hasattr(self.metrics, "cache_blind"):
            try:
                self.metrics.cache_blind.remove(worker)
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
