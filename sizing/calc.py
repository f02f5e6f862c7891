"""KV-cache sizing arithmetic: how many bytes of KV a prompt costs, whether a fleet's GPUs hold it after the
weights, and how long loading it from G4 takes compared with recomputing it.

Pure functions over a model's Hugging Face ``config.json``; the ``kvgate calc`` command (sizing.cli)
is only argument parsing and printing around :func:`calculate`.

Conventions (stated so the figures can be checked by hand):
- KV bytes per token per layer = 2 (K and V) x KV heads x head dim x KV dtype bytes. MLA models (DeepSeek
  style, ``kv_lora_rank``) store one latent of ``kv_lora_rank + qk_rope_head_dim`` elements per layer.
- Sliding-window layers hold at most ``sliding_window`` tokens per request; full-attention layers hold all.
- Token counts are rounded up to whole KV blocks (``block_size``, vLLM's default 16 on GPUs).
- GPU sizes are the total memory CUDA reports (nvidia-smi), which is what vLLM's ``gpu_memory_utilization``
  multiplies. The KV budget is ``total x utilization - weights - overhead``; weights are sharded over
  ``gpus`` (tensor parallelism) and the budget is summed over them.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


class CalcError(ValueError):
    """A configuration or argument the calculator cannot use; the message says which and why."""


# Total device memory as nvidia-smi / cudaMemGetInfo report it (MiB).
GPUS: dict[str, tuple[str, int]] = {
    "h100": ("NVIDIA H100 80GB", 81_559 * MIB),
    "rtx-pro-6000": ("NVIDIA RTX PRO 6000 Blackwell 96GB", 97_887 * MIB),
    "h200": ("NVIDIA H200 141GB", 143_771 * MIB),
}
_GPU_ALIASES = {
    "h100-80gb": "h100", "h100-sxm": "h100", "h100-80": "h100",
    "rtxpro6000": "rtx-pro-6000", "rtx-pro6000": "rtx-pro-6000", "rtx6000-pro": "rtx-pro-6000",
    "rtx-pro-6000-96gb": "rtx-pro-6000", "h200-141gb": "h200", "h200-141": "h200",
}

DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "kib": 1 << 10, "mib": MIB, "gib": GIB, "tib": 1 << 40,
}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TOKEN_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20}


def _parse(text: str | float | int, units: dict[str, float], what: str) -> float:
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*(?:/s)?\s*", str(text).lower())
        if not m or m.group(2) not in units:
            raise CalcError(f"cannot read {what} {text!r} (examples: {', '.join(_examples(units))})")
        value = float(m.group(1)) * units[m.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise CalcError(f"{what} must be a positive number, got {text!r}")
    return value


def _examples(units: dict[str, float]) -> list[str]:
    if units is _SIZE_UNITS:
        return ["80GiB", "96GB", "2e9"]
    if units is _TOKEN_UNITS:
        return ["131072", "128K"]
    return ["70B", "120e9"]


def parse_size(text: str | float | int, what: str = "size") -> float:
    """Bytes from ``"80GiB"``, ``"141GB"``, ``"2e9"`` or ``"10GB/s"`` (decimal GB, binary GiB)."""
    return _parse(text, _SIZE_UNITS, what)


def parse_count(text: str | float | int, what: str = "count") -> float:
    """A parameter count from ``"70B"``, ``"120e9"`` or ``"8.03B"``."""
    return _parse(text, _COUNT_UNITS, what)


def parse_tokens(text: str | float | int, what: str = "token count") -> int:
    """Tokens from ``"131072"`` or ``"128K"`` (K = 1024, as context lengths are quoted)."""
    value = _parse(text, _TOKEN_UNITS, what)
    if value != int(value):
        raise CalcError(f"{what} must be a whole number of tokens, got {text!r}")
    return int(value)


def resolve_gpu(text: str) -> tuple[str, int]:
    """A known GPU name (h100, rtx-pro-6000, h200) or a memory size -> (label, bytes per GPU)."""
    key = text.strip().lower().replace("_", "-").replace(" ", "-")
    key = _GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    try:
        size = parse_size(text, "GPU memory")
    except CalcError:
        raise CalcError(
            f"unknown GPU {text!r}: use one of {', '.join(GPUS)} or a memory size such as 80GiB"
        ) from None
    return (f"custom {size / GIB:.1f} GiB", int(size))


def dtype_bytes(name: Any, what: str = "dtype") -> float:
    if not isinstance(name, str) or name.lower().replace("torch.", "") not in DTYPE_BYTES:
        raise CalcError(f"unsupported {what} {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[name.lower().replace("torch.", "")]


# ----------------------------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """What the KV arithmetic needs from a config: one entry per layer, None (full) or its window."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_elements_per_layer: int  # per token: 2 x kv heads x head dim, or the MLA latent width
    dtype: str
    dtype_bytes: float
    layer_windows: tuple[int | None, ...]
    params: float  # estimated parameter count
    weight_bytes: float  # estimated checkpoint bytes (quantization aware)
    mla: bool = False

    @property
    def full_layers(self) -> int:
        return sum(1 for w in self.layer_windows if w is None)

    @property
    def sliding_layers(self) -> int:
        return self.num_layers - self.full_layers


