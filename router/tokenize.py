"""Prompt -> token ids, exactly as vLLM computes them, because block identity is token-exact.

Per model, one of:
- token-id prompts (``/v1/completions`` with a list of ints) need nothing;
- a local tokenizer (transformers, loaded at start-up from the configured file or directory) renders the
  chat template as vLLM does (``add_special_tokens`` False for chat and True for completions unless the
  request says otherwise; ``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
  ``chat_template_kwargs``, ``tools``, ``documents``) and encodes the text;
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
import re
import threading
import time
from bisect import bisect_right
from collections.abc import Sequence
from itertools import islice
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jinja2
from cachetools import LRUCache

from indexer.hashing import routable_blocks, sequence_hashes
from router.config import Settings, TokenizerConfig
from router.errors import APIError
from router.prefix_cache import Lookup, PrefixTokenCache, Record, block_hashes, cut_rule

log = logging.getLogger("kvgate.tokenize")

# Fields of a chat request that change the rendered prompt (the /tokenize chat form accepts the same).
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
               "chat_template_kwargs", "tools")


@dataclass
class Tokenized:
    """A prompt's token ids (``array('I')`` from the local tokenizer) and, when they came from the prefix
    cache, the record whose memoised block hashes they share."""

    tokens: Sequence[int] | None  # None: could not tokenize (route on load only)
    source: str  # "ids", "local", "remote", "none"
    reused_bytes: int = 0  # text whose ids came from the prefix cache
    new_bytes: int = 0  # text encoded for this request
    error: str | None = None
    record: Record | None = None
    pre: tuple[int, ...] = ()
    post: tuple[int, ...] = ()
    cache: PrefixTokenCache | None = None
    # Set when ``tokens`` are only the prompt's start (its tail was deferred: no worker's prefix reaches
    # it): the prompt's length, estimated from the bytes per token of the part encoded.
    total_tokens: int | None = None
    # A deferred prompt's whole text (UTF-8), kept while it is in flight (router/pending.py).
    text: bytes | None = None
    # Per holder of a deferred prompt in flight that shares this one's start (``sent`` in
    # Tokenizers.tokenize): how many leading ids of this prompt (after ``pre``) the two share.
    shared_ids: dict[str, int] | None = None

    def block_hashes(self, block_size: int, lora_name: str | None, cache_salt: str | None) -> list[int]:
        """kvgate's keys of the prompt's routable blocks (memoised on the prefix-cache record); of a
        deferred prompt, every full block of its start."""
        if self.total_tokens is not None:
            return block_hashes(self.record, self.pre, (), block_size, lora_name, cache_salt,
                                len(self.tokens) // block_size, self.cache)
        n = routable_blocks(len(self.tokens), block_size)
        if self.record is not None:
            return block_hashes(self.record, self.pre, self.post, block_size, lora_name, cache_salt, n,
                                self.cache)
        return sequence_hashes(self.tokens, block_size, lora_name=lora_name, cache_salt=cache_salt, max_blocks=n)


def normalize_messages(messages: list) -> list[dict]:
    """vLLM's "string" content format: text parts joined with newlines. Other parts cannot be rendered
    here (their placeholder tokens come from the multimodal processor)."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise APIError(400, "each message must be an object", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                else:
                    raise _NotText()
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


class _NotText(Exception):
    pass


_PLAIN_KEYS = frozenset({"role", "content", "name"})


def _plain_chat(messages: list[dict], body: dict) -> bool:
    """A conversation the direct renderer reproduces exactly: string roles/contents only (no None values,
    reasoning fields or tool calls, which apply_chat_template rewrites), no continue_final_message."""
    if body.get("continue_final_message") or body.get("documents") is not None:
        return False
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return False
    for m in messages:
        if not _PLAIN_KEYS.issuperset(m):
            return False
        for v in m.values():
            if type(v) is not str:
                return False
    return True


def _not_utf8() -> APIError:
    return APIError(400, "The prompt is not valid UTF-8 (it holds a lone surrogate).", code="invalid_prompt")


