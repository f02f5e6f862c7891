"""The offline model builder the real-vLLM tests, the demo and the G4 tests serve."""

from __future__ import annotations

import json

import pytest

from bench import tiny_model


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model.ensure("tiny")


def test_builds_a_servable_llama_directory(model_dir):
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (256, 4, 8192)
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_cache_is_reused_and_keyed_by_version(model_dir):
    assert tiny_model.ensure("tiny") == model_dir
    assert model_dir.name == f"tiny-{tiny_model.version_key('tiny')}"


def test_build_is_deterministic(model_dir, tmp_path):
    """Two builds give byte-identical weights and tokenizer (fixed seed, sorted training files)."""
    again = tiny_model.build(tmp_path / "again", "tiny")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_chat_template_is_prefix_stable(model_dir):
    """A conversation rendered for generation is a token prefix of the same conversation one turn later:
    what lets vLLM serve the next turn of a chat from its prefix cache."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    turn2 = turn1 + [
        {"role": "assistant", "content": "Keys and values."},
        {"role": "user", "content": "And a prefix cache?"},
    ]

    def ids(messages):
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    first, second = ids(turn1), ids(turn2)
    assert second[: len(first)] == first
    assert first[0] == tok.convert_tokens_to_ids("<|bos|>")
    assert tok.decode(first).endswith("<|assistant|>")


def test_completion_prompts_start_with_bos(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.encode("def f(x): return x").ids[0] == tok.token_to_id("<|bos|>")
