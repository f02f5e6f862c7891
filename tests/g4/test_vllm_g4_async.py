"""G4 loads on a real vLLM CPU server, as a user sees them, in both load modes, and bad G4 state.

One server per mode (``load_async`` true, then false; and one in ``auto``) on its own G4 directory, with
the store's read throttle (``read_bytes_per_s``) standing in for a slow shared filesystem so that a load
lasts long enough to overlap other requests. A prompt's blocks reach G4 by serving it once;
``POST /reset_prefix_cache`` then empties vLLM's own cache so the next request that extends it loads them
from G4. The reference for
every output is the same prompt under a ``cache_salt`` (no block in common with anything stored).
No timing thresholds: the assertions are on outputs, ``cached_tokens`` and the connector's counters
(``/metrics``, parsed from Prometheus' text format).

Bad G4 state (a missing, truncated, corrupt or foreign block; the store removed under the server; a full
disk; an unwritable directory) must cost a recompute, never a wrong token. The G4 directory lives on a
tmpfs of its own (a real ``ENOSPC`` when filled, a real ``EROFS`` when remounted read-only; mounting
needs CAP_SYS_ADMIN, which root has here and in CI), and the server runs without CAP_DAC_OVERRIDE
(``obey_file_permissions``), so ``chmod`` makes the directory unwritable to it (a real ``EACCES``) although
it runs as root. Where a mechanism is unavailable its test is skipped, saying why.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import subprocess
import threading

import httpx
import pytest
import torch

from bench import tiny_model
from bench.vllm_server import VllmServer, vllm_python
from cache_tier.store import G4Store
from indexer.hashing import routable_blocks, sequence_hashes
from tests.g4.real_vllm import (
    assert_same_output,
    BLOCK,
    cached,
    complete,
    corrupt,
    failures,
    g4_metrics,
    g4_server,
    prompt,
    store_of,
    wait_for,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not (vllm_python().parent.parent / ".kvgate-ready").exists():  # `make test` builds it
    pytestmark.append(pytest.mark.skip(reason="vLLM env missing: run `make vllm-env`"))

READ_BYTES_PER_S = 1_000_000  # tiny model: 128 KiB blocks, so about 8 blocks a second
QUESTION = prompt(2, 24)


@pytest.fixture(scope="module")
def model():
    return tiny_model.ensure("tiny")


TMPFS_BYTES = 256 * 2**20


def mount_tmpfs(path: str, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes on ``path``; None, or why it could not."""
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True
        )
    except OSError as e:
        return f"no mount command: {e}"
    return (r.stderr.strip() or f"mount exited {r.returncode}") if r.returncode else None


@pytest.fixture(scope="module", params=["async", "sync"])
def srv(request, model, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"g4fs-{request.param}")
    no_tmpfs = mount_tmpfs(str(base), TMPFS_BYTES)
    g4 = str(base / "g4")  # below the mount point: the whole G4 root can be removed
    s = g4_server(
        model, g4, f"g4-{request.param}", obey_file_permissions=True,
        g4_config={"load_async": request.param == "async", "read_bytes_per_s": READ_BYTES_PER_S},
    )
    try:
        with s:
            yield {"server": s, "g4": g4, "base": str(base), "mode": request.param, "no_tmpfs": no_tmpfs}
    finally:
        if not no_tmpfs:
            subprocess.run(["umount", "-l", str(base)], check=False)


def put_on_g4_only(s: VllmServer, g4: str, p: list[int]) -> list[int]:
    """Serve ``p`` once, wait for its full blocks in the store, empty vLLM's cache; the block hashes."""
    complete(s, p, max_tokens=1)
    hs = sequence_hashes(p, BLOCK)[: routable_blocks(len(p), BLOCK)]
    st = store_of(g4)
    assert wait_for(lambda: all(st.contains(h) for h in hs)), "the prompt's blocks did not reach G4"
    httpx.post(s.url + "/reset_prefix_cache", timeout=60).raise_for_status()
    return hs


