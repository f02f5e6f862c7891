"""Prompt -> token ids, exactly as vLLM computes them, because block identity is token-exact.

Per model, one of:
- token-id prompts (``/v1/completions`` with a list of ints) need nothing;
- a local tokenizer (transformers, loaded at start-up from the configured file or directory) renders the
  chat template as vLLM does (``add_special_tokens`` False for chat and True for completions unless the
  request says otherwise; ``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
  ``chat_template_kwargs``, ``tools``, ``documents``) and encodes the text;
- otherwise a worker's ``/tokenize`` (the chat form for messages), which runs vLLM's own renderer.

Repeated conversation prefixes are cheap: HF tokenizers split the text at added special tokens before
anything else, so encoding a rendered chat equals concatenating the encodings of the segments between
special tokens. Segment ids are kept in a bounded LRU, and a new turn encodes only its new segments. A
start-up self-check compares segmented and whole encodings and turns the cache off for a tokenizer where
they differ (e.g. a Metaspace pre-tokenizer that treats the first segment specially).
Large prompts are rendered and encoded on a thread pool, off the event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from router.config import Settings, TokenizerConfig
from router.errors import APIError

log = logging.getLogger("kvgate.tokenize")

# Fields of a chat request that change the rendered prompt (the /tokenize chat form accepts the same).
CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
               "chat_template_kwargs", "tools")


@dataclass
class Tokenized:
    tokens: list[int] | None  # None: could not tokenize (route on load only)
    source: str  # "ids", "local", "remote", "none"
    segments: int = 0
    segments_cached: int = 0
    error: str | None = None


class SegmentCache:
    """Bounded LRU: rendered text segment -> token ids (thread-safe; tokenization runs on a pool)."""

    def __init__(self, max_entries: int, max_chars: int) -> None:
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._d: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> list[int] | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                self.misses += 1
                return None
            self._d.move_to_end(key)
            self.hits += 1
            return v

    def put(self, key: str, ids: list[int]) -> None:
        if len(key) > self.max_chars // 4:
            return
        with self._lock:
            if key in self._d:
                return
            self._d[key] = ids
            self._chars += len(key)
            while self._d and (len(self._d) > self.max_entries or self._chars > self.max_chars):
                k, _ = self._d.popitem(last=False)
                self._chars -= len(k)

    def __len__(self) -> int:
        return len(self._d)


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
        self.cache = SegmentCache(cfg.segment_cache_entries, cfg.segment_cache_chars)
        self._specials: dict[str, int] = {}
        splittable = True
        for tid, tok in self.fast.get_added_tokens_decoder().items():
            if tok.lstrip or tok.rstrip or tok.single_word:
                splittable = False
            if not tok.normalized:
                self._specials[tok.content] = tid
        self._split = (re.compile("(" + "|".join(re.escape(s) for s in
                                                sorted(self._specials, key=len, reverse=True)) + ")")
                       if self._specials else None)
        self.segmenting = splittable and self._split is not None and self._self_check()
        self.fast_render = self._render_check()

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
            **{**self.hf.special_tokens_map, **kwargs})

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

    def split_cached(self, text: str) -> tuple[list, int]:
        """Split rendered text at special tokens; each part is a list of ids (a special token or a cached
        segment) or a str still to encode. Returns (parts, characters still to encode)."""
        parts: list = []
        missing = 0
        specials = self._specials
        cache = self.cache
        for piece in self._split.split(text):
            if not piece:
                continue
            sid = specials.get(piece)
            if sid is not None:
                parts.append((sid,))
                continue
            cached = cache.get(piece)
            if cached is None:
                parts.append(piece)
                missing += len(piece)
            else:
                parts.append(cached)
        return parts, missing

    def join_parts(self, parts: list) -> Tokenized:
        """Encode the missing segments (one batch: the tokenizers library spreads it over cores) and join."""
        todo = [p for p in parts if isinstance(p, str)]
        encoded = iter(())
        if todo:
            encs = [e.ids for e in self.fast.encode_batch(todo, add_special_tokens=False)]
            for piece, ids in zip(todo, encs):
                self.cache.put(piece, ids)
            encoded = iter(encs)
        ids: list[int] = []
        segs = 0
        for p in parts:
            if isinstance(p, str):
                ids.extend(next(encoded))
                segs += 1
            elif isinstance(p, tuple):  # a special token
                ids.append(p[0])
            else:
                ids.extend(p)
                segs += 1
        return Tokenized(ids, "local", segs, segs - len(todo))

    def encode_segmented(self, text: str) -> tuple[list[int], int, int]:
        """Encode without special tokens added, reusing cached segment ids. Returns (ids, segments, hits)."""
        t = self.join_parts(self.split_cached(text)[0])
        return t.tokens, t.segments, t.segments_cached

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
        text = self.render_chat(body)
        add_special = bool(body.get("add_special_tokens", False))
        if self.segmenting and not add_special:
            ids, segs, hits = self.encode_segmented(text)
            return Tokenized(ids, "local", segs, hits)
        return Tokenized(self.encode(text, add_special), "local")

    def tokenize_text(self, text: str, add_special_tokens: bool) -> Tokenized:
        return Tokenized(self.encode(text, add_special_tokens), "local")

    def _self_check(self) -> bool:
        names = list(self._specials)[:3] or [""]
        a, b = names[0], names[-1]
        probes = [f"{a}user\nhello world{b}\n{a}assistant\n", f" lead{a} x {b}  two  spaces{a}\n\n",
                  f"{a}{b}tail"]
        try:
            sample = self.hf.apply_chat_template(
                [{"role": "user", "content": "Hi there, how are you?"},
                 {"role": "assistant", "content": " Fine.\nThanks"},
                 {"role": "user", "content": "again"}], add_generation_prompt=True, tokenize=False)
            probes.append(sample)
        except Exception:
            pass
        for text in probes:
            whole = self.encode(text, False)
            self.cache = SegmentCache(self.cache.max_entries, self.cache.max_chars)
            seg, _, _ = self.encode_segmented(text)
            if seg != whole:
                log.warning("%s: segmented encoding differs from whole encoding; segment cache off", self.path)
                return False
        self.cache = SegmentCache(self.cache.max_entries, self.cache.max_chars)
        return True


class Tokenizers:
    """Per-model tokenization: local tokenizers loaded by :meth:`load`, a worker's /tokenize otherwise."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.client = client
        self.local: dict[str, LocalTokenizer] = {}
        self._pool = ThreadPoolExecutor(max(1, settings.tokenizer.threads), thread_name_prefix="kvgate-tok")

    def load(self) -> None:
        """Load every configured tokenizer (blocking: call it at start-up, in a thread)."""
        for model, cfg in self.settings.models.items():
            if cfg.tokenizer:
                self.local[model] = LocalTokenizer(cfg.tokenizer, self.settings.tokenizer)
                log.info("tokenizer for %s loaded from %s (segment cache %s)", model, cfg.tokenizer,
                         "on" if self.local[model].segmenting else "off")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def for_model(self, model: str, namespace: str | None = None) -> LocalTokenizer | None:
        return self.local.get(model) or (self.local.get(namespace) if namespace else None)

    async def tokenize(self, model: str, kind: str, body: dict, *, size: int, namespace: str | None = None,
                       worker_url: str | None = None) -> Tokenized:
        """Token ids of a request's prompt. ``kind`` is "chat" or "completion"; ``size`` the body's bytes
        (large prompts are tokenized on the thread pool). Never raises for a prompt it cannot tokenize:
        it returns ``tokens=None`` and the request is routed on load alone."""
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
        if local is not None:
            try:
                limit = self.settings.tokenizer.offload_chars
                if kind == "chat" and local.segmenting and not body.get("add_special_tokens", False):
                    # Render and look up cached segments here (cheap); encode what is new off the loop
                    # when it is large.
                    render = (local.render_chat, body)
                    text = (await self._off_loop(*render) if size > self.settings.tokenizer.offload_render_chars
                            else render[0](*render[1:]))
                    parts, missing = local.split_cached(text)
                    if missing > limit:
                        return await self._off_loop(local.join_parts, parts)
                    return local.join_parts(parts)
                if kind == "chat":
                    job = (local.tokenize_chat, body)
                else:
                    job = (local.tokenize_text, prompt, bool(body.get("add_special_tokens", True)))
                if size > limit:
                    return await self._off_loop(*job)
                return job[0](*job[1:])
            except _NotText:
                return Tokenized(None, "none", error="non-text content")
            except APIError:
                raise
            except Exception as e:  # a template error must not fail routing; vLLM will answer the client
                return Tokenized(None, "none", error=f"local tokenizer: {e}")
        if worker_url is None or self.client is None:
            return Tokenized(None, "none", error="no tokenizer and no worker")
        return await self._remote(model, kind, body, worker_url)

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
