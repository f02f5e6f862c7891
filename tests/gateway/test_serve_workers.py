"""``kvgate serve --workers 2``: two gateway processes on one port, each with its own in-memory index fed
by the same KV event streams of a simulated fleet (real processes, real HTTP and ZMQ)."""
from __future__ import annotations

import json
import sys
import time

import httpx
import pytest

from bench.sim import procs
from bench.sim.tokenizer import ids_to_text, save_model_dir

pytestmark = pytest.mark.slow


def test_two_processes_each_index_the_fleets_events(tmp_path):
    fleet, desc = procs.start_fleet(tmp_path, 2, num_blocks=2000, block_size=16, time_scale=100)
    gw = None
    try:
        port = procs.free_port()
        settings = procs.gateway_settings(desc, "kv", port, str(save_model_dir(tmp_path / "tok")))
        settings["admin"] = {"open_without_token": True}
        cfg = tmp_path / "kvgate.yaml"
        cfg.write_text(json.dumps(settings))  # JSON is YAML
        gw = procs.Proc("gateway", [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg),
                                    "--workers", "2"], tmp_path)
        base = f"http://127.0.0.1:{port}"
        procs.wait_http(base + "/ready", gw, 90)
        deadline = time.monotonic() + 30
        while len(procs.children(gw.p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(procs.children(gw.p.pid)) >= 2, gw.tail()

        prompt = ids_to_text(list(range(1, 400)))
        body = {"model": desc["model"], "prompt": prompt, "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 200
        # Every process learns the prompt's blocks from the workers' KV events (not from its own forward),
        # so a request on any fresh connection predicts them cached.
        seen: set[frozenset] = set()
        deadline = time.monotonic() + 30
        cached = []
        while time.monotonic() < deadline:
            cached = []
            for _ in range(12):
                r = httpx.post(base + "/v1/completions", json=body, timeout=30)  # a new connection each
                assert r.status_code == 200
                cached.append(int(r.headers["x-kvgate-cached-tokens"]))
                ids = httpx.get(base + "/admin/decisions", timeout=10).json()["decisions"]
                seen.add(frozenset(x["request_id"] for x in ids))
            if min(cached) > 0:
                break
            time.sleep(0.5)
        assert min(cached) >= 384, cached
        # Two processes answered: one process's log only grows (each later view holds the earlier one),
        # two processes' logs are disjoint.
        views = list(seen)
        assert any(not a <= b and not b <= a for a in views for b in views), "one process answered everything"
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()


def test_a_serving_process_freezes_its_startup_objects():
    """``kvgate serve`` apps call ``settle_gc`` once started (router/app.py): start-up's objects leave the
    cycle collector and young collections are rarer; run in a fresh interpreter (freezing is per process)."""
    import subprocess

    code = ("import gc, router.app as a; import transformers; before = gc.get_freeze_count(); a.settle_gc(); "
            "print(before, gc.get_freeze_count(), gc.get_threshold()[0] == a.GC_GEN0_THRESHOLD)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    before, after, threshold = out.stdout.split()
    assert int(before) == 0 and int(after) > 10_000 and threshold == "True", out.stdout
