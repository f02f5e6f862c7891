"""A tiny byte-level BPE tokenizer with a ChatML-style Jinja chat template, built offline and
deterministically (same corpus, same trainer settings -> same vocabulary) for the gateway tests."""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|bos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if not (loop.last and continue_final_message) %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}"
)

_WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from "
          "or had by hot word but what some we can out other were all there when up use your how said an "
          "each she which do their time if will way about many then them write would like so these her "
          "long make thing see him two has look more day could go come did number sound no most people my "
          "over know water than call first who may down side been now find any new work part take get "
          "place made live where after back little only round man year came show every good me give our "
          "under name very through just form sentence great think say help low line differ turn cause much "
          "mean before move right boy old too same tell does set three want air well also play small end "
          "put home read hand port large spell add even land here must big high such follow act why ask "
          "cache block prefix token gateway worker route stream request model").split()


def corpus() -> list[str]:
    """Deterministic pseudo-text: the word list in a fixed permutation pattern, plus punctuation."""
    out = []
    n = len(_WORDS)
    for i in range(400):
        words = [_WORDS[(i * 7 + j * 13) % n] for j in range(12)]
        out.append(" ".join(words).capitalize() + (". " if i % 3 else ", ") + str(i % 50) + "\n")
    return out


def build(directory: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                       special_tokens=[("<|bos|>", bos)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 8192, "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
    }, indent=1))
    return d
