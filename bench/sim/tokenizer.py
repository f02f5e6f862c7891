"""The simulator's word-level tokenizer: token id k <-> the word ``w{k}``.

Saved as an ordinary Hugging Face model directory (tokenizer.json, tokenizer_config.json with a Jinja chat
template), so the gateway loads it like any model's tokenizer and text prompts and token-id prompts describe
the same blocks: ``"w5 w17 w3"`` tokenizes to ``[5, 17, 3]``.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

DEFAULT_VOCAB = 32000
SPECIALS = ("<|unk|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Whitespace between turns is part of the template text but never becomes a token (WhitespaceSplit), so the
# chat form is: <|role|> words... <|end|> per message, then <|assistant|> for the generation prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word(k: int) -> str:
    return f"w{k}"


def ids_to_text(ids: Sequence[int]) -> str:
    """The text whose tokenization is exactly ``ids`` (all ids must be plain words, < vocab size)."""
    return " ".join(f"w{k}" for k in ids)


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB):
    """A ``tokenizers.Tokenizer`` with words w0..w{vocab_size-1} and the special tokens after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word(k): k for k in range(vocab_size)}
    for i, s in enumerate(SPECIALS):
        vocab[s] = vocab_size + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok.add_special_tokens(list(SPECIALS))
    return tok


def save_model_dir(path: str | Path, vocab_size: int = DEFAULT_VOCAB, model_name: str = "sim-model") -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ a minimal config.json) into ``path``; idempotent."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / "tokenizer_config.json"
    if marker.exists():
        try:
            if json.loads(marker.read_text()).get("sim_vocab_size") == vocab_size:
                return path
        except ValueError:
            pass
    build_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<|unk|>",
        "eos_token": "<|end|>",
        "bos_token": None,
        "pad_token": "<|end|>",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "sim_vocab_size": vocab_size,
        "name_or_path": model_name,
    }
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size + len(SPECIALS)}))
    marker.write_text(json.dumps(config, indent=1))
    return path


class SimTokenizer:
    """What a simulated worker uses for /tokenize and text prompts: the saved tokenizer + the chat template,
    rendered the way transformers renders it (sandboxed Jinja, trim_blocks, lstrip_blocks)."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.vocab_size = vocab_size
        self._tok = build_tokenizer(vocab_size)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(CHAT_TEMPLATE)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    async def encode_off_loop(self, text: str) -> list[int]:
        """``encode`` on a thread, without the GIL (``encode_batch`` releases it, ``encode`` does not): one
        process hosts every simulated worker, and vLLM tokenizes in its API server, never in the engine
        loop, so a long text prompt must not stall the other workers' simulated steps."""
        import asyncio

        loop = asyncio.get_running_loop()
        enc = await loop.run_in_executor(None, lambda: self._tok.encode_batch([text], add_special_tokens=False))
        return enc[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "<|unk|>" for i in ids]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        norm = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text parts
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            norm.append({"role": m.get("role", "user"), "content": content or ""})
        return self._template.render(messages=norm, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))