def load_config(path: str | Path) -> dict:
    """Read ``config.json`` (or a directory holding one) as a dict; errors name the file."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CalcError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalcError(f"{p}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CalcError(f"{p}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CalcError(f"{p}: expected a JSON object (a Hugging Face config.json)")
    return data


def _int_field(cfg: dict, key: str, *, required: bool = True, default: int | None = None) -> int | None:
    value = cfg.get(key, default)
    if value is None:
        if required:
            raise CalcError(f"config has no {key!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CalcError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _text_config(cfg: dict) -> dict:
    """Multimodal configs (Llama 4, Gemma 3, Qwen-VL) keep the language model under ``text_config``."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" in inner:
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(inner)
        return merged
    return cfg


def layer_windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Per layer: None for full attention, or the sliding window in tokens.

    Recognises ``layer_types`` (gpt-oss, Gemma, newer Qwen), Qwen2's ``use_sliding_window`` with
    ``max_window_layers`` (the first ``max_window_layers`` layers are full), and a bare ``sliding_window``
    (Mistral v0.1: every layer slides).
    """
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise CalcError(f"config field 'sliding_window' must be a positive integer or null, got {window!r}")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise CalcError(
                f"config field 'layer_types' must list {num_layers} layers (num_hidden_layers), "
                f"got {len(types) if isinstance(types, list) else type(types).__name__}"
            )
        out: list[int | None] = []
        for i, t in enumerate(types):
            if t in ("full_attention", "attention", "global_attention"):
                out.append(None)
            elif t in ("sliding_attention", "local_attention", "chunked_attention"):
                w = cfg.get("attention_chunk_size") if t == "chunked_attention" else window
                if not w:
                    raise CalcError(f"layer {i} is {t!r} but the config gives no window size")
                out.append(int(w))
            else:
                raise CalcError(f"layer {i} has unknown type {t!r} in 'layer_types'")
        return tuple(out)
    if "use_sliding_window" in cfg:  # Qwen2 / Qwen2.5 / Qwen3
        if not cfg.get("use_sliding_window") or window is None:
            return (None,) * num_layers
        first_full = cfg.get("max_window_layers", 0) or 0
        if isinstance(first_full, bool) or not isinstance(first_full, int) or first_full < 0:
            raise CalcError("config field 'max_window_layers' must be a non-negative integer, "
                            f"got {first_full!r}")
        return tuple(None if i < first_full else window for i in range(num_layers))
    pattern = cfg.get("sliding_window_pattern")
    if window is not None and isinstance(pattern, int) and pattern > 0:  # Gemma 2/3: every pattern-th is full
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if window is not None:  # Mistral v0.1 style: every layer slides
        return (window,) * num_layers
    return (None,) * num_layers


def _estimate_params(cfg: dict, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                     dtype_b: float) -> tuple[float, float]:
    """(parameter count, weight bytes) from the shapes: attention + MLP or experts + embeddings.

    Biases and norms are ignored (well under 0.1 % for these models). Quantized checkpoints: MXFP4
    (gpt-oss) stores expert weights at 4.25 bits; fp8 at 1 byte; GPTQ/AWQ at ``bits``; embeddings and
    attention stay at the config dtype where the format leaves them unquantized.
    """
    vocab = cfg.get("vocab_size") or 0
    if "kv_lora_rank" in cfg:  # MLA: q through an optional low rank, kv through the latent
        q_rank = cfg.get("q_lora_rank")
        qk_head = (cfg.get("qk_nope_head_dim") or 0) + (cfg.get("qk_rope_head_dim") or 0)
        v_head = cfg.get("v_head_dim") or head_dim
        q = hidden * q_rank + q_rank * heads * qk_head if q_rank else hidden * heads * qk_head
        kv = hidden * (cfg["kv_lora_rank"] + (cfg.get("qk_rope_head_dim") or 0))
        kv += cfg["kv_lora_rank"] * heads * ((cfg.get("qk_nope_head_dim") or 0) + v_head)
        attn = q + kv + heads * v_head * hidden
    else:
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    inter = cfg.get("intermediate_size") or 4 * hidden
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    moe_inter = cfg.get("moe_intermediate_size") or inter
    shared = (cfg.get("n_shared_experts") or 0) * 3 * hidden * moe_inter
    if cfg.get("shared_expert_intermediate_size"):
        shared += 3 * hidden * cfg["shared_expert_intermediate_size"]
    if experts:
        dense_layers = min(cfg.get("first_k_dense_replace") or 0, layers)
        moe_layers = layers - dense_layers
        expert_params = moe_layers * experts * 3 * hidden * moe_inter
        dense_mlp = dense_layers * 3 * hidden * inter + moe_layers * (shared + hidden * experts)
    else:
        expert_params = 0
        dense_mlp = layers * 3 * hidden * inter
    attn_params = layers * attn
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    params = attn_params + dense_mlp + expert_params + embed

    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower() if isinstance(quant, dict) else ""
    if method == "mxfp4":
        weight_bytes = expert_params * 4.25 / 8 + (attn_params + dense_mlp + embed) * dtype_b
    elif method in ("fp8", "fbgemm_fp8"):
        weight_bytes = (attn_params + dense_mlp + expert_params) * 1 + embed * dtype_b
    elif method in ("gptq", "awq") and isinstance(quant.get("bits"), int):
        weight_bytes = (attn_params + dense_mlp + expert_params) * quant["bits"] / 8 + embed * dtype_b
    else:
        weight_bytes = params * dtype_b
    return float(params), float(weight_bytes)


def model_shape(cfg: dict, *, name: str | None = None, kv_dtype: str | None = None) -> ModelShape:
    """Parse the fields the calculator needs; raise :class:`CalcError` naming what is missing or wrong."""
    if not isinstance(cfg, dict):
        raise CalcError("expected a JSON object (a Hugging Face config.json)")
    cfg = _text_config(cfg)
    layers = _int_field(cfg, "num_hidden_layers")
    heads = _int_field(cfg, "num_attention_heads")
    kv_heads = _int_field(cfg, "num_key_value_heads", required=False) or heads
    hidden = _int_field(cfg, "hidden_size")
    head_dim = _int_field(cfg, "head_dim", required=False)
    if head_dim is None:
        if hidden % heads:
            raise CalcError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}; "
                            "the config must give head_dim")
        head_dim = hidden // heads
    if kv_heads > heads:
        raise CalcError(f"num_key_value_heads {kv_heads} exceeds num_attention_heads {heads}")
    model_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    model_dtype_b = dtype_bytes(model_dtype, "model dtype")
    if kv_dtype in (None, "", "auto"):
        kv_name, kv_b = str(model_dtype).replace("torch.", ""), model_dtype_b
    else:
        kv_name, kv_b = kv_dtype, dtype_bytes(kv_dtype, "KV cache dtype")
    mla = "kv_lora_rank" in cfg
    if mla:
        rank = _int_field(cfg, "kv_lora_rank")
        rope = _int_field(cfg, "qk_rope_head_dim", required=False, default=0) or 0
        elems = rank + rope
    else:
        elems = 2 * kv_heads * head_dim
    windows = layer_windows(cfg, layers)
    params, weight_bytes = _estimate_params(cfg, hidden, layers, heads, kv_heads, head_dim, model_dtype_b)
    label = name or cfg.get("_name_or_path") or "/".join(cfg.get("architectures") or []) or cfg.get(
        "model_type", "model")
    return ModelShape(
        name=str(label), num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
        kv_elements_per_layer=elems, dtype=kv_name, dtype_bytes=kv_b, layer_windows=windows,
        params=params, weight_bytes=weight_bytes, mla=mla,
    )


# ----------------------------------------------------------------------------------------------- arithmetic


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def kv_bytes_for(shape: ModelShape, tokens: int, block_size: int = 16) -> int:
    """KV bytes one request of ``tokens`` tokens holds: full layers all tokens, sliding ones their window."""
    per_layer = shape.kv_elements_per_layer * shape.dtype_bytes
    total = 0.0
    for window in shape.layer_windows:
        held = tokens if window is None else min(tokens, window)
        total += per_layer * _round_up(held, block_size)
    return int(round(total))


@dataclass
class CalcResult:
    """Everything ``kvgate calc`` prints; ``to_dict`` is the ``--json`` document."""

    model: dict
    context_tokens: int
    concurrency: int
    block_size: int
    kv_bytes_per_token: int  # all layers, below the smallest window
    kv_bytes_per_token_full_layers: int  # marginal cost once past every window
    kv_bytes_per_request: int
    kv_bytes_total: int
    gpu: dict | None = None
    g4: dict | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def calculate(
    cfg: dict,
    *,
    context: int,
    concurrency: int = 1,
    block_size: int = 16,
    kv_dtype: str | None = None,
    name: str | None = None,
    gpu: str | None = None,
    gpus: int = 1,
    utilization: float = 0.9,
    overhead_bytes: float = 0.0,
    params: float | None = None,
    bytes_per_param: float | None = None,
    weights_bytes: float | None = None,
    g4_bandwidth: float | None = None,
    prefill_rate: float | None = None,
    prompt_tokens: int | None = None,
) -> CalcResult:
    """Size the KV cache of ``concurrency`` requests of ``context`` tokens; see the module docstring."""
    for label, value in (("context", context), ("concurrency", concurrency), ("block size", block_size),
                         ("GPU count", gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CalcError(f"{label} must be a positive integer, got {value!r}")
    if not 0 < utilization <= 1:
        raise CalcError(f"GPU memory utilization must be in (0, 1], got {utilization!r}")
    if overhead_bytes < 0:
        raise CalcError(f"overhead must not be negative, got {overhead_bytes!r}")
    shape = model_shape(cfg, name=name, kv_dtype=kv_dtype)
    per_layer = shape.kv_elements_per_layer * shape.dtype_bytes
    per_request = kv_bytes_for(shape, context, block_size)
    total = per_request * concurrency
    result = CalcResult(
        model={
            "name": shape.name, "layers": shape.num_layers, "full_attention_layers": shape.full_layers,
            "sliding_window_layers": shape.sliding_layers,
            "sliding_windows": sorted({w for w in shape.layer_windows if w is not None}),
            "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "kv_dtype": shape.dtype,
            "kv_dtype_bytes": shape.dtype_bytes, "mla": shape.mla, "estimated_params": shape.params,
            "estimated_weight_bytes": shape.weight_bytes,
        },
        context_tokens=context, concurrency=concurrency, block_size=block_size,
        kv_bytes_per_token=int(round(per_layer * shape.num_layers)),
        kv_bytes_per_token_full_layers=int(round(per_layer * shape.full_layers)),
        kv_bytes_per_request=per_request, kv_bytes_total=total,
    )
    if shape.sliding_layers:
        tail = (f"so per-token cost falls to the full layers' {result.kv_bytes_per_token_full_layers:,} B "
                "past the window" if shape.full_layers
                else "so a request's cache stops growing at the window")
        result.notes.append(f"{shape.sliding_layers} of {shape.num_layers} layers use a sliding window; each "
                            f"holds at most its window per request, {tail}")

    if gpu is not None:
        label, per_gpu = resolve_gpu(gpu)
        if weights_bytes is not None:
            weights, source = float(weights_bytes), "given"
        elif params is not None:
            bpp = bytes_per_param if bytes_per_param is not None else dtype_bytes(
                _text_config(cfg).get("torch_dtype") or _text_config(cfg).get("dtype") or "bfloat16")
            weights, source = float(params) * bpp, f"{params:.4g} params x {bpp:g} B"
        else:
            weights, source = shape.weight_bytes, "estimated from config"
        budget_total = per_gpu * gpus * utilization
        kv_budget = budget_total - weights - overhead_bytes * gpus
        # Tensor parallelism splits KV heads over GPUs; past one head per GPU vLLM replicates them, and an
        # MLA latent is replicated on every rank. Capacity in distinct KV bytes shrinks accordingly.
        replication = gpus if shape.mla else max(1, gpus // shape.num_kv_heads)
        capacity = kv_budget / replication
        fits = capacity >= total
        max_conc = int(capacity // per_request) if capacity > 0 else 0
        result.gpu = {
            "name": label, "count": gpus, "memory_bytes_per_gpu": per_gpu,
            "utilization": utilization, "usable_bytes": budget_total, "weights_bytes": weights,
            "weights_source": source, "overhead_bytes": overhead_bytes * gpus,
            "kv_budget_bytes": max(kv_budget, 0.0), "kv_replication": replication,
            "kv_capacity_bytes": max(capacity, 0.0), "fits": bool(fits),
            "max_concurrency_at_context": max_conc,
            "max_tokens_in_cache": _max_tokens(shape, capacity, block_size),
            "shortfall_bytes": max(0.0, total - capacity),
        }
        if replication > 1:
            result.notes.append(
                f"with {gpus} GPUs each KV {'latent' if shape.mla else 'head'} is stored "
                f"{replication} times, "
                f"so the KV budget holds {human_bytes(max(capacity, 0))} of distinct KV")
        if kv_budget <= 0:
            result.notes.append("the weights alone exceed the usable GPU memory")

    if g4_bandwidth is not None or prefill_rate is not None:
        if g4_bandwidth is None or prefill_rate is None:
            raise CalcError("the G4 comparison needs both --g4-bandwidth and --prefill-rate")
        prompt = prompt_tokens if prompt_tokens is not None else context
        if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt <= 0:
            raise CalcError(f"prompt tokens must be a positive integer, got {prompt!r}")
        prompt_bytes = kv_bytes_for(shape, prompt, block_size)
        load_s = prompt_bytes / g4_bandwidth
        prefill_s = prompt / prefill_rate
        result.g4 = {
            "prompt_tokens": prompt, "prompt_kv_bytes": prompt_bytes, "bandwidth_bytes_per_s": g4_bandwidth,
            "load_s": load_s, "prefill_tokens_per_s": prefill_rate, "prefill_s": prefill_s,
            "speedup": prefill_s / load_s,
            # Bandwidth at which loading is exactly as fast as recomputing.
            "break_even_bandwidth_bytes_per_s": prompt_bytes / prefill_s,
        }
    return result


def _max_tokens(shape: ModelShape, budget: float, block_size: int) -> int | None:
    """Tokens of one request that fit in ``budget`` (monotone in tokens, so bisect on whole blocks).

    None when every layer slides and one request's windows fit: its cache stops growing."""
    if budget <= 0:
        return 0
    if shape.full_layers == 0 and kv_bytes_for(shape, max(shape.layer_windows), block_size) <= budget:
        return None
    lo, hi = 0, 1
    while kv_bytes_for(shape, hi * block_size, block_size) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_bytes_for(shape, mid * block_size, block_size) <= budget:
            lo = mid
        else:
            hi = mid
    return lo * block_size


