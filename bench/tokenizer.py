"""A realistic-size byte-level BPE tokenizer for benchmarks, trained offline on the Python standard
library's sources (about 4 characters per token on English and code), with a ChatML chat template.
Built once into ``$KVGATE_CACHE/bench-tokenizer-v1`` (default ~/.cache/kvgate)."""
from __future__ import annotations

import functools
import json
import os
import sysconfig
from pathlib import Path

TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
            "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def corpus_files(limit_bytes: int = 6_000_000) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.glob("*.py")):
        out.append(p)
        total += p.stat().st_size
        if total >= limit_bytes:
            break
    return out


@functools.lru_cache(maxsize=1)
def _blob() -> str:
    return "".join(p.read_text(errors="replace") for p in corpus_files(3_000_000)[:60])


def corpus_text(n_bytes: int, offset: int = 0) -> str:
    """``n_bytes`` of stdlib source text starting at ``offset`` (wrapping)."""
    blob = _blob()
    offset %= max(1, len(blob) - n_bytes - 1)
    return blob[offset: offset + n_bytes]


def build(vocab_size: int = 32000) -> Path:
    base = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
    d = base / "bench-tokenizer-v1"
    if (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists():
        return d
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                           "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in corpus_files()], trainer=trainer)
    tmp = d / "tokenizer.json.tmp"
    tok.save(str(tmp))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 131072, "chat_template": TEMPLATE}))
    tmp.rename(d / "tokenizer.json")
    return d
