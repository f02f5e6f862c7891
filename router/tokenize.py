"""Prompt -> token ids, exactly as vLLM computes them, because block identity is token-exact.

Per model, one of:
- token-id prompts (``/v1/completions`` with a list of ints) need nothing;
- a local tokenizer (router/local_tokenizer.py: transformers, loaded at start-up from the configured file
  or directory) renders the chat template as vLLM does and encodes the text;
- otherwise a worker's ``/tokenize`` (the chat form for messages), which runs vLLM's own renderer.

Text seen before is not tokenized again: the rendered chat or completions prompt goes through the
prefix cache (router/prefix_cache.py), which reuses the ids of the longest known prefix that ends at a
provably safe cut and encodes only the rest, so a new turn, another question over a known document or the
next agent step costs work in its new text. A start-up self-check and a run-time sample compare cached and
whole encodings and turn the cache off for a tokenizer where they differ. New text longer than
``tokenizer.offload_chars`` is encoded on a thread pool (the tokenizers library releases the GIL there),
off the event loop.
"""
from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jinja2

from router.config import Settings
from router.errors import APIError
from router.local_tokenizer import LocalTokenizer, NotText, Tokenized, flag, template_kwargs
from router.prefix_cache import Lookup, Record

log = logging.getLogger("kvgate.tokenize")

# Fields of a chat request that change the rendered prompt (the /tokenize chat form accepts the same).
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
               "chat_template_kwargs", "tools")


def _shared_ids(local: LocalTokenizer, res: Tokenized, shares: dict[str, tuple[int, bytes]]) -> dict[str, int]:
    """:meth:`LocalTokenizer.shared_ids` of ``res`` for each holder's text (on a pool thread: each compares
    up to four prefix chunks of text, encoded)."""
    return {holder: local.shared_ids(res, nbytes, other, True)[0] for holder, (nbytes, other) in shares.items()}


def _lower_priority(nice: int) -> None:
    """Run this pool thread (and the threads it starts) at a lower CPU priority than the event loop, so
    that tokenizing a long prompt yields the CPU to request handling (Linux: nice is per thread)."""
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError):  # not Linux, or not permitted: run at the normal priority
            pass