def test_output_equals_the_reference_and_cached_tokens_show_the_g4_hit(srv):
    s = srv["server"]
    p = prompt(11, 20 * BLOCK + 7)
    put_on_g4_only(s, srv["g4"], p)
    ref = complete(s, p + QUESTION, max_tokens=12, cache_salt="no-g4-reference")
    assert cached(ref) == 0
    before = s.g4_stats()
    got = complete(s, p + QUESTION, max_tokens=12)
    after = s.g4_stats()
    assert cached(got) == 20 * BLOCK, got["usage"]
    assert_same_output(got, ref)
    assert after["loads"] - before["loads"] == 20
    assert after["load_failures"] == before["load_failures"]
    assert after["async_loads"] - before["async_loads"] == (1 if srv["mode"] == "async" else 0)


@pytest.mark.parametrize("srv", ["async"], indirect=True)  # a synchronous load stalls the step: bench/g4_async.py
def test_a_short_request_is_served_while_a_long_load_is_in_flight(srv):
    s = srv["server"]
    long_p = prompt(12, 64 * BLOCK + 3)  # 64 blocks: about 8 s through the read throttle
    put_on_g4_only(s, srv["g4"], long_p)
    ref = complete(s, long_p + QUESTION, max_tokens=6, cache_salt="no-g4-reference-long")
    result: dict = {}

    def long_request():
        result["resp"] = complete(s, long_p + QUESTION, max_tokens=6)

    t = threading.Thread(target=long_request)
    t.start()
    try:
        assert wait_for(lambda: s.g4_stats()["loads_in_flight"] >= 1, timeout=60, every=0.05), (
            "the long request's G4 load never started"
        )
        short = complete(s, prompt(13, 40), max_tokens=4)
        assert len(short["choices"][0]["token_ids"]) == 4
        # served to the end while the long request was still waiting for its blocks
        assert s.g4_stats()["loads_in_flight"] >= 1, "the short request waited for the long load"
    finally:
        t.join(300)
    got = result["resp"]
    assert cached(got) == 64 * BLOCK, got["usage"]
    assert_same_output(got, ref)


@pytest.fixture(scope="module")
def auto_srv(model, tmp_path_factory):
    """``load_async: auto`` behind the same read throttle (about 0.13 s a block), with loads of up to 0.5 s
    in the step: 2 blocks are, 20 are not."""
    g4 = str(tmp_path_factory.mktemp("g4-auto") / "g4")
    s = g4_server(model, g4, "g4-auto", g4_config={
        "load_async": "auto", "sync_load_max_s": 0.5, "read_bytes_per_s": READ_BYTES_PER_S})
    with s:
        yield s, g4


def test_auto_mode_loads_short_reads_in_the_step_and_long_ones_in_the_background(auto_srv):
    """Each load's mode shows in the connector's ``async_loads`` counter: the first load runs in the
    background (no load rate measured yet), then a 2-block load in the step and a 20-block one in the
    background, each with its G4 hit in ``cached_tokens`` and the reference's output."""
    s, g4 = auto_srv
    for seed, blocks, background in ((21, 6, True), (22, 2, False), (23, 20, True)):
        p = prompt(seed, blocks * BLOCK + 7)
        put_on_g4_only(s, g4, p)
        ref = complete(s, p + QUESTION, max_tokens=8, cache_salt=f"no-g4-reference-{seed}")
        before = s.g4_stats()
        got = complete(s, p + QUESTION, max_tokens=8)
        after = s.g4_stats()
        assert cached(got) == blocks * BLOCK, (blocks, got["usage"])
        assert_same_output(got, ref)
        assert after["loads"] - before["loads"] == blocks
        assert after["async_loads"] - before["async_loads"] == (1 if background else 0), (blocks, after)


