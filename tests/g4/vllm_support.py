"""Minimal real-vLLM helpers for the G4 tests (until the vllm helper's tests/support/vllm_server.py lands):
a tiny Llama model built offline, and a vLLM CPU server started as a subprocess with kvgate's connector.
Facts from ../shared/vllm-cpu.md."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.procs import free_port, stop

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))
VLLM_VENV = Path(os.environ.get("VLLM_VENV", CACHE / "vllm-venv"))
LAUNCHER = Path(__file__).with_name("vllm_launch.py")
BLOCK = 32


def vllm_python() -> Path | None:
    p = VLLM_VENV / "bin" / "python"
    return p if p.exists() and (VLLM_VENV / ".kvgate-ready").exists() else None


def tiny_model(
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 4,
    intermediate: int = 512,
    vocab: int = 4096,
    name: str | None = None,
) -> Path:
    """Build (once, cached) a random-initialised Llama with a byte-level BPE tokenizer."""
    name = name or f"g4-llama-h{hidden}-l{layers}-a{heads}-kv{kv_heads}-v{vocab}"
    out = CACHE / "models" / name
    if (out / ".ready").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    import json as _json

    src = Path(_json.__file__).parent.parent
    files = [str(p) for p in sorted(src.glob("*.py"))[:60]]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16384,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / ".ready").touch()
    return out


class VllmServer:
    """A real vLLM CPU server with kvgate's connector on a G4 directory."""

    def __init__(
        self,
        model: Path,
        g4_path: str | None,
        *,
        name: str = "tiny",
        extra_config: dict | None = None,
        extra_args: list[str] | None = None,
        threads_bind: str = "auto",
        kv_events: bool = True,
        kv_space_gib: int = 1,
        env: dict | None = None,
    ):
        self.model, self.g4_path, self.name = model, g4_path, name
        self.port = free_port()
        self.zmq_port = free_port()
        self.prefetch_port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="kvgate-vllm-")
        self.stats_path = os.path.join(self.tmp, "g4-stats.json")
        self.extra_config = dict(extra_config or {})
        self.extra_args = list(extra_args or [])
        self.threads_bind = threads_bind
        self.kv_events = kv_events
        self.kv_space_gib = kv_space_gib
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.tmp, "vllm.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [
            str(vllm_python()),
            str(LAUNCHER),
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.name,
            "--block-size",
            str(BLOCK),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            "8192",
            "--enforce-eager",
            "--dtype",
            "bfloat16",
        ]
        if self.kv_events:
            args += [
                "--kv-events-config",
                json.dumps(
                    {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://127.0.0.1:{self.zmq_port}".replace("127.0.0.1", "*"),
                        "topic": "kv",
                    }
                ),
            ]
        if self.g4_path is not None:
            extra = {
                "g4_path": self.g4_path,
                "prefetch_port": self.prefetch_port,
                "stats_path": self.stats_path,
            }
            extra.update(self.extra_config)
            args += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "KvgateConnector",
                        "kv_connector_module_path": "cache_tier.connector",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": extra,
                    }
                ),
            ]
        return args + self.extra_args

    def start(self, timeout: float = 240.0) -> VllmServer:
        self.launch()
        return self.wait_healthy(timeout)

    def launch(self) -> VllmServer:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_space_gib),
                "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CACHE_ROOT": os.path.join(self.tmp, "cache"),
                "PYTHONHASHSEED": "0",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
            }
        )
        env.update(self.env)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.tmp,
                start_new_session=True,
            )
        return self

    def wait_healthy(self, timeout: float = 240.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM not healthy after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, timeout=30)
            self.proc = None

    def complete(self, prompt_ids: list[int], max_tokens: int = 8, **extra) -> dict:
        r = httpx.post(
            self.url + "/v1/completions",
            timeout=300,
            json={
                "model": self.name,
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                **extra,
            },
        )
        r.raise_for_status()
        return r.json()

    def g4_stats(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.prefetch_port}/kvgate/g4/stats", timeout=10).json()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
