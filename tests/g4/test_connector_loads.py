"""The connector's worker side (cache_tier/connector_worker.py) on its own, in the vLLM environment (the
connector imports vLLM), with its real store and thread pools and CPU KV tensors; vLLM's config objects
are the fields the connector reads, filled by hand (no engine runs: the end-to-end tests in
tests/g4/test_vllm_g4_async.py run it inside real vLLM). The store is paced to a slow shared filesystem's
bandwidth (its ``read_bytes_per_s`` option) so that the order of loads shows in their timing."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.vllm_server import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

if not (vllm_python().parent.parent / ".kvgate-ready").exists():  # `make test` builds it
    pytestmark.append(pytest.mark.skip(reason="vLLM env missing: run `make vllm-env`"))

ROOT = Path(__file__).resolve().parents[2]

# one step of load_async=auto: request A's 30 blocks go to the background, request B's 1 block in the step
STEP = r"""
import json, sys, time
from types import SimpleNamespace as NS

import torch

from cache_tier.connector import BlockOp, ConnectorConfig
from cache_tier.connector_worker import WorkerSide
from cache_tier.store import _Pace

B, BLOCKS = 4, 64
spec = NS(dtype=torch.float32, block_size=B, num_kv_heads=1, head_size=4, page_size_bytes=2 * B * 4 * 4)
kvc = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0", "l1"])], num_blocks=BLOCKS,
         kv_cache_layout=None)
vc = NS(parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1), attention_config=None)
w = WorkerSide(vc, kvc, ConnectorConfig(g4_path=sys.argv[1], model="m", read_threads=2, kv_layout="test"))
w.register({n: torch.zeros(2, BLOCKS, B, 1, 4) for n in ("l0", "l1")})
payload = torch.ones(w.ns.payload_bytes // 4)
background = []
for i in range(30):
    toks = list(range(i * B, (i + 1) * B))
    w.store.put(0x100 + i, toks, None, payload)
    background.append(BlockOp(i, 0x100 + i, None, toks))
w.store.put(0x999, [7] * B, None, payload)
w.store._pace = _Pace(w.store.file_bytes / 0.02)  # 20 ms a block, all readers together
w.load({"A": background}, True)
t0 = time.perf_counter()
w.load({"B": [BlockOp(40, 0x999, None, [7] * B)]})  # returns when B's block is in place
in_step = time.perf_counter() - t0
while w.counters["loads"] < 31 and time.perf_counter() - t0 < 10:
    time.sleep(0.01)
c = w.counters
print(json.dumps({"in_step_s": in_step, "loads": c["loads"], "failures": c["load_failures"]}))
w.shutdown()
"""


def test_an_in_step_load_does_not_wait_behind_the_background_loads(tmp_path):
    """With ``load_async: auto`` one step can hold both: a long load in the background (its request waits)
    and a short one in the step (the forward pass waits for it). On one thread pool the in-step block
    queued behind the 30 background ones: 0.6 s at 20 ms a block, the whole step stalled on the load it
    had sent to the background."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(vllm_python()), "-c", STEP, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loads"] == 31 and res["failures"] == 0  # every block loaded, the background ones too
    assert res["in_step_s"] < 0.3, res  # its own block and a couple already being read, not the 30


# the namespace and the prefetch endpoint of a worker in pipeline stage `stage` (of 2, TP 1 in each)
STAGE = r"""
import json, sys
from types import SimpleNamespace as NS

import torch
import vllm.distributed.parallel_state as ps

from cache_tier.connector import ConnectorConfig
from cache_tier.connector_worker import WorkerSide

stage = int(sys.argv[2])
ps.get_tensor_model_parallel_rank = lambda: 0
ps.get_tensor_model_parallel_world_size = lambda: 1
ps.get_pp_group = lambda: NS(rank_in_group=stage)
spec = NS(dtype=torch.float32, block_size=4, num_kv_heads=1, head_size=4, page_size_bytes=2 * 4 * 4 * 4)
layers = [f"model.layers.{stage * 2 + i}.attn" for i in range(2)]  # as many layers in each stage
kvc = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=layers)], num_blocks=8, kv_cache_layout=None)
vc = NS(parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=2), attention_config=None)
cfg = ConnectorConfig(g4_path=sys.argv[1], model="m", kv_layout="test", prefetch_port=int(sys.argv[3]))
w = WorkerSide(vc, kvc, cfg)
print(json.dumps({"digest": w.ns.digest, "rank": w.rank, "serves": w.server is not None}))
w.shutdown()
"""


def test_each_pipeline_stage_has_its_own_namespace_and_only_the_first_serves_prefetch(tmp_path):
    from tests.support.procs import free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    res = []
    for stage in (0, 1):
        out = subprocess.run([str(vllm_python()), "-c", STAGE, str(tmp_path), str(stage), str(port)], env=env,
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        res.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert res[0]["digest"] != res[1]["digest"] and [r["rank"] for r in res] == [0, 1]
    assert [r["serves"] for r in res] == [True, False]
