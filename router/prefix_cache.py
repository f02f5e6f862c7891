"""Prefix-incremental tokenization: text the gateway has tokenized before is not tokenized again.

A prompt usually extends text seen before: the next turn of a chat, another question over the same
document, the next step of an agent. The gateway must tokenize exactly as vLLM does (block identity is
token-exact), so it keeps each tokenized text as a :class:`Record` (UTF-8 bytes, uint32 token ids, and
the block hashes computed from them) and, for a new text, reuses the tokens of the longest cached prefix
that ends at a *safe cut*, tokenizing only the rest.

Safe cuts: encoding ``text[:p]`` and ``text[p:]`` separately gives the same ids as encoding ``text`` when
- ``p`` is next to an added special token that strips nothing (tokenizers split the text at added tokens
  before normalizing or pre-tokenizing it), or
- ``p`` is a word boundary ``[A-Za-z0-9] | [ \\n][A-Za-z]`` and the tokenizer's normalizer works per
  character and its pre-tokenizer ends a piece there and starts the next one from it: GPT-2's ByteLevel
  regex, the Llama-3/Qwen-2 Split regexes before a ByteLevel without prefix space, Whitespace,
  WhitespaceSplit and BERT (:func:`cut_rule` lists what it accepts; anything else gets special-token cuts
  only, or none). The model (BPE, WordPiece, WordLevel) works within pieces, so pieces encode alone.
``tests/gateway/test_prefix_cache.py`` checks the rule as a property over real tokenizers, and a sample
of requests is re-encoded whole at run time (``Tokenizers``): a mismatch turns the cache off for that
tokenizer and is counted on ``/metrics``.

Layout: cut points are the first safe cut at or after every multiple of ``cut_bytes`` (fine cuts); every
``chunk_bytes / cut_bytes``-th of them is an anchor, keyed by a chained XXH3 of the bytes before it. A
lookup walks the text's anchors (one regex search and one hash per ``chunk_bytes``; where an anchor is a
record's, that record's later anchors over the bytes both share are taken without scanning, and the walk
stops at the first anchor no record holds, so a prompt that extends a known one walks only its new part
and an unseen one one anchor; the new record's other anchors are found with its encoding), takes the deepest
anchor whose record's bytes equal the text's (the hash only finds candidates: the bytes decide), extends
the match byte-wise within the record and steps back to its last fine cut. New text is cut at fine cuts
and encoded as one batch (the tokenizers library spreads a batch over cores, without the GIL). Records are
an LRU bounded by bytes. Mutations happen on the event loop thread only; the encoding itself is pure.
"""
from __future__ import annotations

import array
import re
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice

import xxhash

from indexer.hashing import sequence_hashes_from

_xxh3 = xxhash.xxh3_64_intdigest

# Pre-tokenizer regexes (tokenizers' Split patterns) for which the word-boundary cut is shown safe: each
# alternative that can hold an ASCII letter or digit holds no space or newline, and none looks behind.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_SAFE_SPLITS = {
    _GPT2,
    # Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Qwen 2 / 2.5 / 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_CHAR_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "BertNormalizer"}


def _normalizer_ok(n: dict | None) -> bool:
    if n is None:
        return True
    if n.get("type") == "Sequence":
        return all(_normalizer_ok(x) for x in n.get("normalizers", []))
    return n.get("type") in _CHAR_NORMALIZERS


def _pre_ok(p: dict | None) -> bool:
    if p is None:
        return False  # the whole text is one piece: the model may merge across any boundary
    t = p.get("type")
    if t == "Sequence":
        items = p.get("pretokenizers", [])
        return bool(items) and all(_pre_ok(x) or _bytelevel_tail(x) for x in items) and any(_pre_ok(x) for x in items)
    if t == "ByteLevel":
        return not p.get("add_prefix_space", False) and p.get("use_regex", True)
    if t == "Split":
        pat = p.get("pattern", {})
        return pat.get("Regex") in _SAFE_SPLITS and p.get("behavior") == "Isolated" and not p.get("invert")
    return t in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")