class Tokenizers:
    """Per-model tokenization: local tokenizers loaded by :meth:`load`, a worker's /tokenize otherwise."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.client = client
        self.local: dict[str, LocalTokenizer] = {}
        self._pool = ThreadPoolExecutor(max(1, settings.tokenizer.threads), thread_name_prefix="kvgate-tok",
                                        initializer=_lower_priority, initargs=(settings.tokenizer.pool_nice,))
        # The tokenizers library spreads a batch over its own thread pool, sized once, at first use, from
        # RAYON_NUM_THREADS: leave a core to the event loop (a batch on every core starves it).
        n = settings.tokenizer.batch_threads or max(1, (os.cpu_count() or 2) - 1)
        os.environ.setdefault("RAYON_NUM_THREADS", str(n))
        self._reused = 0

    def load(self) -> None:
        """Load every configured tokenizer (blocking: call it at start-up, in a thread)."""
        for model, cfg in self.settings.models.items():
            if cfg.tokenizer:
                self.local[model] = LocalTokenizer(cfg.tokenizer, self.settings.tokenizer)
                log.info("tokenizer for %s loaded from %s (prefix cache cuts: %s)", model, cfg.tokenizer,
                         self.local[model].cuts)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def for_model(self, model: str, namespace: str | None = None) -> LocalTokenizer | None:
        return self.local.get(model) or (self.local.get(namespace) if namespace else None)

    async def tokenize(self, model: str, kind: str, body: dict, *, size: int, namespace: str | None = None,
                       worker_url: str | None = None, hashing: tuple | None = None, reach=None,
                       sent=None) -> Tokenized:
        """Token ids of a request's prompt. ``kind`` is "chat" or "completion"; ``size`` the body's bytes
        (large chats are rendered on the thread pool); ``hashing`` (block size, LoRA name, cache_salt) has
        the block hashes computed with the ids, on the pool when the new text is large. ``reach``
        (``async (block hashes) -> leading blocks the index shows on some worker or G4``) lets a long
        new text be encoded only as far as a cached prefix can extend (:meth:`_encode_start`). ``sent``
        (``(UTF-8 text, ids put before it) -> {holder: (bytes shared, that prompt's text)}``): deferred
        prompts still in flight that share the text's start; that much is encoded, and ``shared_ids`` says
        how many ids each holder's prompt has in common with it.
        Returns ``tokens=None`` for a prompt it cannot
        tokenize (the request is routed on load alone); raises a 400 for a template that refuses the
        conversation or a prompt that is not valid UTF-8."""
        if body.get("truncate_prompt_tokens") is not None:
            # vLLM prefills only the prompt's last tokens then: the whole prompt's blocks are not what it
            # computes or caches (a lookup would match nothing it holds, and the pending record would claim
            # blocks it never computed)
            return Tokenized(None, "none", error="truncate_prompt_tokens: vLLM keeps only the prompt's end")
        if kind == "completion":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:
                first = prompt[0]
                if isinstance(first, int):
                    return Tokenized(prompt if all(isinstance(t, int) for t in prompt) else None, "ids")
                if isinstance(first, list):
                    return Tokenized(first if all(isinstance(t, int) for t in first) else None, "ids")
                if isinstance(first, str):
                    prompt = first
            if not isinstance(prompt, str):
                return Tokenized(None, "none", error="no text prompt")
        elif not isinstance(body.get("messages"), list):
            return Tokenized(None, "none", error="no messages")
        local = self.for_model(model, namespace)
        if local is None:
            if worker_url is None or self.client is None:
                return Tokenized(None, "none", error="no tokenizer and no worker")
            if kind == "chat" and body.get("documents"):  # vLLM's /tokenize takes none: other ids
                return Tokenized(None, "none", error="documents: the worker's /tokenize cannot render them")
            return await self._remote(model, kind, body, worker_url)
        try:
            if kind == "chat":
                text = (await self._off_loop(local.render_chat, body)
                        if size > self.settings.tokenizer.offload_render_chars else local.render_chat(body))
                add_special = flag(body, "add_special_tokens", False)
            else:
                text, add_special = prompt, flag(body, "add_special_tokens", True)
            return await self._encode(local, text, add_special, hashing, reach, sent)
        except NotText as e:
            return Tokenized(None, "none", error=str(e) or "non-text content")
        except APIError:
            raise
        except jinja2.TemplateError as e:  # the template itself refused the conversation (vLLM answers 400 too)
            raise APIError(400, f"The chat template could not be rendered: {e}", code="invalid_chat_template",
                           param="messages") from None
        except Exception as e:  # anything else must not fail routing; vLLM will answer the client
            return Tokenized(None, "none", error=f"local tokenizer: {type(e).__name__}: {e}")

    async def _encode(self, local: LocalTokenizer, text: str, add_special: bool, hashing: tuple | None,
                      reach=None, sent=None) -> Tokenized:
        limit = self.settings.tokenizer.offload_chars
        if local.small(text, add_special):
            res = local.encode_small(text, add_special)
            self._sample(local, res, text, add_special)
            return res
        lk = local.prepare(text, add_special)
        if lk is None:
            ids = (await self._off_loop(local.encode_released, text, add_special) if len(text) > limit
                   else local.encode(text, add_special))
            return Tokenized(array.array("I", ids), "local", 0, len(text))
        shares = sent(lk.data, local.wrap[0] if add_special else ()) if sent is not None and hashing else None
        staged, whole = 0, False
        if shares:
            top = max(n for n, _ in shares.values())
            lk, staged, whole = await self._encode_shared(local, lk, text, add_special, hashing, top)
        res = None
        stage = self.settings.tokenizer.defer_tail_bytes
        if reach is not None and not whole and stage and hashing and hashing[0] > 0 and lk.new_bytes > 2 * stage:
            res = await self._encode_start(local, lk, add_special, hashing, reach, stage)
            if res is None:
                lk = local.prepare(text, add_special)  # encoded in stages all the way: the cache knows them
        if res is None:
            rec = (await self._off_loop(local.build, lk, add_special, hashing, True) if lk.new_bytes > limit
                   else local.build(lk, add_special, hashing))
            res = local.finish(lk, rec, add_special)
            self._sample(local, res, text, add_special)
        if shares:
            res.shared_ids = {} if res.record is None else await self._shared(local, res, shares)
            res.reused_bytes, res.new_bytes = res.reused_bytes - staged, res.new_bytes + staged
        return res

    async def _shared(self, local: LocalTokenizer, res: Tokenized,
                      shares: dict[str, tuple[int, bytes]]) -> dict[str, int]:
        """The ids ``res`` shares with each holder's deferred prompt: on the event loop while the comparisons
        encode at most ``offload_chars`` bytes in all (they mostly stop a piece past the shared bytes), the
        rest in one pool job. A pool round trip cost 7-15 ms of wall time per request on a busy 2-core
        simulator run (its thread's and the loop's wake-ups) for ~0.5 ms of encoding; nearly every request
        shares a start with some deferred prompt there (a common first block)."""
        out: dict[str, int] = {}
        rest: dict[str, tuple[int, bytes]] = {}
        budget = self.settings.tokenizer.offload_chars
        for holder, (nbytes, other) in shares.items():
            n, used = local.shared_ids(res, nbytes, other, budget=budget) if budget > 0 else (None, 0)
            budget -= used
            if n is None:
                rest[holder] = (nbytes, other)
            else:
                out[holder] = n
        if rest:
            out.update(await self._off_loop(_shared_ids, local, res, rest))
        return out

    async def _encode_shared(self, local: LocalTokenizer, lk: Lookup, text: str, add_special: bool,
                             hashing: tuple, nbytes: int) -> tuple[Lookup, int, bool]:
        """Encode the prompt past ``nbytes`` (it shares that much with a deferred prompt in flight), to the
        next fine cut, kept as a start: the worker sent that prompt will hold those blocks, whether or not
        the index reaches them. The lookup of the whole text afterwards, the bytes encoded, and whether
        to encode the whole text (no fine cut after ``nbytes``)."""
        cut = local.prefix.cut_after(lk.data, nbytes)
        if cut is None:
            return lk, 0, True
        if cut <= lk.known_bytes:
            return lk, 0, False
        sub, _ = await self._keep_start(local, lk.data, cut, add_special, hashing)
        return local.prepare(text, add_special), sub.new_bytes, False

    async def _keep_start(self, local: LocalTokenizer, data: bytes, cut: int, add_special: bool,
                          hashing: tuple) -> tuple[Lookup, Record]:
        """Encode ``data[:cut]`` (on the pool when its new part is long) and keep it in the prefix cache
        as a start: its lookup and the record kept."""
        sub = local.prepare(data[:cut].decode("utf-8"), add_special)
        rec = (await self._off_loop(local.build_start, sub, add_special, hashing, True)
               if sub.new_bytes > self.settings.tokenizer.offload_chars
               else local.build_start(sub, add_special, hashing))
        return sub, local.prefix.commit(sub, rec)

    async def _encode_start(self, local: LocalTokenizer, lk: Lookup, add_special: bool, hashing: tuple,
                            reach, stage: int) -> Tokenized | None:
        """Encode a long new text in stages, ``stage`` bytes and then four times more each, while some
        worker's (or G4's) indexed prefix covers every full block encoded so far. Where it
        stops, the rest of the prompt can be cached nowhere, so its ids would change no routing choice:
        the request is planned on the start's blocks and the estimated length, and nothing more is
        encoded (the next request that extends further encodes from where this one stopped). A known
        start nobody holds is not extended at all. Each start is kept in the prefix cache. None: the
        stages reached the end; encode the rest as usual."""
        data = lk.data
        pre = local.wrap[0] if add_special else ()
        post = local.wrap[1] if add_special else ()

        async def held(rec: Record, nbytes: int, ntokens: int, per_byte: float) -> Tokenized | None:
            """The start ``data[:nbytes]`` (``ntokens`` ids of ``rec``) as a deferred prompt when nobody
            holds all its blocks, else None."""
            toks = rec.tokens if ntokens == len(rec.tokens) else rec.tokens[:ntokens]
            res = Tokenized(array.array("I", pre) + toks if pre else toks, "local", lk.known_bytes,
                            nbytes - lk.known_bytes, record=rec, pre=pre, cache=local.prefix,
                            total_tokens=len(pre) + ntokens + round((len(data) - nbytes) * per_byte) + len(post))
            hashes = res.block_hashes(*hashing)
            if hashes and await reach(hashes) >= len(hashes):
                return None
            local.deferred_bytes += len(data) - nbytes
            res.text = data
            return res

        known, known_tokens = lk.known_bytes, lk.known_tokens
        # A start is found again through the text's anchors only: it must hold the first one past the
        # known part, and the bytes that decided it (a stage shorter than the anchor spacing would not).
        nxt = next((a for a, _ in lk.keys if a > known), None)
        floor = 0 if nxt is None else nxt + local.prefix.cut.context
        if lk.source is not None and known_tokens:
            res = await held(lk.source, known, known_tokens, known_tokens / max(1, known))
            if res is not None:
                local.prefix.touch(lk)
                return res
        while len(data) - known > 2 * stage:
            cut = local.prefix.cut_after(data, max(known + stage, floor))
            if cut is None or cut >= len(data):
                return None
            _, rec = await self._keep_start(local, data, cut, add_special, hashing)
            res = await held(rec, cut, len(rec.tokens), (len(rec.tokens) - known_tokens) / max(1, cut - known))
            if res is not None:
                return res
            known, known_tokens = cut, len(rec.tokens)
            stage *= 4
        return None

    def _sample(self, local: LocalTokenizer, res: Tokenized, text: str, add_special: bool) -> None:
        """Re-encode every ``verify_every``-th reused text whole, off the loop (a mismatch turns the cache off)."""
        every = self.settings.tokenizer.prefix_verify_every
        if not every or not res.reused_bytes:
            return
        self._reused += 1
        if self._reused % every:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.run_in_executor(self._pool, local.check, text, res.tokens, add_special)

    def cache_stats(self) -> dict[str, dict]:
        """Per model: the prefix cache's hits, misses, bytes held, bytes reused/encoded, seconds saved."""
        out = {}
        for model, lt in self.local.items():
            c = lt.prefix
            out[model] = {"cuts": lt.cuts, "mismatches": lt.mismatches, "saved_seconds": lt.saved_s,
                          "deferred_bytes": lt.deferred_bytes,
                          **({"hits": c.hits, "misses": c.misses, "bytes": c.bytes, "records": len(c),
                              "reused_bytes": c.reused_bytes, "encoded_bytes": c.encoded_bytes} if c else {}),
                          **({"segment_reused_chars": sm.reused_chars, "segment_encoded_chars": sm.encoded_chars,
                              "segment_bytes": sm.bytes, "segment_pieces": len(sm)} if (sm := lt.segments) else {})}
        return out

    async def load_async(self) -> None:
        """:meth:`load` on the tokenizer pool: the tokenizers library starts its batch threads on first use,
        from the calling thread, whose lower priority they inherit."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self.load)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _remote(self, model: str, kind: str, body: dict, worker_url: str) -> Tokenized:
        if kind == "chat":
            req = {"model": model, "messages": body["messages"]}
            req.update({k: body[k] for k in CHAT_FIELDS if k in body})
            # /tokenize takes no reasoning_effort: the template gets it (and enable_thinking) through its
            # kwargs, as vLLM's chat completion gives them (template_kwargs)
            try:
                kw = template_kwargs(body)
            except NotText as e:
                return Tokenized(None, "none", error=str(e))
            extra = {k: v for k, v in kw.items() if k not in ("add_generation_prompt", "continue_final_message")}
            if extra:
                req["chat_template_kwargs"] = extra
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list):
                prompt = prompt[0]
            req = {"model": model, "prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        try:
            r = await self.client.post(worker_url + "/tokenize", content=json.dumps(req),
                                       headers={"content-type": "application/json"},
                                       timeout=max(5.0, self.settings.connect_timeout_s))
            if r.status_code != 200:
                return Tokenized(None, "none", error=f"/tokenize answered {r.status_code}")
            tokens = r.json().get("tokens")
            if not isinstance(tokens, list):
                return Tokenized(None, "none", error="/tokenize: no tokens")
            return Tokenized(tokens, "remote")
        except (httpx.HTTPError, ValueError) as e:
            return Tokenized(None, "none", error=f"/tokenize: {type(e).__name__}")