# ----------------------------------------------------------------------------------------------- formatting


def human_bytes(n: float) -> str:
    """``1.23 GiB``-style, binary units (what nvidia-smi and vLLM logs use)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def human_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def format_table(r: CalcResult) -> str:
    """The human-readable report: one aligned ``label  value`` line per figure, grouped by section."""
    m = r.model
    rows: list[tuple[str, str]] = [
        ("model", m["name"]),
        ("layers", f"{m['layers']} ({m['full_attention_layers']} full, {m['sliding_window_layers']} sliding"
                   + (f", window {', '.join(map(str, m['sliding_windows']))}" if m["sliding_windows"] else "")
                   + ")"),
        ("KV heads x head dim", "MLA latent" if m["mla"] else f"{m['kv_heads']} x {m['head_dim']}"),
        ("KV dtype", f"{m['kv_dtype']} ({m['kv_dtype_bytes']:g} B)"),
        ("", ""),
        ("KV bytes per token", f"{r.kv_bytes_per_token:,} B ({human_bytes(r.kv_bytes_per_token)})"),
    ]
    if m["sliding_window_layers"]:
        rows.append(("  past the window", f"{r.kv_bytes_per_token_full_layers:,} B (full layers only)"))
    rows += [
        ("context x concurrency", f"{r.context_tokens:,} tokens x {r.concurrency}"),
        ("KV per request", f"{r.kv_bytes_per_request:,} B ({human_bytes(r.kv_bytes_per_request)})"),
        ("KV total", f"{r.kv_bytes_total:,} B ({human_bytes(r.kv_bytes_total)})"),
    ]
    if r.gpu:
        g = r.gpu
        rows += [
            ("", ""),
            ("GPU", f"{g['count']} x {g['name']} ({human_bytes(g['memory_bytes_per_gpu'])} each)"),
            ("usable", f"{human_bytes(g['usable_bytes'])} (utilization {g['utilization']:g})"),
            ("weights", f"{human_bytes(g['weights_bytes'])} ({g['weights_source']})"),
        ]
        if g["overhead_bytes"]:
            rows.append(("overhead", human_bytes(g["overhead_bytes"])))
        rows += [
            ("KV budget", human_bytes(g["kv_budget_bytes"]) + (
                f" ({g['kv_replication']}x replicated: {human_bytes(g['kv_capacity_bytes'])} distinct)"
                if g["kv_replication"] > 1 else "")),
            ("fits", "yes" if g["fits"] else f"NO (short by {human_bytes(g['shortfall_bytes'])})"),
            ("max concurrency at context", f"{g['max_concurrency_at_context']:,}"),
            ("max tokens in cache", "unbounded (every layer slides)" if g["max_tokens_in_cache"] is None
             else f"{g['max_tokens_in_cache']:,}"),
        ]
    if r.g4:
        x = r.g4
        rows += [
            ("", ""),
            ("prompt", f"{x['prompt_tokens']:,} tokens, {human_bytes(x['prompt_kv_bytes'])} of KV"),
            ("G4 load", f"{human_seconds(x['load_s'])} at {x['bandwidth_bytes_per_s'] / 1e9:g} GB/s"),
            ("prefill", f"{human_seconds(x['prefill_s'])} at {x['prefill_tokens_per_s']:,.0f} tokens/s"),
            ("speedup (prefill / load)", f"{x['speedup']:.1f}x"),
            ("break-even bandwidth", f"{x['break_even_bandwidth_bytes_per_s'] / 1e9:.3g} GB/s"),
        ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" if k else "" for k, v in rows]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
