"""``/admin/index`` and ``/admin/blocks`` on a live gateway over a real Redis index."""
from __future__ import annotations

from tests.admin.conftest import BLOCK, MODEL
from tests.admin.test_workers import prompt


def model_stats(env) -> dict:
    r = env.http.get("/admin/index")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["backend"] == "redis"
    return {m["model"]: m for m in doc["models"]}


def test_index_stats_per_model(admin_env):
    env = admin_env(2)
    env.publish("w1", prompt(1, 3))
    env.publish("w1", prompt(2, 2), medium="CPU")
    env.publish("w2", prompt(1, 3))  # the same 3 blocks on w2
    env.publish("w2", prompt(5, 4), medium="STORAGE")  # G4: model-wide
    st = model_stats(env)[MODEL]
    assert st["entries_per_tier"] == {"GPU": 6, "CPU": 2}
    assert st["g4_blocks"] == 4
    assert st["workers"] == {"w1": {"GPU": 3, "CPU": 2}, "w2": {"GPU": 3}}
    assert st["blocks"] == 3 + 2 + 4  # distinct blocks
    assert st["redis_used_memory"] > 0
    # applied counts batches on the two workers; nothing dropped or replayed here.
    statuses = env.state.ingestor.statuses()
    assert st["events_applied"] == statuses["w1"]["applied"] + statuses["w2"]["applied"] > 0
    assert st["events_dropped"] == 0
    one = env.http.get(f"/admin/index/{MODEL}/stats").json()
    assert one.pop("redis_used_memory") > 0 and st.pop("redis_used_memory")
    assert one == st
    assert env.http.get("/admin/index/no-such-model/stats").status_code == 404


def test_flush_one_worker_then_the_model(admin_env):
    env = admin_env(2)
    env.publish("w1", prompt(1, 3))
    env.publish("w1", prompt(2, 2), medium="CPU")
    env.publish("w2", prompt(1, 3))
    env.publish("w2", prompt(5, 4), medium="STORAGE")

    r = env.http.delete(f"/admin/index/{MODEL}/workers/w1", params={"tier": "CPU"})
    assert r.status_code == 200 and r.json() == {"model": MODEL, "worker": "w1", "removed": 2}
    assert model_stats(env)[MODEL]["workers"]["w1"] == {"GPU": 3}

    r = env.http.delete(f"/admin/index/{MODEL}/workers/w1")
    assert r.status_code == 200 and r.json()["removed"] == 3
    st = model_stats(env)[MODEL]
    assert "w1" not in st["workers"] and st["workers"]["w2"] == {"GPU": 3}
    assert st["g4_blocks"] == 4

    r = env.http.delete(f"/admin/index/{MODEL}")
    assert r.status_code == 200 and r.json()["removed"] == 3 + 4
    listed = model_stats(env).get(MODEL)  # still listed (workers serve it), but empty
    assert listed is not None and listed["blocks"] == 0 and listed["g4_blocks"] == 0

    bad = env.http.delete(f"/admin/index/{MODEL}/workers/w1", params={"tier": "SSD"})
    assert bad.status_code == 422 and bad.json()["error"]["param"].endswith("tier")


def test_block_lookup(admin_env):
    env = admin_env(2)
    hashes = env.publish("w1", prompt(1, 3))
    env.publish("w2", prompt(1, 2), medium="CPU")
    g4 = env.publish("w2", prompt(7, 2), medium="STORAGE")

    first = hashes[0]
    for spelled in (str(first), f"0x{first:x}", f"0x{first:016x}", f"0X{first:X}"):
        r = env.http.get(f"/admin/blocks/{MODEL}/{spelled}")
        assert r.status_code == 200, r.text
        b = r.json()
        assert b["hash"] == first and b["hash_hex"] == f"{first:016x}"
        assert b["workers"] == {"w1": ["GPU"], "w2": ["CPU"]}
        assert b["g4"] is False and b["g4_file"] is None

    third = env.http.get(f"/admin/blocks/{MODEL}/{hashes[2]}").json()
    assert third["workers"] == {"w1": ["GPU"]}
    on_g4 = env.http.get(f"/admin/blocks/{MODEL}/{g4[1]}").json()
    assert on_g4["workers"] == {} and on_g4["g4"] is True
    unknown = env.http.get(f"/admin/blocks/{MODEL}/12345").json()
    assert unknown["workers"] == {} and unknown["g4"] is False

    for bad in ("zzz", "-1", str(1 << 64), "0xfffffffffffffffff", "0x", "ab12cd34ef567890"):
        r = env.http.get(f"/admin/blocks/{MODEL}/{bad}")
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "hash"


def test_model_names_with_slashes(admin_env):
    env = admin_env(1)
    b = env.http.get("/admin/blocks/org/model-x/123").json()
    assert b["model"] == "org/model-x" and b["hash"] == 123 and b["workers"] == {}
    r = env.http.delete("/admin/index/org/model-x/workers/w1").json()
    assert r == {"model": "org/model-x", "worker": "w1", "removed": 0}
    assert env.http.delete("/admin/index/org/model-x").json() == {"model": "org/model-x", "worker": None,
                                                                  "removed": 0}


def test_index_down_is_503_not_500(admin_env):
    """The gateway's index points at a port where nothing listens (Redis down)."""
    from tests.support.procs import free_port

    env = admin_env(1, index_url=f"redis://127.0.0.1:{free_port()}/0")
    for method, path in (("GET", "/admin/index"), ("GET", f"/admin/index/{MODEL}/stats"),
                         ("DELETE", f"/admin/index/{MODEL}"), ("DELETE", f"/admin/index/{MODEL}/workers/w1"),
                         ("GET", f"/admin/blocks/{MODEL}/1")):
        r = env.http.request(method, path)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["error"]["code"] == "index_unavailable"
    # The worker list still answers, saying why the cache figures are missing.
    r = env.http.get("/admin/workers")
    assert r.status_code == 200 and r.json()["workers"][0]["healthy"] is True
    assert "unavailable" in r.json()["index_error"]
    # Explain degrades like routing does: load-only, with the index error recorded.
    ex = env.http.post("/admin/explain", json={"body": {"model": MODEL, "prompt": prompt(3, 2)}}).json()
    assert ex["chosen"] == "w1" and ex["index_error"]


def test_flushing_a_worker_another_gateway_writes_is_a_409(admin_env):
    """Another gateway holds the worker's lease and writes its entries (its state would push them back):
    a flush here is refused with a 409 that says so, not a 503 "index unavailable", and nothing is lost."""
    import asyncio

    from indexer.hashing import sequence_hashes
    from indexer.index.base import Tier
    from indexer.index.redis import RedisIndex

    env = admin_env(1)
    hashes = sequence_hashes(prompt(7, 3), BLOCK)

    async def other_gateway(op):
        idx = RedisIndex(env.index_url)
        try:
            return await op(idx)
        finally:
            await idx.close()

    async def take_and_store(idx):
        assert await idx.acquire_lease(MODEL, "elsewhere", "other-gw", ttl_s=60)
        await idx.store(MODEL, "elsewhere", Tier.GPU, hashes)

    asyncio.run(other_gateway(take_and_store))
    r = env.http.delete(f"/admin/index/{MODEL}/workers/elsewhere")
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_lease_held", r.text
    assert model_stats(env)[MODEL]["workers"]["elsewhere"] == {"GPU": 3}
