"""Offline, deterministic builder of the small Llama models that the real-vLLM tests, the demo and the
G4 tests serve (no model hub on these machines).

What it builds, in one directory vLLM can serve:
- a byte-level BPE tokenizer trained with ``tokenizers`` on a fixed, sorted list of the Python standard
  library's own sources (always present, no download), saved as ``tokenizer.json`` +
  ``tokenizer_config.json`` with a Jinja ``chat_template``, BOS/EOS and role-marker special tokens;
- a random-initialised ``LlamaForCausalLM`` (fixed seed) saved as bf16 safetensors with ``config.json``
  and ``generation_config.json``.

Sizes: ``tiny`` (hidden 256, 4 layers, 4 heads: 8.4M parameters, for tests) and ``152m`` (hidden 1024,
12 layers, 16 heads, 4 KV heads, intermediate 2816: the benchmark model).

Built models are cached under ``$KVGATE_CACHE/models/<size>-<version>`` (default ``~/.cache/kvgate``),
where the version hashes this file, the size and the training text, so a change to any of them builds
anew and repeated test sessions reuse the directory. Needs torch and transformers: run it with the vLLM
environment's python or the project's test environment.

    python -m bench.tiny_model --size tiny            # print the cached directory (build if missing)
    python -m bench.tiny_model --size 152m --out DIR  # build into DIR
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

VOCAB_SIZE = 8192
SEED = 0
MAX_POSITIONS = 8192

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]

# Prefix-stable: rendering a conversation plus the generation prompt yields a token prefix of the same
# conversation continued by the assistant's answer and the next user turn (what multi-turn caching needs).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=688,
    ),
    "152m": dict(
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
    ),
}

# Standard-library modules whose sources train the tokenizer: present in every CPython 3.11+ install.
CORPUS_FILES = sorted(
    [
        "argparse.py",
        "ast.py",
        "base64.py",
        "bisect.py",
        "calendar.py",
        "collections/__init__.py",
        "configparser.py",
        "contextlib.py",
        "copy.py",
        "csv.py",
        "dataclasses.py",
        "datetime.py",
        "decimal.py",
        "difflib.py",
        "email/message.py",
        "enum.py",
        "fractions.py",
        "functools.py",
        "getopt.py",
        "gettext.py",
        "glob.py",
        "heapq.py",
        "html/parser.py",
        "http/client.py",
        "inspect.py",
        "json/decoder.py",
        "json/encoder.py",
        "logging/__init__.py",
        "mailbox.py",
        "operator.py",
        "optparse.py",
        "pathlib.py",
        "pickle.py",
        "pprint.py",
        "queue.py",
        "random.py",
        "shutil.py",
        "statistics.py",
        "string.py",
        "subprocess.py",
        "tarfile.py",
        "textwrap.py",
        "threading.py",
        "tokenize.py",
        "typing.py",
        "urllib/parse.py",
        "uuid.py",
        "zipfile/__init__.py",
    ]
)


def _corpus_paths() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for name in CORPUS_FILES:
        p = root / name
        if not p.exists() and name.endswith("/__init__.py"):
            p = root / (name[: -len("/__init__.py")] + ".py")  # e.g. zipfile was a module before 3.12
        if p.exists():
            paths.append(p)
    if len(paths) < 10:
        raise RuntimeError(f"too few standard-library sources found under {root} to train a tokenizer")
    return paths


def _corpus_texts() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in _corpus_paths()]


def version_key(size: str) -> str:
    """Hash of what determines the built files: this builder's source, the size and the training text."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(size.encode())
    for text in _corpus_texts():
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("KVGATE_CACHE") or Path.home() / ".cache" / "kvgate")


def build_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> "object":
    """Train the byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json (another
    ``vocab_size`` gives another tokenizer: what the parity tests use as a mismatching one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Completions get a BOS like a Llama tokenizer (chat templates add it themselves).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": ROLE_TOKENS,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def build_model(out: Path, size: str, tok) -> None:
    """Random-initialise a LlamaForCausalLM with a fixed seed and save it as bf16 safetensors."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dims = SIZES[size]
    bos, eos, pad, end = (tok.token_to_id(t) for t in (BOS, EOS, PAD, "<|end|>"))
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
        **dims,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, end], pad_token_id=pad)
    model.save_pretrained(str(out), safe_serialization=True)


def build(out: str | os.PathLike, size: str = "tiny") -> Path:
    """Build the model of ``size`` into ``out`` (created; existing files are overwritten)."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    build_model(out, size, tok)
    (out / "kvgate-model.json").write_text(json.dumps({"size": size, "version": version_key(size)}) + "\n")
    return out


def ensure(size: str = "tiny", root: str | os.PathLike | None = None) -> Path:
    """The cached model directory of ``size``, built first if missing (one builder at a time)."""
    base = Path(root) if root else cache_root() / "models"
    base.mkdir(parents=True, exist_ok=True)
    target = base / f"{size}-{version_key(size)}"
    marker = target / "kvgate-model.json"
    if marker.exists():
        return target
    with open(base / f".{size}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{size}-", dir=base))
        try:
            build(tmp, size)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiny_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--out", help="build into this directory (default: the cache, reused when built)")
    args = parser.parse_args(argv)
    path = build(args.out, args.size) if args.out else ensure(args.size)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
