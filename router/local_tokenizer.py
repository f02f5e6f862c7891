"""One model's own tokenizer and chat template (transformers, loaded once at start-up): a request's prompt
rendered and encoded exactly as vLLM does (``add_special_tokens`` False for chat and True for completions
unless the request says otherwise; ``add_generation_prompt``, ``continue_final_message``,
``chat_template``, ``chat_template_kwargs``, ``tools``, ``documents``), because block identity is
token-exact.

Its encodings go through the prefix cache (router/prefix_cache.py): text seen before is not encoded again.
A start-up self-check compares cached and whole encodings and turns the cache off for a tokenizer where
they differ. The work here is synchronous and pure; router/tokenize.py decides what runs on the event loop
and what on its thread pool.
"""
from __future__ import annotations

import array
import json
import logging
import re
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from cachetools import LRUCache
from pydantic import TypeAdapter

from indexer.hashing import routable_blocks, sequence_hashes
from router.config import TokenizerConfig
from router.errors import APIError
from router.prefix_cache import Lookup, PrefixTokenCache, Record, block_hashes, cut_rule

log = logging.getLogger("kvgate.tokenize")


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
    """vLLM's "string" content format: text parts joined with newlines, empty ones left out (vLLM keeps only
    non-empty parts). Other parts cannot be rendered here (their placeholder tokens come from the
    multimodal processor)."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise APIError(400, "each message must be an object", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    text = part
                elif isinstance(part, dict) and part.get("type") == "text":
                    text = str(part.get("text", ""))
                else:
                    raise NotText()
                if text:
                    texts.append(text)
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


class NotText(Exception):
    pass


_BOOL = TypeAdapter(bool)


def flag(body: dict, key: str, default: bool) -> bool:
    """A request's boolean field read as vLLM's pydantic models read it (``"false"``, ``"0"``, ``"off"`` are
    False: ``bool("false")`` rendered a generation prompt or a BOS token vLLM did not, and every block
    differed). A value they refuse (vLLM answers 400) is routed on load."""
    v = body.get(key, default)
    if isinstance(v, bool):
        return v
    try:
        return _BOOL.validate_python(v)
    except ValueError:
        raise NotText(f"{key}: not a boolean vLLM accepts") from None


def vllm_tools(tools):
    """``tools`` as vLLM hands them to the chat template: each parsed into its request models and dumped
    (``ChatCompletionToolsParam.model_dump()``, vLLM 0.32): ``type``, then ``function`` with ``name``,
    ``description`` and ``parameters`` in that order (null when absent), ``strict`` and ``defer_loading``
    only when set (a tool's ``defer_loading`` given to its function too), other keys dropped. The client's
    own dicts rendered other text for a tool without a description or with its keys in another order, and
    every block from the tools on missed. A shape vLLM refuses is routed on load."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise NotText("tools: a shape vLLM refuses")
    out = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function" or not isinstance(f.get("name"), str):
            raise NotText("tools: a shape vLLM refuses")
        fn = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        defer = f.get("defer_loading") if f.get("defer_loading") is not None else t.get("defer_loading")
        if defer is not None:
            fn["defer_loading"] = defer
        tool = {"type": "function", "function": fn}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


_UNSET = (None, "auto")  # vLLM's merge_kwargs: a request field set to one of these leaves the client's
_NOT_TEMPLATE_KWARGS = ("chat_template", "tokenize")  # vLLM refuses them (400); not passed on here


def template_kwargs(body: dict) -> dict:
    """The chat template's keyword arguments as vLLM 0.32 builds them for a chat completion
    (``ChatCompletionRequest.build_chat_params``): the client's ``chat_template_kwargs``, then the
    request's ``add_generation_prompt``, ``continue_final_message``, ``documents`` and ``reasoning_effort``
    over them where set, and ``enable_thinking`` (``reasoning_effort != "none"``) when a reasoning effort
    is asked and the client's kwargs do not set it. A reasoning model's template (``reasoning_effort``,
    ``enable_thinking``) rendered other text without them, and every block after the system prompt missed."""
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, dict):
        raise NotText("chat_template_kwargs: not an object")
    out = {k: v for k, v in user.items() if k not in _NOT_TEMPLATE_KWARGS}
    effort = body.get("reasoning_effort")
    extra = {"add_generation_prompt": flag(body, "add_generation_prompt", True),
             "continue_final_message": flag(body, "continue_final_message", False),
             "documents": body.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    out.update((k, v) for k, v in extra.items() if v not in _UNSET)
    return out


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

        tools = vllm_tools(body.get("tools"))
        template = self.hf.get_chat_template(body.get("chat_template"), tools)
        # as apply_chat_template: the tokenizer's special tokens, then the template's kwargs
        # (continue_final_message is not a template variable there; a plain chat has it False)
        ctx = {**self.special_map, **kwargs}
        ctx.pop("continue_final_message", None)
        return _compile_jinja_template(template).render(messages=messages, tools=tools, **ctx)

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
                             {"messages": conv, "chat_template_kwargs": {"enable_thinking": False}},
                             {"messages": conv, "reasoning_effort": "low"}):
                    kwargs = template_kwargs(body)
                    want = self.hf.apply_chat_template(conv, tools=vllm_tools(body.get("tools")), tokenize=False,
                                                       **kwargs)
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
        kwargs = template_kwargs(body)
        if self.fast_render and _plain_chat(messages, body):
            return self._render_fast(messages, body, kwargs)
        return self.hf.apply_chat_template(messages, tools=vllm_tools(body.get("tools")),
                                           chat_template=body.get("chat_template"), tokenize=False, **kwargs)

    def tokenize_chat(self, body: dict) -> Tokenized:
        """A chat request's ids, synchronously (the request path uses :class:`Tokenizers`)."""
        return self.tokenize_text_sync(self.render_chat(body), flag(body, "add_special_tokens", False))

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
