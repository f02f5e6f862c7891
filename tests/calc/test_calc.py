"""``kvgate calc`` against hand-computed figures (each expected number is worked out beside it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sizing import calc
from router.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"
GIB = 1 << 30


def cfg(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["calc", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------- Llama 3.1 70B


def test_llama_70b_hand_computed():
    # 2 (K,V) x 8 KV heads x 128 head dim x 2 B (bf16) x 80 layers = 327,680 B per token.
    r = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, concurrency=8)
    assert r.kv_bytes_per_token == 327_680
    assert r.kv_bytes_per_token_full_layers == 327_680
    # 327,680 x 131,072 = 42,949,672,960 B = 40 GiB per request; x 8 users = 320 GiB.
    assert r.kv_bytes_per_request == 42_949_672_960 == 40 * GIB
    assert r.kv_bytes_total == 343_597_383_680 == 320 * GIB
    assert r.model["full_attention_layers"] == 80 and r.model["sliding_window_layers"] == 0


def test_llama_70b_param_estimate_close_to_published():
    # Published: 70.6 B parameters. Embeddings 128,256 x 8,192 x 2 (untied) + 80 x (attention + SwiGLU MLP).
    shape = calc.model_shape(cfg("llama-3.1-70b.json"))
    assert abs(shape.params - 70.6e9) / 70.6e9 < 0.01
    assert shape.weight_bytes == shape.params * 2


def test_head_dim_derived_from_hidden_size():
    # Llama 3.1 8B gives no head_dim: 4096 / 32 heads = 128; 2 x 8 x 128 x 2 B x 32 layers = 131,072 B.
    r = calc.calculate(cfg("llama-3.1-8b.json"), context=1000)
    assert r.model["head_dim"] == 128
    assert r.kv_bytes_per_token == 131_072
    # 1000 tokens round up to 63 blocks of 16 = 1008 tokens.
    assert r.kv_bytes_per_request == 131_072 * 1008


def test_fp8_kv_cache_halves_the_bytes():
    r = calc.calculate(cfg("llama-3.1-70b.json"), context=16, kv_dtype="fp8")
    assert r.kv_bytes_per_token == 163_840
    assert r.model["kv_dtype"] == "fp8"


# ------------------------------------------------------------------------------------------- sliding windows


def test_gpt_oss_style_alternating_sliding_layers():
    config = {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "hidden_size": 64, "torch_dtype": "bfloat16", "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    }
    # per layer per token: 2 x 2 heads x 8 x 2 B = 64 B. Context 100 -> 112 tokens (7 blocks of 16).
    # full layers: 2 x 64 x 112 = 14,336; sliding layers hold the 32-token window: 2 x 64 x 32 = 4,096.
    r = calc.calculate(config, context=100, concurrency=3)
    assert r.kv_bytes_per_token == 256
    assert r.kv_bytes_per_token_full_layers == 128
    assert r.kv_bytes_per_request == 18_432
    assert r.kv_bytes_total == 3 * 18_432
    assert r.model["sliding_window_layers"] == 2 and r.model["sliding_windows"] == [32]
    # Below the window every layer holds every token: 16 tokens x 256 B.
    assert calc.calculate(config, context=16).kv_bytes_per_request == 16 * 256


def test_gpt_oss_120b_shipped_config():
    # 36 layers, 18 sliding (window 128) and 18 full; 2 x 8 x 64 x 2 B = 2,048 B per layer per token.
    # 128K context: 18 x 2,048 x 131,072 + 18 x 2,048 x 128 = 4,831,838,208 + 4,718,592.
    r = calc.calculate(cfg("gpt-oss-120b.json"), context=128 * 1024)
    assert r.kv_bytes_per_token == 73_728
    assert r.kv_bytes_per_token_full_layers == 36_864
    assert r.kv_bytes_per_request == 4_836_556_800
    shape = calc.model_shape(cfg("gpt-oss-120b.json"))
    # Published: 116.8 B parameters, a checkpoint of about 65 GB with MXFP4 experts.
    assert abs(shape.params - 116.8e9) / 116.8e9 < 0.02
    assert 60e9 < shape.weight_bytes < 70e9


def test_qwen_sliding_window_after_max_window_layers():
    config = {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 64,
        "torch_dtype": "float16", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2,
    }
    # head_dim 64 / 4 = 16; per layer per token 2 x 1 x 16 x 2 B = 64 B. Layers 0-1 full, 2-3 slide.
    # Context 1024: full 2 x 64 x 1024 = 131,072; sliding 2 x 64 x 64 = 8,192.
    r = calc.calculate(config, context=1024)
    assert calc.model_shape(config).layer_windows == (None, None, 64, 64)
    assert r.kv_bytes_per_request == 139_264
    # The switch off means every layer is full, whatever sliding_window says.
    off = calc.calculate({**config, "use_sliding_window": False}, context=1024)
    assert off.kv_bytes_per_request == 4 * 64 * 1024


def test_qwen25_shipped_config_has_sliding_off():
    # 2 x 4 KV heads x (3584 / 28 = 128) x 2 B x 28 layers = 57,344 B.
    r = calc.calculate(cfg("qwen2.5-7b-instruct.json"), context=32 * 1024)
    assert r.kv_bytes_per_token == 57_344
    assert r.kv_bytes_per_request == 57_344 * 32 * 1024
    assert calc.calculate(cfg("qwen3-32b.json"), context=16).kv_bytes_per_token == 262_144


def test_mistral_every_layer_slides():
    # Every layer holds at most 4096 tokens: 131,072 B x 4096 = 512 MiB whatever the context.
    r = calc.calculate(cfg("mistral-7b-v0.1.json"), context=32 * 1024, gpu="h100")
    assert r.kv_bytes_per_request == 131_072 * 4096
    assert r.gpu["max_tokens_in_cache"] is None


def test_multimodal_text_config_is_used():
    inner = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 32,
             "torch_dtype": "bfloat16"}
    r = calc.calculate({"architectures": ["X"], "text_config": inner}, context=16)
    assert r.kv_bytes_per_token == 2 * 1 * 16 * 2 * 2


# ------------------------------------------------------------------------------------------- GPU fit


def test_fits_and_does_not_fit_with_given_weights():
    # Custom 100 GiB GPU x 0.9 = 90 GiB usable; 20 GiB weights -> 70 GiB of KV budget.
    # Llama 3.1 8B at 128K is 16 GiB per request: 4 fit (64 GiB), 5 do not (80 GiB, 10 GiB short).
    base = dict(context=128 * 1024, gpu="100GiB", weights_bytes=20 * GIB)
    ok = calc.calculate(cfg("llama-3.1-8b.json"), concurrency=4, **base)
    assert ok.gpu["fits"] is True
    assert ok.gpu["kv_budget_bytes"] == 70 * GIB
    assert ok.gpu["max_concurrency_at_context"] == 4
    # 70 GiB / 128 KiB per token = 573,440 tokens.
    assert ok.gpu["max_tokens_in_cache"] == 573_440
    bad = calc.calculate(cfg("llama-3.1-8b.json"), concurrency=5, **base)
    assert bad.gpu["fits"] is False
    assert bad.gpu["shortfall_bytes"] == 10 * GIB


def test_known_gpus_and_tensor_parallel():
    # Llama 70B in bf16 (70e9 x 2 B = 140 GB = 130.4 GiB of weights) does not fit one H100 at all.
    # 4 x 81,559 MiB x 0.9 = 286.7 GiB usable - 130.4 GiB = 156.4 GiB of KV, short of 8 x 40 GiB.
    r1 = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, concurrency=8, gpu="h100",
                        params=70e9)
    assert r1.gpu["fits"] is False and r1.gpu["kv_budget_bytes"] == 0
    assert r1.gpu["weights_bytes"] == 140e9
    r4 = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, concurrency=8, gpu="H100",
                        gpus=4, params=70e9)
    assert r4.gpu["memory_bytes_per_gpu"] == 81_559 * (1 << 20)
    assert r4.gpu["fits"] is False
    assert r4.gpu["max_concurrency_at_context"] == 3  # 156.4 GiB / 40 GiB
    # 8 x H200 (143,771 MiB each): 8 x 140.4 x 0.9 = 1010.9 GiB usable - 130.4 GiB weights: 8 x 40 GiB fits.
    r8 = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, concurrency=8, gpu="h200",
                        gpus=8, params=70e9)
    assert r8.gpu["fits"] is True
    assert calc.resolve_gpu("rtx-pro-6000")[1] == 97_887 * (1 << 20)


def test_utilization_and_overhead_reduce_the_budget():
    r = calc.calculate(cfg("llama-3.1-8b.json"), context=16, gpu="100GiB", weights_bytes=20 * GIB,
                       utilization=0.5, overhead_bytes=5 * GIB, gpus=2)
    # 2 x 100 GiB x 0.5 - 20 GiB - 2 x 5 GiB = 70 GiB.
    assert r.gpu["kv_budget_bytes"] == 70 * GIB


# ------------------------------------------------------------------------------------------- G4 vs prefill


def test_load_versus_prefill():
    # 40 GiB (Llama 70B, 128K) at 10 GB/s = 4.294967296 s; prefill 131,072 / 4,000 tok/s = 32.768 s.
    r = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, g4_bandwidth=10e9, prefill_rate=4000)
    assert r.g4["load_s"] == pytest.approx(4.294967296)
    assert r.g4["prefill_s"] == pytest.approx(32.768)
    assert r.g4["speedup"] == pytest.approx(32.768 / 4.294967296)
    assert r.g4["break_even_bandwidth_bytes_per_s"] == pytest.approx(40 * GIB / 32.768)
    # A shorter prompt than the context: 1,024 tokens -> 320 MiB.
    short = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, g4_bandwidth=10e9,
                           prefill_rate=4000, prompt_tokens=1024)
    assert short.g4["prompt_kv_bytes"] == 327_680 * 1024
    assert short.g4["load_s"] == pytest.approx(327_680 * 1024 / 10e9)


def test_g4_comparison_needs_both_figures():
    with pytest.raises(calc.CalcError, match="both"):
        calc.calculate(cfg("llama-3.1-8b.json"), context=16, g4_bandwidth=1e9)


# ------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text,expected", [("131072", 131072), ("128K", 131072), ("128k", 131072),
                                           ("1M", 1 << 20)])
def test_parse_tokens(text, expected):
    assert calc.parse_tokens(text) == expected


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * GIB), ("141GB", 141e9), ("10GB/s", 10e9),
                                           ("2e9", 2e9), ("512MiB", 512 << 20)])
def test_parse_size(text, expected):
    assert calc.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "-5", "0", "10 parsecs", "nan"])
def test_parse_rejects(bad):
    with pytest.raises(calc.CalcError):
        calc.parse_size(bad)


# ------------------------------------------------------------------------------------------- CLI


def test_cli_table(capsys):
    rc, out, err = run_cli(capsys, str(CONFIGS / "llama-3.1-70b.json"), "--context", "128K", "-n", "8",
                           "--gpu", "h200", "--gpus", "8", "--g4-bandwidth", "10GB/s",
                           "--prefill-rate", "4000")
    assert rc == 0, err
    assert "327,680 B" in out
    assert "320.00 GiB" in out
    assert "8 x NVIDIA H200" in out
    assert "fits" in out and "yes" in out
    assert "7.6x" in out


def test_cli_json(capsys, tmp_path):
    # A directory holding config.json is accepted too.
    (tmp_path / "config.json").write_text((CONFIGS / "gpt-oss-120b.json").read_text())
    rc, out, _ = run_cli(capsys, str(tmp_path), "--context", "131072", "--concurrency", "2", "--json",
                         "--gpu", "96GiB", "--weights", "65GB")
    assert rc == 0
    doc = json.loads(out)
    assert doc["kv_bytes_per_request"] == 4_836_556_800
    assert doc["kv_bytes_total"] == 2 * 4_836_556_800
    assert doc["gpu"]["weights_bytes"] == 65e9
    assert doc["model"]["sliding_window_layers"] == 18


@pytest.mark.parametrize("config,args,needle", [
    ("{not json", [], "not valid JSON"),
    ("[1, 2]", [], "JSON object"),
    ('{"num_attention_heads": 8, "hidden_size": 64}', [], "num_hidden_layers"),
    ('{"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 64}', [], "positive integer"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64, "torch_dtype": "float7"}', [],
     "unsupported model dtype"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64, '
     '"layer_types": ["full_attention"]}', [], "layer_types"),
    ('{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 64, "layer_types": ["mamba"]}', [],
     "unknown type"),
    ('{"num_hidden_layers": 1, "num_attention_heads": 3, "hidden_size": 64}', [], "head_dim"),
    ('{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 64}', ["--gpu", "a100-ish"],
     "unknown GPU"),
    ('{"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 64}', ["--g4-bandwidth", "1GB/s"],
     "both"),
])
def test_cli_bad_input_exits_2(capsys, tmp_path, config, args, needle):
    path = tmp_path / "config.json"
    path.write_text(config)
    rc, out, err = run_cli(capsys, str(path), "--context", "4096", *args)
    assert rc == 2
    assert out == ""
    assert needle in err and err.startswith("kvgate calc: error:")


def test_cli_missing_file_and_bad_context(capsys, tmp_path):
    rc, _, err = run_cli(capsys, str(tmp_path / "nope.json"), "--context", "4096")
    assert rc == 2 and "no such file" in err
    rc, _, err = run_cli(capsys, str(CONFIGS / "llama-3.1-8b.json"), "--context", "lots")
    assert rc == 2 and "--context" in err


def test_installed_entry_point_exit_code(tmp_path):
    """The real ``kvgate`` console script, as an operator runs it."""
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    exe = Path(sys.executable).with_name("kvgate")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "router.cli"]
    env = {**os.environ, "PYTHONPATH": str(CONFIGS.parents[1])}
    p = subprocess.run([*cmd, "calc", str(bad), "--context", "1K"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and "num_hidden_layers" in p.stderr
    p = subprocess.run([*cmd, "calc", str(CONFIGS / "llama-3.1-70b.json"), "--context", "1K", "--json"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["kv_bytes_per_token"] == 327_680


def test_tensor_parallel_beyond_kv_heads_replicates():
    # 8 KV heads on 16 GPUs: each head lives on 2 GPUs, so the budget holds half as much distinct KV.
    # 16 x 100 GiB x 0.9 = 1440 GiB - 140 GiB weights = 1300 GiB budget -> 650 GiB distinct = 16 x 40 GiB.
    r = calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, concurrency=16, gpu="100GiB", gpus=16,
                       weights_bytes=140 * GIB)
    assert r.gpu["kv_replication"] == 2
    assert r.gpu["kv_capacity_bytes"] == 650 * GIB
    assert r.gpu["max_concurrency_at_context"] == 16 and r.gpu["fits"] is True
    assert calc.calculate(cfg("llama-3.1-70b.json"), context=128 * 1024, concurrency=17, gpu="100GiB",
                          gpus=16, weights_bytes=140 * GIB).gpu["fits"] is False
    eight = calc.calculate(cfg("llama-3.1-70b.json"), context=16, gpu="h100", gpus=8)
    assert eight.gpu["kv_replication"] == 1


def test_mla_latent_width_and_replication():
    # DeepSeek-style MLA: one latent of kv_lora_rank + qk_rope_head_dim = 512 + 64 elements per layer.
    config = {"num_hidden_layers": 2, "num_attention_heads": 16, "hidden_size": 1024, "kv_lora_rank": 512,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16"}
    r = calc.calculate(config, context=16, gpu="10GiB", gpus=4, weights_bytes=1 * GIB)
    assert r.kv_bytes_per_token == 2 * 576 * 2
    assert r.model["mla"] is True
    assert r.gpu["kv_replication"] == 4  # the latent is on every rank