def _bytelevel_tail(p: dict) -> bool:
    """ByteLevel without its regex only maps bytes to symbols (after a Split)."""
    return p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False) and not p.get("use_regex", True)


class Cuts:
    """Finds safe cuts in UTF-8 bytes: word boundaries ``[A-Za-z0-9] | [ \\n][A-Za-z]`` (when ``words``) and
    the positions before and after each special token. Searches start with a literal or a character
    class, so the regex engine scans in C (a zero-width pattern would be tried at every byte)."""

    def __init__(self, words: bool, specials: list[bytes]) -> None:
        self.words = re.compile(rb"[ \n](?=[A-Za-z])(?<=[A-Za-z0-9][ \n])") if words else None
        self.specials = sorted(set(specials), key=len, reverse=True)
        self.special = re.compile(b"|".join(map(re.escape, self.specials))) if self.specials else None
        self._back = max(map(len, self.specials), default=0)
        self.context = self._back + 1  # bytes past a window a cut in it can depend on

    def scan(self, data: bytes, start: int, step: int, limit: int = 0) -> list[int]:
        """The first safe cut at or after every multiple of ``step`` past ``start`` (the first ``limit``
        of them when given)."""
        return list(islice(self.walk(data, start, step), limit or None))

    def walk(self, data: bytes, start: int, step: int):
        """:meth:`scan`, lazily. A word cut and a special token's start or end are looked for within
        ``step`` bytes of each target (bounded searches), so a text without one costs one search per step and
        the result depends only on the bytes there."""
        n = len(data)
        back = self._back
        special = self.special.finditer if self.special is not None else None
        words = self.words.search if self.words is not None else None
        target = (start // step + 1) * step
        while target < n:
            end = min(n, target + step)
            best = -1
            if words is not None:
                m = words(data, target, end + 1)  # one byte past the window for the letter after a cut
                if m is not None:
                    best = m.start()
            if special is not None:  # a special token's start or end in the window (searched there only)
                for m in special(data, max(0, target - back), min(n, end + back)):
                    p = m.start() if m.start() >= target else m.end()
                    if p > end:
                        break
                    if p >= target:
                        if best < 0 or p < best:
                            best = p
                        break
            if 0 < best < n:
                yield best
                target = (best // step + 1) * step
            else:
                target += step

    def at(self, data: bytes, pos: int) -> bool:
        """Whether ``pos`` is a safe cut of ``data``."""
        if not 0 < pos < len(data):
            return False
        if self.words is not None and self.words.match(data, pos):
            return True
        if self.special is not None:
            if self.special.match(data, pos):
                return True
            return any(data.endswith(s, 0, pos) for s in self.specials)
        return False


def cut_rule(tok_json: dict, specials: list[str], splittable: bool) -> tuple[Cuts | None, str]:
    """The safe cuts for a tokenizer, and a word saying which it uses.

    ``tok_json`` is the tokenizer's ``to_str()`` document, ``specials`` the contents of its non-normalized
    added tokens, ``splittable`` whether none of them strips whitespace or must be a single word."""
    added = [t.get("content", "") for t in tok_json.get("added_tokens", [])]
    word = (_normalizer_ok(tok_json.get("normalizer")) and _pre_ok(tok_json.get("pre_tokenizer"))
            and tok_json.get("model", {}).get("type") in ("BPE", "WordPiece", "WordLevel")
            and splittable and not any(" " in a or "\n" in a for a in added))
    sp = [x.encode() for x in specials if x] if splittable else []
    if not word and not sp:
        return None, "off"
    return Cuts(word, sp), "words+specials" if word and sp else ("words" if word else "specials")


@dataclass(eq=False)
class Record:
    """One tokenized text. ``cut_pos``/``cut_tok``: byte offset of each fine cut and the ids before it."""

    data: bytes
    tokens: array.array  # 'I', without the specials a post-processor adds
    cut_pos: array.array
    cut_tok: array.array
    anchors: list[int] = field(default_factory=list)
    anchor_pos: list[int] = field(default_factory=list)  # the byte offset of each anchor
    hashes: dict = field(default_factory=dict)  # (block_size, lora, salt, pre ids) -> array('Q')
    size: int = 0  # bytes charged to the cache

    @property
    def nbytes(self) -> int:
        return (len(self.data) + 4 * (len(self.tokens) + len(self.cut_pos) + len(self.cut_tok))
                + 8 * (2 * len(self.anchors) + sum(len(h) for h in self.hashes.values())) + 200)

    def tokens_before(self, pos: int) -> int | None:
        """Ids before the fine cut at byte ``pos`` (None when ``pos`` is not one)."""
        i = bisect_right(self.cut_pos, pos) - 1
        return self.cut_tok[i] if i >= 0 and self.cut_pos[i] == pos else None


@dataclass
class Lookup:
    """A text split into what the cache already knows and what must still be encoded."""

    data: bytes
    # (anchor byte offset, chained key) of the text's anchors, as far as the lookup walked (up to the first
    # that no record holds; PrefixTokenCache.all_keys gives the rest)
    keys: list[tuple[int, int]]
    source: Record | None = None  # the record the known prefix comes from
    known_bytes: int = 0  # a safe cut: data[:known_bytes] tokenizes as source.tokens[:known_tokens]
    known_tokens: int = 0

    @property
    def exact(self) -> bool:
        return self.source is not None and self.known_bytes == len(self.data) == len(self.source.data)

    @property
    def new_bytes(self) -> int:
        return len(self.data) - self.known_bytes


class PrefixTokenCache:
    def __init__(self, cut: Cuts, *, max_bytes: int, chunk_bytes: int = 2048, cut_bytes: int = 256) -> None:
        if chunk_bytes % cut_bytes:
            raise ValueError("chunk_bytes must be a multiple of cut_bytes")
        self.cut = cut
        self.max_bytes = max_bytes
        self.chunk = chunk_bytes
        self.step = cut_bytes
        self._anchors: dict[int, Record] = {}
        self._lru: OrderedDict[int, Record] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.reused_bytes = self.encoded_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _cuts(self, data: bytes, start: int, step: int, limit: int = 0) -> list[int]:
        """First safe cut at or after every multiple of ``step`` past ``start`` (exclusive of both ends)."""
        return self.cut.scan(data, start, step, limit)

    def lookup(self, text: str) -> Lookup:
        """Find the longest known prefix of ``text`` (raises UnicodeEncodeError for lone surrogates).

        The text's anchors are walked from the start; where one is a record's, the record's later anchors
        that lie in the bytes both share are taken without scanning (they are this text's too: an anchor
        depends only on the bytes around it); the walk ends at the first anchor no record holds (no record
        can hold a longer prefix). So a prompt that extends a known one scans only its new part."""
        data = text.encode("utf-8")
        mv = memoryview(data)
        keys: list[tuple[int, int]] = []
        key = 0
        prev = 0
        found: tuple[Record, int] | None = None  # the deepest anchor whose record's bytes agree
        reach = self.chunk + 1 + self.cut.context  # bytes past an anchor that decided it
        cuts = self.cut.walk(data, 0, self.chunk)
        while (a := next(cuts, None)) is not None:
            key = _xxh3(mv[prev:a], key)
            keys.append((a, key))
            prev = a
            rec = self._anchors.get(key)
            if rec is None:  # no text holds this prefix, so none holds a longer one: build() walks on
                break
            if len(rec.data) < a or not data.startswith(memoryview(rec.data)[:a]):
                continue
            found = (rec, a)
            pos, ks = rec.anchor_pos, rec.anchors
            i = bisect_right(pos, a) if len(pos) == len(ks) else len(pos)
            if i < len(pos):
                common = common_prefix(data, rec.data, a, self.step)
                jumped = prev
                while i < len(pos) and pos[i] + reach <= common:
                    prev, key = pos[i], ks[i]
                    keys.append((prev, key))
                    i += 1
                if prev != jumped:  # go on walking after the anchors taken
                    cuts = self.cut.walk(data, prev, self.chunk)
                found = (rec, prev)
                newest = self._anchors.get(key)  # the newest text holding the prefix answers for it
                if newest is not None and newest is not rec and len(newest.data) >= prev and data.startswith(
                        memoryview(newest.data)[:prev]):
                    found = (newest, prev)
        lk = Lookup(data, keys)
        if found is not None:
            self._extend(lk, *found)
        return lk

    def all_keys(self, lk: Lookup) -> list[tuple[int, int]]:
        """Every anchor of ``lk``'s text: those the lookup walked, then the rest (pure: may run on a thread
        pool, with the encoding)."""
        keys = lk.keys
        prev, key = keys[-1] if keys else (0, 0)
        mv = memoryview(lk.data)
        rest = []
        for a in self.cut.walk(lk.data, prev, self.chunk):
            key = _xxh3(mv[prev:a], key)
            rest.append((a, key))
            prev = a
        return keys + rest if rest else keys

    def cut_after(self, data: bytes, pos: int) -> int | None:
        """A fine cut of ``data`` at or after ``pos`` (the first past the cut spacing's next multiple)."""
        found = self._cuts(data, max(0, pos - 1), self.step, 1)
        return found[0] if found else None

    def pieces(self, lk: Lookup) -> tuple[list[int], list[str]]:
        """The text after the known prefix, cut at fine cuts: (start offsets, pieces). Pure: may run on
        a thread pool."""
        data = lk.data
        if lk.exact or lk.known_bytes >= len(data):
            return [], []
        bounds = [lk.known_bytes, *self._cuts(data, lk.known_bytes, self.step), len(data)]
        return bounds[:-1], [data[bounds[i]:bounds[i + 1]].decode("utf-8") for i in range(len(bounds) - 1)]

    def _extend(self, lk: Lookup, rec: Record, anchor: int) -> None:
        """The known prefix: past ``anchor``, as far as the bytes agree, back to a fine cut of both texts."""
        data, other = lk.data, rec.data
        common = common_prefix(data, other, anchor, self.step)
        if common == len(data) == len(other):
            lk.source, lk.known_bytes, lk.known_tokens = rec, common, len(rec.tokens)
            return
        i = bisect_right(rec.cut_pos, common) - 1
        at = self.cut.at
        while i >= 0 and rec.cut_pos[i] >= anchor:
            pos = rec.cut_pos[i]
            # a cut of the record is a cut of this text when the bytes it looks at agree (checked on this text)
            if at(data, pos):
                lk.source, lk.known_bytes, lk.known_tokens = rec, pos, rec.cut_tok[i]
                return
            i -= 1
        n = rec.tokens_before(anchor)
        if n is not None:
            lk.source, lk.known_bytes, lk.known_tokens = rec, anchor, n

    def build(self, lk: Lookup, encode) -> Record:
        """The record of ``lk``'s text: the known prefix's ids and hashes from its source, the rest encoded
        by ``encode(pieces) -> [ids]``. Pure (reads the source record only): may run on a thread pool."""
        src = lk.source
        if lk.exact:
            return src
        starts, pieces = self.pieces(lk)
        encoded = encode(pieces) if pieces else []
        tokens = array.array("I")
        cut_pos = array.array("I")
        cut_tok = array.array("I")
        if src is not None:
            tokens = src.tokens[:lk.known_tokens]
            i = bisect_right(src.cut_pos, lk.known_bytes)
            cut_pos, cut_tok = src.cut_pos[:i], src.cut_tok[:i]
        for start, ids in zip(starts, encoded):
            if start > 0 and (not cut_pos or cut_pos[-1] < start):
                cut_pos.append(start)
                cut_tok.append(len(tokens))
            tokens.extend(ids)
        keys = self.all_keys(lk)
        rec = Record(lk.data, tokens, cut_pos, cut_tok, anchors=[k for _, k in keys],
                     anchor_pos=[a for a, _ in keys])
        if src is not None:  # block hashes of the shared blocks come along
            for hk, hs in list(src.hashes.items()):
                keep = min(len(hs), (len(hk[3]) + lk.known_tokens) // hk[0])
                if keep:
                    rec.hashes[hk] = hs[:keep]
        return rec

    def commit(self, lk: Lookup, rec: Record) -> Record:
        """Keep ``rec`` (built from ``lk``) and count the lookup (on the event loop)."""
        if lk.exact:
            self._lru.move_to_end(id(rec))
            self.hits += 1
            self.reused_bytes += len(lk.data)
            return rec
        if lk.source is not None:
            self.hits += 1
            self.reused_bytes += lk.known_bytes
        else:
            self.misses += 1
        self.encoded_bytes += lk.new_bytes
        self._insert(rec)
        return rec

    def touch(self, lk: Lookup) -> None:
        """Count a lookup whose known prefix is used as it is (nothing encoded, nothing kept)."""
        if lk.source is not None and id(lk.source) in self._lru:
            self._lru.move_to_end(id(lk.source))
            self.hits += 1
            self.reused_bytes += lk.known_bytes

    def _insert(self, rec: Record) -> None:
        rec.size = rec.nbytes
        if rec.size > self.max_bytes:
            return
        for k in rec.anchors:
            self._anchors[k] = rec  # the newest text holding a prefix answers for it
        self._lru[id(rec)] = rec
        self.bytes += rec.size
        self._shrink()

    def _shrink(self) -> None:
        while self.bytes > self.max_bytes and self._lru:
            _, old = self._lru.popitem(last=False)
            self.bytes -= old.size
            for k in old.anchors:
                if self._anchors.get(k) is old:
                    del self._anchors[k]

    def grew(self, rec: Record, nbytes: int) -> None:
        """``rec`` gained ``nbytes`` (memoised hashes)."""
        if id(rec) in self._lru:
            rec.size += nbytes
            self.bytes += nbytes
            self._shrink()

    def clear(self) -> None:
        self._anchors.clear()
        self._lru.clear()
        self.bytes = 0


def common_prefix(data: bytes, other: bytes, lo: int, step: int) -> int:
    """The length of the common prefix of ``data`` and ``other``, known to be at least ``lo``: gallop, then
    bisect (memcmp, no copies)."""
    end = min(len(data), len(other))
    om = memoryview(other)
    while lo < end:
        hi = min(end, lo + step)
        if data.startswith(om[lo:hi], lo):
            lo, step = hi, step * 2
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if data.startswith(om[lo:mid], lo):
                lo = mid
            else:
                hi = mid
        break
    return lo


def block_hashes(rec: Record, pre: tuple[int, ...], post: tuple[int, ...], block_size: int,
                 lora_name: str | None, cache_salt: str | None, max_blocks: int,
                 cache: PrefixTokenCache | None = None) -> list[int]:
    """Sequence hashes of the first ``max_blocks`` blocks of ``pre + rec.tokens + post``, memoised on the
    record (a record made from another starts with the shared blocks' hashes)."""
    if max_blocks <= 0:
        return []
    hk = (block_size, lora_name, cache_salt, pre)
    memo = rec.hashes.get(hk)
    full = (len(pre) + len(rec.tokens)) // block_size
    want = min(max_blocks, full)
    if memo is None or len(memo) < want:
        have = 0 if memo is None else len(memo)
        toks = array.array("I", pre) + rec.tokens if pre else rec.tokens
        new = sequence_hashes_from(toks, block_size, have, memo[-1] if have else None, lora_name, cache_salt,
                                   max_blocks=full)
        memo = (memo or array.array("Q")) + array.array("Q", new)
        rec.hashes[hk] = memo
        if cache is not None:
            cache.grew(rec, 8 * len(new))
    out = memo[:want].tolist()
    if max_blocks > want and post:  # blocks completed by the post-processor's ids (not memoised)
        toks = array.array("I", pre) + rec.tokens + array.array("I", post)
        out += sequence_hashes_from(toks, block_size, want, out[-1] if out else None, lora_name, cache_salt,
                                    max_blocks=max_blocks)
    return out