class SegmentMemo:
    """Ids of the pieces of short texts between special tokens, by their exact text (a dict key: the whole
    text decides, never a hash), LRU-bounded by bytes. A small chat repeats its system prompt and role
    headers and differs in its last message; this keeps the repeated pieces' ids."""

    MAX_PIECE_CHARS = 1024  # longer pieces are encoded and not kept (few repeat)

    def __init__(self, specials: list[bytes], max_bytes: int) -> None:
        alts = sorted({s.decode("utf-8") for s in specials}, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, alts)) + ")").split
        self._ids: LRUCache = LRUCache(maxsize=max_bytes, getsizeof=lambda v: v[0])
        self.reused_chars = self.encoded_chars = 0

    def get(self, piece: str) -> array.array | None:
        hit = self._ids.get(piece)
        return None if hit is None else hit[1]

    def put(self, piece: str, ids: list[int]) -> array.array:
        a = array.array("I", ids)
        # the key's characters (up to 4 bytes each), the ids, and the dict and object overheads
        size = 4 * len(piece) + 4 * len(a) + 200
        if len(piece) <= self.MAX_PIECE_CHARS and size <= self._ids.maxsize:
            self._ids[piece] = (size, a)
        return a

    @property
    def bytes(self) -> int:
        return int(self._ids.currsize)

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        self._ids.clear()
        self.reused_chars = self.encoded_chars = 0


