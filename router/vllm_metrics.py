"""vLLM's ``/metrics`` page read into a ``WorkerLoad``: the one place that knows the engine's metric names
(the engine wire format behind an adapter, as the KV events are in indexer/events/wire.py)."""
from __future__ import annotations

import math
import time

from prometheus_client.parser import text_string_to_metric_families

from router.worker import WorkerLoad


_LATENCY_HISTOGRAMS = {"vllm:inter_token_latency_seconds": "itl", "vllm:time_to_first_token_seconds": "ttft",
                       "vllm:request_queue_time_seconds": "queue", "vllm:e2e_request_latency_seconds": "e2e",
                       "vllm:request_inference_time_seconds": "inference"}
_PREFILL_HISTOGRAMS = {"vllm:request_prefill_kv_computed_tokens": "prefill_tokens",
                       "vllm:request_prefill_time_seconds": "prefill_seconds",
                       "vllm:request_prompt_tokens": "prompt_tokens"}


# Every family parse_metrics reads. The rest of a page (histogram buckets, Python and process collectors,
# speculative decoding, LoRA) is dropped before prometheus_client's parser sees it.
_READ = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         *_PREFILL_HISTOGRAMS, *_LATENCY_HISTOGRAMS, "vllm:iteration_tokens_total",
         "vllm:prompt_tokens_by_source", "process_start_time_seconds", "vllm:cache_config_info")
_KEEP = tuple(_READ) + tuple(f"# TYPE {n}" for n in _READ)
# The largest value a series read here can sanely have: a token count of decades at a million tokens a second
# is ~1e15, a request gauge a million. Beyond them an exporter is broken, and the sums and products the
# gateway forms from them overflow (a finite waiting gauge of 1e306 made every plan over the model raise).
MAX_VALUE = 1e15
MAX_REQUESTS = 1e6
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def wanted_metrics(text: str) -> str:
    """The lines of a /metrics page that :func:`parse_metrics` reads: the ``# TYPE`` line and the samples of
    its families, without histogram buckets. Why: prometheus_client's parser is pure Python, ~5 ms per
    page of the simulator (265 lines, 181 of them buckets; vLLM's own pages are longer), and with 16
    workers scraped every second it was 19% of the gateway's CPU in a simulator replay (py-spy). A line of
    another family that shares a prefix is kept and, as before, ignored by the parser's reader."""
    keep = _KEEP
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(keep) and "_bucket" not in line.partition("{")[0]) + "\n"


def parse_metrics(text: str, engine: str | None = None, kept: bool = False) -> tuple[WorkerLoad, int | None]:
    """Load gauges and block size from a vLLM /metrics page: summed over engines (DP ranks), or those of
    one ``engine`` label only (series without that label, such as the process start, always count).
    ``kept``: ``text`` is :func:`wanted_metrics`' output already (the scrape filters a page once for the
    server and each of its ranks)."""
    load = WorkerLoad(updated_at=time.time())
    block_size = None
    usage: list[float] = []
    for fam in text_string_to_metric_families(text if kept else wanted_metrics(text)):
        name = fam.name
        if engine is not None:
            fam.samples = [s for s in fam.samples if s.labels.get("engine", engine) == engine]
        # every series read here is a count, a share, a sum of durations or a time: one that is not a finite
        # non-negative number within its bound is a broken exporter's, dropped (a +Inf running gauge made
        # every plan over the model fail: int(inf)), and counted; the value stays at its default
        top = MAX_REQUESTS if name in _GAUGES else MAX_VALUE
        good = [s for s in fam.samples if math.isfinite(s.value) and 0 <= s.value <= top]
        if len(good) != len(fam.samples):
            load.rejected += len(fam.samples) - len(good)
            fam.samples = good
        if name == "vllm:num_requests_running":
            load.running += sum(s.value for s in fam.samples)
        elif name == "vllm:num_requests_waiting":
            load.waiting += sum(s.value for s in fam.samples)
        elif name == "vllm:kv_cache_usage_perc":
            usage.extend(s.value for s in fam.samples)
        elif name in _PREFILL_HISTOGRAMS:
            for smp in fam.samples:
                if smp.name == name + "_sum":
                    setattr(load, _PREFILL_HISTOGRAMS[name], getattr(load, _PREFILL_HISTOGRAMS[name]) + smp.value)
                elif smp.name == name + "_count" and name == "vllm:request_prefill_time_seconds":
                    load.prefill_requests += smp.value
        elif name in _LATENCY_HISTOGRAMS:
            attr = _LATENCY_HISTOGRAMS[name]
            total, count = getattr(load, attr)
            for smp in fam.samples:
                if smp.name == name + "_sum":
                    total += smp.value
                elif smp.name == name + "_count":
                    count += smp.value
            setattr(load, attr, (total, count))
        elif name == "vllm:iteration_tokens_total":
            load.steps += sum(smp.value for smp in fam.samples if smp.name == name + "_count")
        elif name == "vllm:prompt_tokens_by_source":
            computed = [smp.value for smp in fam.samples if smp.labels.get("source") == "local_compute"
                        and smp.name == name + "_total"]
            if computed:
                load.computed_tokens = (load.computed_tokens or 0.0) + sum(computed)
        elif name == "process_start_time_seconds":
            for s in fam.samples:
                load.process_start = s.value
        elif name == "vllm:cache_config_info":
            for s in fam.samples:
                bs = s.labels.get("block_size")
                if bs and bs.isdigit():
                    block_size = int(bs)
                nb = s.labels.get("num_gpu_blocks")
                if nb and nb.isdigit():
                    load.num_gpu_blocks = (load.num_gpu_blocks or 0) + int(nb)
    if usage:
        load.kv_usage = max(usage)
    else:  # none, or none valid (an exporter with another name): the room is unknown, not all free
        load.usage_known = False
    return load, block_size