def make_foreign(s: VllmServer, g4: str, h: int, token_ids: list[int], parent) -> None:
    """Put at ``h``'s name a block of the same shape written under another model's namespace (what a
    directory copied from another model's G4 would hold): random KV, right token ids, hash and sizes."""
    st = store_of(g4)
    other = G4Store(os.path.join(os.path.dirname(g4), "other-g4"), dataclasses.replace(st.ns, model="other"))
    payload = torch.randn(st.ns.payload_bytes // 2).to(torch.bfloat16)
    other.put(h, token_ids, parent, payload, overwrite=True)
    shutil.move(other.path(h), st.path(h))


def damage(kind: str, s: VllmServer, g4: str, q: list[int], hs: list[int], i: int) -> None:
    path = store_of(g4).path(hs[i])
    if kind == "corrupt":
        corrupt(path)
    elif kind == "missing":  # the scheduler saw it written: it plans the load, the read finds nothing
        os.unlink(path)
    elif kind == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif kind == "foreign":
        make_foreign(s, g4, hs[i], q[i * BLOCK : (i + 1) * BLOCK], hs[i - 1] if i else None)


LOAD_REASONS = ("missing", "truncated", "corrupt", "foreign", "io_error", "error")
EXTRA = prompt(2, 3 * BLOCK + 24)  # 3 new full blocks after the G4 prefix: computed in the failing step


@pytest.mark.parametrize(
    "kind, bad_block", [("corrupt", 5), ("corrupt", 0), ("missing", 5), ("truncated", 5), ("foreign", 3)]
)
def test_a_bad_block_is_recomputed_with_the_reference_output_and_rewritten(srv, kind, bad_block):
    """The bad block costs a recompute from it on, is counted under its reason, is never offered
    again, and is rewritten by the recompute; the prompt then loads whole from G4 with the same output
    (in sync mode this also proves that the blocks computed in the failing step, which attended to the
    unloaded block, were not saved)."""
    s, g4 = srv["server"], srv["g4"]
    p = prompt(20 + bad_block + 100 * LOAD_REASONS.index(kind), 12 * BLOCK + 3)
    hs = put_on_g4_only(s, g4, p)
    q = p + EXTRA
    damage(kind, s, g4, q, hs, bad_block)
    ref = complete(s, q, max_tokens=12, cache_salt=f"no-g4-reference-{kind}{bad_block}")
    before = g4_metrics(s)
    got = complete(s, q, max_tokens=12)
    after = g4_metrics(s)
    assert_same_output(got, ref)
    assert failures(before, after) == {r: (1 if r == kind else 0) for r in LOAD_REASONS}
    # every other block was read once; the request was not offered the bad block again (vLLM's
    # cached_tokens still counts the whole planned hit: it is recorded when the request is admitted)
    assert after["kvgate_g4_loads_total"] - before["kvgate_g4_loads_total"] == len(hs) - 1
    # the recompute rewrote it, and the blocks after the prefix were saved from the recomputed KV
    st = store_of(g4)
    hq = sequence_hashes(q, BLOCK)[: routable_blocks(len(q), BLOCK)]
    assert wait_for(lambda: all(st.contains(h) for h in hq)), "the recomputed blocks were not saved again"
    st.read(hq[bad_block], q[bad_block * BLOCK : (bad_block + 1) * BLOCK])  # a valid block of this namespace
    httpx.post(s.url + "/reset_prefix_cache", timeout=60).raise_for_status()
    again = complete(s, q, max_tokens=12)
    last = g4_metrics(s)
    assert_same_output(again, ref)
    assert cached(again) == len(hq) * BLOCK
    assert last["kvgate_g4_loads_total"] - after["kvgate_g4_loads_total"] == len(hq)
    assert not any(failures(after, last).values())


@pytest.mark.parametrize("what", ["namespace", "root"])
def test_a_store_removed_under_the_server_costs_a_recompute_and_is_recreated(srv, what):
    """``rm -rf`` of the namespace directory or of the whole G4 root while vLLM runs: the loads the
    scheduler planned miss (counted), the output is the reference, the server lives on, and the next
    saves recreate the directory with its namespace.json."""
    s, g4 = srv["server"], srv["g4"]
    p = prompt(40 + (what == "root"), 10 * BLOCK + 3)
    hs = put_on_g4_only(s, g4, p)
    ns_json = os.path.join(store_of(g4).dir, "namespace.json")
    shutil.rmtree(os.path.dirname(ns_json) if what == "namespace" else g4)
    q = p + QUESTION
    ref = complete(s, q, max_tokens=12, cache_salt=f"no-g4-reference-rm-{what}")
    before = g4_metrics(s)
    got = complete(s, q, max_tokens=12)
    after = g4_metrics(s)
    assert_same_output(got, ref)
    assert failures(before, after) == {r: (len(hs) if r == "missing" else 0) for r in LOAD_REASONS}
    assert after["kvgate_g4_loads_total"] == before["kvgate_g4_loads_total"]
    assert wait_for(lambda: os.path.exists(ns_json)), "the G4 directory was not recreated (namespace.json)"
    st = store_of(g4)
    assert wait_for(lambda: all(st.contains(h) for h in hs)), "saves did not resume after the removal"


def fill_up(path: str) -> None:
    """Write a file of zeros until the filesystem says ENOSPC."""
    chunk = b"\0" * 2**20
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return


def save_counts(before: dict, after: dict) -> tuple[float, float]:
    d = {k: after[k] - before[k] for k in ("kvgate_g4_saves_written_total", "kvgate_g4_saves_dropped_total")}
    return d["kvgate_g4_saves_written_total"], d["kvgate_g4_saves_dropped_total"]


SAVE_REASONS = ("disk_full", "unwritable", "io_error", "error")


def saves_fail_then_resume(s: VllmServer, g4: str, seed: int, reason: str, restore) -> None:
    """A new prompt served while the store cannot be written: the reference output, every save of its
    blocks failed under ``reason``; after ``restore()`` the same prompt's blocks are written."""
    p = prompt(seed, 8 * BLOCK + 5)  # with 4 generated tokens: 8 full blocks to save
    hs = sequence_hashes(p, BLOCK)[:8]
    before = g4_metrics(s)
    try:
        got = complete(s, p, max_tokens=4)
        assert wait_for(lambda: failures(before, g4_metrics(s), "save")[reason] >= len(hs))
        after = g4_metrics(s)
    finally:
        restore()
    ref = complete(s, p, max_tokens=4, cache_salt=f"no-g4-reference-{seed}")
    assert_same_output(got, ref)
    assert failures(before, after, "save") == {r: (len(hs) if r == reason else 0) for r in SAVE_REASONS}
    assert save_counts(before, after) == (0, len(hs))
    assert s.healthy()
    st = store_of(g4)
    assert not any(st.contains(h) for h in hs)
    complete(s, p, max_tokens=4)  # computes (or reuses) the same blocks: saved this time
    assert wait_for(lambda: all(st.contains(h) for h in hs)), "saves did not resume"
    for i, h in enumerate(hs):
        st.read(h, p[i * BLOCK : (i + 1) * BLOCK])


@pytest.mark.parametrize("srv", ["async"], indirect=True)  # saves do not depend on the load mode
def test_a_full_disk_fails_saves_counted_never_stalls_and_they_resume(srv):
    if srv["no_tmpfs"]:
        pytest.skip(f"no tmpfs for a real full disk (mount needs CAP_SYS_ADMIN): {srv['no_tmpfs']}")
    s, g4 = srv["server"], srv["g4"]
    put_on_g4_only(s, g4, prompt(50, 2 * BLOCK + 1))  # the store exists before the disk fills
    filler = os.path.join(srv["base"], "filler")
    fill_up(filler)
    saves_fail_then_resume(s, g4, 51, "disk_full", lambda: os.unlink(filler))


@pytest.mark.parametrize("srv", ["async"], indirect=True)
def test_an_unwritable_directory_fails_saves_counted_and_they_resume(srv):
    s, g4 = srv["server"], srv["g4"]
    if not s.obeys_file_permissions:
        pytest.skip("the server runs as root with CAP_DAC_OVERRIDE (no setpriv): chmod cannot stop it")
    put_on_g4_only(s, g4, prompt(60, 2 * BLOCK + 1))
    dirs = [g4] + [os.path.join(r, d) for r, ds, _ in os.walk(g4) for d in ds]

    def chmod(mode: int) -> None:
        for d in dirs:
            os.chmod(d, mode)

    chmod(0o555)  # EACCES
    saves_fail_then_resume(s, g4, 61, "unwritable", lambda: chmod(0o755))


@pytest.mark.parametrize("srv", ["async"], indirect=True)
def test_a_read_only_filesystem_fails_saves_counted_and_they_resume(srv):
    if srv["no_tmpfs"]:
        pytest.skip(f"no tmpfs to remount read-only (mount needs CAP_SYS_ADMIN): {srv['no_tmpfs']}")
    s, g4 = srv["server"], srv["g4"]
    put_on_g4_only(s, g4, prompt(63, 2 * BLOCK + 1))

    def remount(mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", srv["base"]], check=True)

    remount("ro")  # EROFS
    saves_fail_then_resume(s, g4, 62, "unwritable", lambda: remount("rw"))
