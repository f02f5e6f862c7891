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
done = []  # blocks in the order their reads completed
read = w.store.read
w.store.read = lambda h, toks=None: (read(h, toks), done.append(h))[0]
w.load({"A": background}, True)
w.load({"B": [BlockOp(40, 0x999, None, [7] * B)]})  # returns when B's block is in place
before = len(done) - 1  # background blocks read before B's
t0 = time.perf_counter()
while w.counters["loads"] < 31 and time.perf_counter() - t0 < 10:
    time.sleep(0.01)
c = w.counters
print(json.dumps({"before": before, "loads": c["loads"], "failures": c["load_failures"]}))
w.shutdown()
"""


def test_an_in_step_load_does_not_wait_behind_the_background_loads(tmp_path):
    """With ``load_async: auto`` one step can hold both: a long load in the background (its request waits)
    and a short one in the step (the forward pass waits for it). On one thread pool the in-step block
    queued behind the 30 background ones: 0.6 s at 20 ms a block, the whole step stalled on the load it
    had sent to the background. Counted in blocks read before it (not seconds: the host is shared)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(vllm_python()), "-c", STEP, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loads"] == 31 and res["failures"] == 0  # every block loaded, the background ones too
    assert res["before"] <= 4, res  # the couple already being read, not the 30


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


# one step on tensor-parallel rank argv[2] of 2 (gloo on this host): request R loads block 0xA0 in the step
# (only rank 1 has its file) and computes 0xA1; request S computes 0xB0 and loads nothing
TP_STEP = r"""
import json, os, sys
from types import SimpleNamespace as NS

import torch
import torch.distributed as dist
import vllm.distributed.parallel_state as ps

from cache_tier.connector import BlockOp, ConnectorConfig
from cache_tier.connector_worker import WorkerSide

root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=sys.argv[3], world_size=2, rank=rank)
ps.get_tensor_model_parallel_rank = lambda: rank
ps.get_tensor_model_parallel_world_size = lambda: 2
ps.get_pp_group = lambda: NS(rank_in_group=0)
ps.get_tp_group = lambda: NS(world_size=2, cpu_group=dist.group.WORLD)
B = 4
spec = NS(dtype=torch.float32, block_size=B, num_kv_heads=1, head_size=4, page_size_bytes=2 * B * 4 * 4)
kvc = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0", "l1"])], num_blocks=16,
         kv_cache_layout=None)
vc = NS(parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=1), attention_config=None)
w = WorkerSide(vc, kvc, ConnectorConfig(g4_path=root, model="m", kv_layout="test"))
w.register({n: torch.zeros(2, 16, B, 1, 4) for n in ("l0", "l1")})
if rank == 1:
    w.store.put(0xA0, [1] * B, None, torch.ones(w.ns.payload_bytes // 4))
w.load({"R": [BlockOp(3, 0xA0, None, [1] * B)]})
w.save({"R": [BlockOp(4, 0xA1, 0xA0, [2] * B)], "S": [BlockOp(5, 0xB0, None, [3] * B)]})
w.shutdown()  # the writer is done
m = w.take_worker_meta()
print(json.dumps({"rank": w.rank, "failed_loads": m.failed_loads, "saved": m.saved, "dropped": m.dropped,
                  "files": sorted(h for h in (0xA1, 0xB0) if os.path.exists(w.store.path(h)))}))
dist.destroy_process_group()
"""


def test_a_load_that_fails_on_one_tensor_parallel_rank_drops_the_step_s_saves_on_every_rank(tmp_path):
    """The ranks' partial results are summed every layer, so the KV a request computes in the step of a
    load that failed on one rank is wrong on all of them. Rank 1 loaded the block fine and used to save
    the request's new block from that step: with rank 0's correct copy written later (a save never
    replaces a file), G4 served the pair, rank 1's half wrong. Two real processes, gloo all-reduce."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    init = f"file://{tmp_path}/pg"
    procs = [subprocess.Popen([str(vllm_python()), "-c", TP_STEP, str(tmp_path / "g4"), str(r), init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    res = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        res.append(json.loads(out.strip().splitlines()[-1]))
    for r in res:
        assert r["failed_loads"] == ["R"], r  # both report it: the scheduler rewinds R's saves
        assert r["dropped"] == [0xA1] and r["saved"] == [0xB0], r  # S's save is untouched
        assert r["files"] == [0xB0], r  # no rank wrote R's block of the failed step


# pipeline stage 1's worker (of 2) and the engine's scheduler side, one request R of four full blocks: block
# 0 loads from G4 in the step, 1-3 are computed. Stage 0's load of block 0 fails and stage 1 (its layers'
# copy loaded fine) computes 1-3 from stage 0's wrong hidden states and saves them; vLLM then recomputes R.
PP_RESAVE = r"""
import json, sys, time
from types import SimpleNamespace as NS

import torch
import vllm.distributed.parallel_state as ps

from cache_tier.connector import ConnectorConfig, KvgateWorkerMeta
from cache_tier.connector_scheduler import SchedulerSide
from cache_tier.connector_worker import WorkerSide

root = sys.argv[1]
B, N = 4, 4
spec = NS(dtype=torch.float32, block_size=B, num_kv_heads=1, head_size=4, page_size_bytes=2 * B * 4 * 4)
vc = NS(parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=2), attention_config=None)
cfg = ConnectorConfig(g4_path=root, model="m", kv_layout="test", load_async=False)
sched = SchedulerSide(vc, NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0", "l1"])], num_blocks=16,
                             kv_cache_layout=None), cfg)
