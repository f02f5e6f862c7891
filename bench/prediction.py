"""How far kvgate's predictions were from what happened, from its own decision records
(``GET /admin/decisions``): observed / predicted TTFT (streamed responses) and the share of requests whose
predicted cached tokens equal vLLM's delivered ``cached_tokens``; and the gateway's own time per request
(``timings_ms``: reading the body, tokenizing, and all it added before the client's first byte) and the
time requests were held at its prefill gate."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def accuracy(decisions: list[dict]) -> dict:
    ratios = [d["observed_ttft_ms"] / d["predicted_ttft_ms"] for d in decisions
              if d.get("observed_ttft_ms") and d.get("predicted_ttft_ms")]
    cached = [(d.get("predicted_cached_tokens"), d["delivered_cached_tokens"]) for d in decisions
              if d.get("outcome") == "ok" and d.get("delivered_cached_tokens") is not None]
    over = sum(1 for p, got in cached if (p or 0) > got)
    stages = {}
    for stage in ("read", "tokenize", "first_byte"):
        ms = [t[stage] for d in decisions if isinstance(t := d.get("timings_ms"), dict)
              and isinstance(t.get(stage), (int, float))]
        stages[f"{stage}_ms_mean"] = float(np.mean(ms)) if ms else None
    gate = [d["gate_wait_ms"] for d in decisions if isinstance(d.get("gate_wait_ms"), (int, float))]
    stages["gate_wait_ms_mean"] = float(np.mean(gate)) if gate else None  # held at the prefill gate
    return {
        **stages,
        "ttft_ratio_samples": len(ratios),
        "ttft_ratio_p50": float(np.percentile(ratios, 50)) if ratios else None,
        "ttft_ratio_p90": float(np.percentile(ratios, 90)) if ratios else None,
        "cached_samples": len(cached),
        "cached_exact_share": sum(1 for p, got in cached if (p or 0) == got) / len(cached) if cached else None,
        "cached_over_share": over / len(cached) if cached else None,
    }


MAX_DECISIONS = 100_000  # what one GET /admin/decisions returns at most


def fetch(base_url: str, timeout: float = 30.0, save: Path | None = None) -> dict:
    """:func:`accuracy` of a running gateway's kept decisions (``routing.decisions_kept`` bounds them);
    ``save``: also write the records there (JSON), to study where the model is off."""
    import httpx

    try:
        dec = httpx.get(base_url + "/admin/decisions", params={"limit": MAX_DECISIONS}, timeout=timeout).json()
        if save is not None:
            save.write_text(json.dumps(dec["decisions"]))
        return accuracy(dec["decisions"])
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:200]}
