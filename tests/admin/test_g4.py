"""``/admin/g4`` and the G4 part of ``/admin/blocks``, over a real G4 directory written by the store."""
from __future__ import annotations

import os

import pytest

from tests.admin.conftest import BLOCK, MODEL
from tests.admin.test_workers import prompt


def test_g4_not_configured(admin_env):
    env = admin_env(1)
    r = env.http.get("/admin/g4")
    assert r.status_code == 200 and r.json()["configured"] is False
    for path in (f"/admin/g4/{MODEL}/rebuild", f"/admin/g4/{MODEL}/gc"):
        r = env.http.post(path)
        assert r.status_code == 409 and r.json()["error"]["code"] == "g4_not_configured"


def test_g4_store_stats_block_metadata_rebuild_and_gc(admin_env, tmp_path):
    from cache_tier import store as store_mod
    from indexer.hashing import sequence_hashes

    root = tmp_path / "g4"
    ns = store_mod.Namespace(model=MODEL, dtype="float16", block_size=BLOCK,
                             layer_shapes=((2, 2, BLOCK, 8),) * 2)
    st = store_mod.G4Store(root, ns)
    toks = prompt(61, 3)
    hashes = sequence_hashes(toks[: 3 * BLOCK], BLOCK)
    for i, h in enumerate(hashes):
        st.put(h, toks[i * BLOCK:(i + 1) * BLOCK], hashes[i - 1] if i else None, bytes(ns.payload_bytes))

    env = admin_env(1, g4={"path": str(root), "capacity_bytes": 10 * st.file_bytes})
    doc = env.http.get("/admin/g4").json()
    assert doc["configured"] is True and doc["available"] is True
    assert doc["blocks"] == 3 and doc["bytes"] == 3 * st.file_bytes
    (space,) = doc["namespaces"]
    assert space["model"] == MODEL and space["block_size"] == BLOCK and space["num_layers"] == 2
    assert space["blocks"] == 3 and space["directory"] == st.dir
    assert doc["gc"]["capacity_bytes"] == 10 * st.file_bytes and doc["gc"]["over_capacity"] == []
    assert doc["gc"]["fill"] == pytest.approx(0.3)

    # The index lost its G4 entries (e.g. a Redis restart): rebuild them from the directory.
    assert env.http.get(f"/admin/blocks/{MODEL}/{hashes[1]}").json()["g4"] is False
    r = env.http.post(f"/admin/g4/{MODEL}/rebuild")
    assert r.status_code == 200 and r.json()["blocks"] == 3
    b = env.http.get(f"/admin/blocks/{MODEL}/{hashes[1]}").json()
    assert b["g4"] is True
    f = b["g4_file"]
    assert f["path"] == st.path(hashes[1]) and os.path.exists(f["path"])
    assert f["size_bytes"] == st.file_bytes
    assert f["parent"] == hashes[0] and f["block_size"] == BLOCK and f["hash"] == hashes[1]
    assert "token_ids" not in f
    assert env.http.get(f"/admin/blocks/{MODEL}/12345").json()["g4_file"] is None

    # GC down to one block's worth: the two least recently used go, from disk and from the index.
    os.utime(st.path(hashes[0]), (1, 1))
    os.utime(st.path(hashes[1]), (2, 2))
    r = env.http.post(f"/admin/g4/{MODEL}/gc", params={"capacity_bytes": int(1.2 * st.file_bytes)})
    assert r.status_code == 200 and r.json()["evicted"] >= 2
    assert env.http.get("/admin/g4").json()["blocks"] <= 1
    assert env.http.get(f"/admin/blocks/{MODEL}/{hashes[0]}").json()["g4"] is False
    bad = env.http.post(f"/admin/g4/{MODEL}/gc", params={"capacity_bytes": -1})
    assert bad.status_code == 422


def test_g4_maintenance_with_the_index_down_is_503(admin_env, tmp_path):
    """Redis down: a rebuild (it writes the blocks it finds) and a GC (it drops what it evicted) answer 503
    in the error shape (they answered 500)."""
    from cache_tier import store as store_mod
    from indexer.hashing import sequence_hashes
    from tests.support.procs import free_port

    ns = store_mod.Namespace(model=MODEL, dtype="float16", block_size=BLOCK, layer_shapes=((2, 2, BLOCK, 8),))
    st = store_mod.G4Store(tmp_path / "g4", ns)
    toks = prompt(62, 2)
    hashes = sequence_hashes(toks[: 2 * BLOCK], BLOCK)
    for i, h in enumerate(hashes):
        st.put(h, toks[i * BLOCK:(i + 1) * BLOCK], hashes[i - 1] if i else None, bytes(ns.payload_bytes))
    env = admin_env(1, index_url=f"redis://127.0.0.1:{free_port()}/0", g4={"path": str(tmp_path / "g4")})
    r = env.http.post(f"/admin/g4/{MODEL}/rebuild")
    assert r.status_code == 503 and r.json()["error"]["code"] == "g4_maintenance_failed", r.text
    r = env.http.post(f"/admin/g4/{MODEL}/gc", params={"capacity_bytes": 0})
    assert r.status_code == 503 and r.json()["error"]["code"] == "g4_maintenance_failed", r.text
    assert env.http.get("/admin/g4").json()["configured"] is True


def test_g4_maintenance_checks_the_store_off_the_event_loop(admin_env, tmp_path, monkeypatch):
    """The store's root is a shared mount: a stat of a hung one blocks, and on the event loop it stalled
    every request the gateway serves. The maintenance routes check it in a thread."""
    import asyncio

    real, on_loop = os.path.isdir, []

    def isdir(p):
        try:
            asyncio.get_running_loop()
            on_loop.append(p)
        except RuntimeError:  # a worker thread: fine
            pass
        return real(p)

    env = admin_env(1, g4={"path": str(tmp_path / "missing"), "capacity_bytes": 1})
    monkeypatch.setattr(os.path, "isdir", isdir)
    for path in (f"/admin/g4/{MODEL}/rebuild", f"/admin/g4/{MODEL}/gc"):
        r = env.http.post(path)
        assert r.status_code == 409 and r.json()["error"]["code"] == "g4_unavailable"
    assert not [p for p in on_loop if "missing" in str(p)]