class LocalTokenizer:
    """A model's own tokenizer and chat template, loaded once at start-up."""

    def __init__(self, path: str, cfg: TokenizerConfig) -> None:
        from transformers import AutoTokenizer

        p = Path(path)
        src = p.parent if p.is_file() else p
        self.path = str(p)
        self.hf = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        self.fast = getattr(self.hf, "_tokenizer", None) or getattr(self.hf, "backend_tokenizer", None)
        if self.fast is None:
            raise ValueError(f"{path}: a fast (tokenizers) tokenizer is required")
        specials: list[str] = []
        splittable = True
        for tok in self.fast.get_added_tokens_decoder().values():
            if tok.lstrip or tok.rstrip or tok.single_word:
                splittable = False
            if not tok.normalized:
                specials.append(tok.content)
        self.cfg = cfg
        # transformers rebuilds this dict on every access (a per-request cost on the render path); it is fixed
        self.special_map = dict(self.hf.special_tokens_map)
        cut, self.cuts = cut_rule(json.loads(self.fast.to_str()), specials, splittable)
        self.prefix = (PrefixTokenCache(cut, max_bytes=cfg.prefix_cache_bytes, chunk_bytes=cfg.prefix_chunk_bytes,
                                        cut_bytes=cfg.prefix_cut_bytes) if cut is not None and cfg.prefix_cache_bytes
                       else None)
        self.segments = (SegmentMemo(cut.specials, cfg.segment_cache_bytes)
                         if self.prefix is not None and cut.specials and cfg.segment_cache_bytes else None)
        self.mismatches = 0
        self.deferred_bytes = 0  # prompt bytes never encoded: past every cached prefix (Tokenizers._encode_start)
        self.seconds_per_byte = 0.0  # encoding speed (EWMA), for the time the cache saves
        self.saved_s = 0.0
        self.wrap = self._special_wrap()
        if self.prefix is not None and not self._self_check():
            self.prefix = self.segments = None
            self.cuts = "off (self-check)"
        self.fast_render = self._render_check()

    def _special_wrap(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The ids ``add_special_tokens`` puts before and after a text (BOS, ...), when it only wraps it."""
        found = None
        for probe in ("hello world", "x", "Tokens 123.\n"):
            plain, full = self.encode(probe, False), self.encode(probe, True)
            i = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
            if not plain or i is None:
                return None
            wrap = (tuple(full[:i]), tuple(full[i + len(plain):]))
            if found is not None and wrap != found:
                return None
            found = wrap
        return found

    def _render_fast(self, messages: list[dict], body: dict, kwargs: dict) -> str:
        """The chat template rendered directly with transformers' compiled template (the same Jinja
        environment apply_chat_template uses), skipping its generic per-leaf normalization of the
        conversation, which costs milliseconds on a long chat. Used only for plain JSON conversations
        (see ``_plain_chat``) and only when a start-up check shows identical output."""
        from transformers.utils.chat_template_utils import _compile_jinja_template

        tools = body.get("tools")
        template = self.hf.get_chat_template(body.get("chat_template"), tools)
        return _compile_jinja_template(template).render(
            messages=messages, tools=tools, documents=body.get("documents"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            **{**self.special_map, **kwargs})

    def _render_check(self) -> bool:
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template  # noqa: F401
        except ImportError:
            return False
        convs = [
            [{"role": "user", "content": "Hi there"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\n b "},
             {"role": "assistant", "content": " ok.\n"}, {"role": "user", "content": "again"}],
        ]
        tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
        try:
            for conv in convs:
                for body in ({"messages": conv}, {"messages": conv, "add_generation_prompt": False},
                             {"messages": conv, "tools": tools},
                             {"messages": conv, "chat_template_kwargs": {"enable_thinking": False}}):
                    kwargs = dict(body.get("chat_template_kwargs") or {})
                    want = self.hf.apply_chat_template(
                        conv, tools=body.get("tools"), add_generation_prompt=body.get("add_generation_prompt", True),
                        tokenize=False, **kwargs)
                    if self._render_fast(conv, body, kwargs) != want:
                        log.warning("%s: direct template rendering differs; using apply_chat_template", self.path)
                        return False
        except Exception as e:
            log.warning("%s: direct template rendering unavailable (%s)", self.path, e)
            return False
        return True

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        """``encode`` for a thread pool: tokenizers' ``encode`` holds the GIL while it works (measured: a
        spinning thread ran at a fifth of its speed beside it), ``encode_batch`` releases it."""
        return self.fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pieces(self, pieces: list[str], off_loop: bool = False) -> list[list[int]]:
        """Ids of each piece: a few one by one on the loop; off the loop, or many, as one batch (the
        tokenizers library releases the GIL for a batch and spreads it over cores; for a few small pieces
        its thread hand-off costs more than it saves)."""
        t = time.perf_counter()
        if len(pieces) <= 8 and not off_loop:
            enc = self.fast.encode
            out = [enc(p, add_special_tokens=False).ids for p in pieces]
        else:
            out = [e.ids for e in self.fast.encode_batch(pieces, add_special_tokens=False)]
        n = sum(map(len, pieces))
        if n >= 1024:
            spb = (time.perf_counter() - t) / n
            self.seconds_per_byte = spb if not self.seconds_per_byte else 0.9 * self.seconds_per_byte + 0.1 * spb
        return out

    def prepare(self, text: str, add_special_tokens: bool) -> Lookup | None:
        """What the prefix cache knows of ``text`` (None: encode it whole). Cheap; runs on the loop."""
        if self.prefix is None or (add_special_tokens and self.wrap is None):
            return None
        try:
            return self.prefix.lookup(text)
        except UnicodeEncodeError:
            raise _not_utf8() from None

    def small(self, text: str, add_special_tokens: bool) -> bool:
        """Whether ``text`` takes :meth:`encode_small`: too short to hold a prefix-cache anchor, so its
        record could never be found again (raises the 400 for text that is not valid UTF-8)."""
        if self.segments is None or (add_special_tokens and self.wrap is None) or len(text) >= self.prefix.chunk:
            return False
        try:
            return len(text.encode("utf-8")) < self.prefix.chunk
        except UnicodeEncodeError:
            raise _not_utf8() from None

    def encode_small(self, text: str, add_special_tokens: bool) -> Tokenized:
        """A short text's ids: its pieces between special tokens from the segment memo, the rest encoded
        (the tokenizer splits at those tokens before anything else, so the pieces encode alone)."""
        memo = self.segments
        pre, post = self.wrap if add_special_tokens else ((), ())
        ids = array.array("I", pre)
        reused = 0
        enc = self.fast.encode
        for part in memo.split(text):
            if not part:
                continue
            hit = memo.get(part)
            if hit is None:
                hit = memo.put(part, enc(part, add_special_tokens=False).ids)
            else:
                reused += len(part)
            ids.extend(hit)
        if post:
            ids.extend(post)
        memo.reused_chars += reused
        memo.encoded_chars += len(text) - reused
        return Tokenized(ids, "local", reused, len(text) - reused)

    def build(self, lk: Lookup, add_special_tokens: bool, hashing: tuple | None, off_loop: bool = False):
        """Encode what ``lk`` does not know and assemble the record, with the block hashes for ``hashing``
        (block size, LoRA name, cache_salt) when given. Pure: runs on the pool for large new text."""
        rec = self.prefix.build(lk, lambda pieces: self.encode_pieces(pieces, off_loop))
        if hashing is not None and hashing[0] > 0:
            pre, post = self.wrap if add_special_tokens else ((), ())
            n = len(pre) + len(rec.tokens) + len(post)
            block_hashes(rec, pre, post, hashing[0], hashing[1], hashing[2], routable_blocks(n, hashing[0]))
        return rec

    def build_start(self, lk: Lookup, add_special_tokens: bool, hashing: tuple, off_loop: bool = False) -> Record:
        """:meth:`build` for the start of a prompt (``lk``'s text ends at a fine cut of the whole one):
        the end is kept as a cut, so the whole prompt reuses every id, and every full block is hashed."""
        rec = self.prefix.build(lk, lambda pieces: self.encode_pieces(pieces, off_loop))
        if not lk.exact and (not rec.cut_pos or rec.cut_pos[-1] < len(rec.data)):
            rec.cut_pos.append(len(rec.data))
            rec.cut_tok.append(len(rec.tokens))
        pre = self.wrap[0] if add_special_tokens else ()
        block_hashes(rec, pre, (), hashing[0], hashing[1], hashing[2], (len(pre) + len(rec.tokens)) // hashing[0])
        return rec

    def shared_ids(self, res: Tokenized, nbytes: int, other: bytes, off_loop: bool = False,
                   budget: int | None = None) -> tuple[int | None, int]:
        """How many leading ids (after ``res.pre``) ``res``'s prompt has in common with the whole encoding
        of ``other``, a text whose first ``nbytes`` bytes are the prompt's: the ids before the prompt's
        last fine cut whose deciding bytes both share (a cut of both, so both encode the same ids before
        it), then the two encodings compared past it until they differ; and the bytes of ``other`` it
        encoded. ``off_loop``: on a pool thread (encode releasing the GIL). ``budget``: encode at most
        that many bytes (on the event loop); None for the count when the comparison needs more."""
        rec, cut = res.record, self.prefix.cut
        encode = self.encode_released if off_loop else self.encode
        encoded = res.reused_bytes + res.new_bytes  # a deferred prompt: its start only
        i = bisect_right(rec.cut_pos, min(encoded, nbytes - cut.context - 1)) - 1
        q, base = (rec.cut_pos[i], rec.cut_tok[i]) if i >= 0 else (0, 0)
        off = len(res.pre) + base
        mine = res.tokens[off:len(res.tokens) - len(res.post)]
        # Past q, ``other`` piece by piece (its fine cuts) against the prompt's own ids: ids can agree past
        # where the bytes differ (a tokenizer that maps both to the same id), so compare until they differ.
        k, start, limit = 0, q, q + 4 * self.prefix.chunk
        while k < len(mine) and start < len(other):
            end = self.prefix.cut_after(other, max(start + 1, nbytes)) or len(other)
            if end > limit:
                break
            if budget is not None and end - q > budget:
                return None, start - q
            for x, y in zip(islice(mine, k, None), encode(other[start:end].decode("utf-8"), False)):
                if x != y:
                    return base + k, end - q
                k += 1
            start = end
        return base + k, start - q

    def finish(self, lk: Lookup, rec: Record, add_special_tokens: bool) -> Tokenized:
        """Keep the record and assemble the prompt's ids (on the loop)."""
        rec = self.prefix.commit(lk, rec)
        self.saved_s += lk.known_bytes * self.seconds_per_byte
        pre, post = self.wrap if add_special_tokens else ((), ())
        tokens = rec.tokens
        if pre or post:
            tokens = array.array("I", pre) + tokens + array.array("I", post)
        return Tokenized(tokens, "local", lk.known_bytes, lk.new_bytes, record=rec, pre=pre, post=post,
                         cache=self.prefix)

    def tokenize_text_sync(self, text: str, add_special_tokens: bool) -> Tokenized:
        if self.small(text, add_special_tokens):
            return self.encode_small(text, add_special_tokens)
        lk = self.prepare(text, add_special_tokens)
        if lk is None:
            return Tokenized(array.array("I", self.encode(text, add_special_tokens)), "local", 0, len(text))
        return self.finish(lk, self.build(lk, add_special_tokens, None), add_special_tokens)

    def render_chat(self, body: dict) -> str:
        messages = normalize_messages(body["messages"])
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if self.fast_render and _plain_chat(messages, body):
            return self._render_fast(messages, body, kwargs)
        return self.hf.apply_chat_template(
            messages, tools=body.get("tools"), documents=body.get("documents"),
            chat_template=body.get("chat_template"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            tokenize=False, **kwargs)

    def tokenize_chat(self, body: dict) -> Tokenized:
        """A chat request's ids, synchronously (the request path uses :class:`Tokenizers`)."""
        return self.tokenize_text_sync(self.render_chat(body), bool(body.get("add_special_tokens", False)))

    def tokenize_text(self, text: str, add_special_tokens: bool) -> Tokenized:
        return self.tokenize_text_sync(text, add_special_tokens)

    def check(self, text: str, tokens: Sequence[int], add_special_tokens: bool) -> bool:
        """Whether ``tokens`` equal the whole text's encoding (runs on the pool); a mismatch turns the
        prefix cache off."""
        if list(tokens) == self.encode_released(text, add_special_tokens):
            return True
        self.mismatches += 1
        if self.prefix is not None:
            log.error("%s: prefix-cached ids differ from the whole text's encoding; prefix cache off", self.path)
            self.prefix.clear()
            self.prefix = self.segments = None
            self.cuts = "off (mismatch)"
        return False

    def _self_check(self) -> bool:
        """Cached, extended and whole encodings agree on probes (a chat rendered by the model's template
        and texts with the characters the cut rule looks at)."""
        names = [s for s in (self.special_map.get("bos_token"), self.special_map.get("eos_token"))
                 if isinstance(s, str)] or [""]
        a, b = names[0], names[-1]
        base = (f"{a}user\nhello world{b}\n{a}assistant\n Fine.\nThanks 12345 x\n\n  two  spaces{b}"
                " It's 3.14, isn't it?\nnaïve café 東京 ok\n") * 20
        probes = [base, base + "more words here\nand here", base[:1500] + " different tail\n"]
        try:
            probes.append(self.hf.apply_chat_template(
                [{"role": "user", "content": "Hi there, how are you? " * 30},
                 {"role": "assistant", "content": " Fine.\nThanks " * 30},
                 {"role": "user", "content": "again"}], add_generation_prompt=True, tokenize=False))
        except Exception:
            pass
        saved = self.prefix
        try:
            for text in probes:
                whole = self.encode(text, False)
                if list(self.tokenize_text_sync(text, False).tokens) != whole or (
                        self.segments is not None and list(self.encode_small(text, False).tokens) != whole):
                    log.warning("%s: prefix-cached encoding differs from whole encoding; prefix cache off",
                                self.path)
                    return False
            return True
        finally:
            saved.clear()
            if self.segments is not None:
                self.segments.clear()


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
            return await self._remote(model, kind, body, worker_url)
        try:
            if kind == "chat":
                text = (await self._off_loop(local.render_chat, body)
                        if size > self.settings.tokenizer.offload_render_chars else local.render_chat(body))
                add_special = bool(body.get("add_special_tokens", False))
            else:
                text, add_special = prompt, bool(body.get("add_special_tokens", True))
            return await self._encode(local, text, add_special, hashing, reach, sent)
        except _NotText:
            return Tokenized(None, "none", error="non-text content")
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
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list):
                prompt = prompt[0]
            req = {"model": model, "prompt": prompt,
                   "add_special_tokens": bool(body.get("add_special_tokens", True))}
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
