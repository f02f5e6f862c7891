"""vLLM's own file-system offload tier as G4, end to end through the gateway.

vLLM's OffloadingConnector does not run on the CPU build, so ``vllm_fs_tier_publisher.py`` runs in vLLM's
environment and produces its KV events with vLLM's own classes (a real Request and block hasher, the GPU
BlockPool, the connector's OffloadingEventsTracker fed the fs tier's OffloadingEvent) and sends them with
vLLM's own ZmqEventPublisher. The gateway (real EventIngestor, Redis index, registry, router) subscribes
as it would to real workers, and its routing decisions show who is credited with which G4 blocks:

- a (shared tier "shared", the fleet default) stores P1 with locality REMOTE, then its GPU copies are
  evicted: a, b and c (which mount the same tier) are credited P1 from G4; d and e (tier "other") are not;
- b stores P2 with locality LOCAL: only b is credited;
- d (tier "other") stores P3 REMOTE: e (also "other") is credited, a/b/c are not;
- P1's request carries a cache_salt, which vLLM's offload events do not repeat: the STORAGE blocks still
  resolve to kvgate's salted keys through the handles the GPU events left;
- a malformed locality and an unknown medium are counted and dropped.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import httpx
import pytest

from bench.vllm_server import vllm_python
from router.config import WorkerConfig
from tests.gateway.conftest import BLOCK, fleet, start_gateway, tokenizer_dir  # noqa: F401 (fixtures)
from tests.gateway.test_proxy import wait_until
from tests.support.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

if not (vllm_python().parent.parent / ".kvgate-ready").exists():  # `make test` builds it
    pytestmark.append(pytest.mark.skip(reason="vLLM env missing: run `make vllm-env`"))

SCRIPT = Path(__file__).with_name("vllm_fs_tier_publisher.py")
N = 4 * BLOCK + 1  # 4 routable blocks, 2 offloaded chunks of 2 blocks
P1, P2, P3 = (list(range(base, base + N)) for base in (1000, 2000, 3000))


def body(prompt, salt=None):
    b = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    if salt:
        b["cache_salt"] = salt
    return b


async def line(proc) -> str:
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 180)).strip()


async def test_vllm_fs_tier_blocks_are_credited_by_locality_and_tier(fleet, start_gateway):  # noqa: F811
    ports = {w: (free_port(), free_port()) for w in "abd"}
    bad = [{"block_hashes": [5], "parent_block_hash": None, "token_ids": P1[:BLOCK], "block_size": BLOCK,
            "lora_id": None, "medium": "STORAGE", "lora_name": None, "locality": "NEARBY"},
           {"block_hashes": [6], "parent_block_hash": None, "token_ids": P1[:BLOCK], "block_size": BLOCK,
            "lora_id": None, "medium": "TAPE", "lora_name": None}]
    spec = {"block_size": BLOCK, "workers": [
        {"port": ports["a"][0], "replay_port": ports["a"][1], "locality": "REMOTE", "evict_gpu": True,
         "requests": [{"tokens": P1, "cache_salt": "s1"}], "extra": bad},
        {"port": ports["b"][0], "replay_port": ports["b"][1], "locality": "LOCAL", "evict_gpu": True,
         "requests": [{"tokens": P2}]},
        {"port": ports["d"][0], "replay_port": ports["d"][1], "locality": "REMOTE",
         "requests": [{"tokens": P3}]},
    ]}
    proc = subprocess.Popen([str(vllm_python()), str(SCRIPT), json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert await line(proc) == "ready"
        for name in "abcde":
            fleet.add(name)
        tiers = {"d": "other", "e": "other"}
        def endpoint(name, i):
            return f"tcp://127.0.0.1:{ports[name][i]}" if name in ports else None

        workers = [WorkerConfig(url=srv.url, name=st.name, g4_tier=tiers.get(st.name),
                                events_endpoint=endpoint(st.name, 0), replay_endpoint=endpoint(st.name, 1))
                   for srv, st in zip(fleet.servers, fleet.states)]
        gw = start_gateway(fleet, events=True, workers=workers)
        ing = gw.state.ingestor
        await wait_until(lambda: set(ing.statuses()) >= set("abd")
                         and all(ing.status(w)["connected"] for w in "abd"), timeout=30)
        for phase in (1, 2):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert (await line(proc)).startswith("published")
            await wait_until(lambda: all(ing.status(w)["last_seq"] == phase - 1 for w in "abd"), timeout=30)

        def g4_of(prompt, salt=None) -> dict[str, int]:
            d = gw.call(gw.state.router.plan("tiny", body(prompt, salt), {}, "/v1/completions"))
            return {c.worker: c.g4_blocks for c in d.candidates}

        assert g4_of(P1, "s1") == {"a": 4, "b": 4, "c": 4, "d": 0, "e": 0}
        assert g4_of(P1) == dict.fromkeys("abcde", 0)  # the salted keys, not the unsalted ones
        assert g4_of(P2) == {"a": 0, "b": 4, "c": 0, "d": 0, "e": 0}
        assert g4_of(P3) == {"a": 0, "b": 0, "c": 0, "d": 0, "e": 4}  # d holds P3 on its GPU still
        st = ing.status("a")
        assert st["bad_locality"] == 1 and st["skipped"] >= 1 and st["errors"] == 0
        async with httpx.AsyncClient(timeout=10) as c:
            out = {w["name"]: w for w in (await c.get(gw.url + "/admin/workers")).json()["workers"]}
            stats = (await c.get(gw.url + "/admin/index/tiny/stats")).json()
            metrics = (await c.get(gw.url + "/metrics")).text
        assert out["d"]["g4_tier"] == "other" and out["a"]["g4_tier"] == "shared"
        assert out["a"]["events"]["bad_locality"] == 1
        assert out["b"]["cached_blocks"].get("G4_LOCAL") == 4
        tiers = stats["entries_per_tier"]
        assert tiers["G4_LOCAL"] == 4 and tiers["G4_TIER"] == 4 and tiers["GPU"] == 4  # d's P3 copies
        assert stats["g4_blocks"] == 4  # a's P1 on the model-wide tier
        assert 'kvgate_index_blocks{model="tiny",tier="G4_LOCAL"} 4.0' in metrics
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