ps.get_tensor_model_parallel_rank = lambda: 0
ps.get_tensor_model_parallel_world_size = lambda: 1
ps.get_pp_group = lambda: NS(rank_in_group=1)
w = WorkerSide(vc, NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l2", "l3"])], num_blocks=16,
                      kv_cache_layout=None), cfg)
kv = {n: torch.zeros(2, 16, B, 1, 4) for n in ("l2", "l3")}
w.register(kv)
req = NS(request_id="R", all_token_ids=list(range(N * B + 1)), num_tokens=N * B + 1, num_prompt_tokens=N * B + 1,
         block_hashes=[], lora_request=None, cache_salt=None, mm_features=None, prompt_embeds=None)
ids = [10, 11, 12, 13, 14]
st = sched.track(req)
h = sched._hashes(st, N)
sched.store.put(h[0], req.all_token_ids[:B], None, torch.ones(sched.ns.payload_bytes // 4))
assert sched.get_num_new_matched_tokens(req, 0) == (B, False)
sched.update_state_after_alloc(req, NS(get_block_ids=lambda: [ids]), B)
kvm = NS(get_block_ids=lambda rid: [ids])
so = NS(scheduled_new_reqs=[NS(req_id="R", num_computed_tokens=B)],
        scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]), num_scheduled_tokens={"R": (N - 1) * B + 1})
meta = sched.build_meta(so, kvm)
for t in kv.values():
    t.fill_(-1.0)  # the failed step's KV on this stage: wrong
w.save(meta.saves)
t0 = time.time()
while w.counters["saves_written"] < N - 1 and time.time() - t0 < 30:  # stage 1's wrong blocks are written
    time.sleep(0.01)
mine = w.take_worker_meta()
sched.update_output(NS(kv_connector_worker_meta=KvgateWorkerMeta(  # stage 0 and this stage, aggregated
    saved=mine.saved, dropped=[x.hash for x in meta.saves["R"]], failed_loads=["R"], lost=[h[0]])))
so = NS(scheduled_new_reqs=[], scheduled_cached_reqs=NS(req_ids=["R"], num_computed_tokens=[0]),
        num_scheduled_tokens={"R": N * B + 1})
meta = sched.build_meta(so, kvm)  # the recompute's step
for t in kv.values():
    t.fill_(2.0)  # the recomputed KV: right
w.save(meta.saves)
w.shutdown()
print(json.dumps({"resaved": [x.hash for x in meta.saves.get("R", [])], "hashes": h,
                  "values": [float(w.store.read(x).view(torch.float32).mean()) for x in h[1:]]}))
"""


def test_a_pipeline_stage_s_blocks_from_a_failed_load_step_are_overwritten_by_the_recompute(tmp_path):
    """A later pipeline stage cannot know that an earlier one's in-step load failed: it computes the
    request's new blocks from wrong hidden states and saves them. The scheduler hears of the failure
    after the step and has vLLM's recompute save the blocks again; that save used to leave an existing
    file alone, so the wrong copy stayed on G4 for good (and was served once stage 0 saved its half)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(vllm_python()), "-c", PP_RESAVE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["resaved"] == res["hashes"][1:], res  # all it computed is saved again (block 0 is on G4)
    assert res["values"] == [2.0, 2.0, 2.0], res  # stage 1's files hold the recomputed KV


# the prefetch endpoints of two data-parallel engines on one host (TP 1 each): one process stands for both
DP = r"""
import json, sys
from types import SimpleNamespace as NS

import torch

from cache_tier.connector import ConnectorConfig
from cache_tier.connector_worker import WorkerSide

spec = NS(dtype=torch.float32, block_size=4, num_kv_heads=1, head_size=4, page_size_bytes=2 * 4 * 4 * 4)
kvc = NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0"])], num_blocks=8, kv_cache_layout=None)
cfg = ConnectorConfig(g4_path=sys.argv[1], model="m", kv_layout="test", prefetch_port=int(sys.argv[2]))
ws = []
for dp in (0, 1):  # a dense model's independent ranks: vLLM resets data_parallel_rank, not the index
    pc = NS(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0, data_parallel_index=dp)
    ws.append(WorkerSide(NS(parallel_config=pc, attention_config=None), kvc, cfg))
print(json.dumps({"ports": [w.server.server_address[1] for w in ws]}))
for w in ws:
    w.shutdown()
"""


def test_each_data_parallel_engine_serves_prefetch_on_the_port_the_gateway_sends_its_rank_to(tmp_path):
    """Two engines of a ``--data-parallel-size 2`` server on one host, each with TP rank 0: both bound the
    one prefetch port, and the second failed to start (EADDRINUSE in its connector). Rank r serves on the
    port + r, which is where the gateway sends rank r's orders (router/worker.py RankTarget)."""
    from router.worker import RankTarget, Worker
    from router.config import WorkerConfig
    from tests.support.procs import free_port

    port = free_port()  # and the one after it, for rank 1
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(vllm_python()), "-c", DP, str(tmp_path), str(port)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    ports = json.loads(out.stdout.strip().splitlines()[-1])["ports"]
    server = Worker(name="dp", url="http://127.0.0.1:8000", config=WorkerConfig(url="http://127.0.0.1:8000"))
    server.prefetch_url = f"http://127.0.0.1:{port}"  # what the registry resolves from g4.prefetch_port
    gateway = [int(RankTarget(server, r).prefetch_url.rsplit(":", 1)[1]) for r in (0, 1)]
    assert ports == gateway == [port, port + 1]
