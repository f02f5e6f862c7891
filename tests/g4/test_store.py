"""G4 store: real files in a temp directory, real torch tensors."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from cache_tier.store import (
    BlockCorrupt,
    BlockForeign,
    BlockIOError,
    BlockMissing,
    BlockTruncated,
    G4Store,
    Namespace,
    open_namespaces,
    save_failure_reason,
    store_for_dir,
)
from indexer.hashing import sequence_hashes

B = 32


def ns(**kw) -> Namespace:
    d = {"model": "org/tiny", "dtype": "bfloat16", "block_size": B, "layer_shapes": ((4, B, 128),) * 3}
    d.update(kw)
    return Namespace(**d)


def block(seed: int, n: Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n.num_layers, *n.layer_shapes[0], generator=g).to(torch.bfloat16)


def toks(i: int) -> list[int]:
    return list(range(i * B, (i + 1) * B))


def test_round_trip_tensor_bytes_and_header(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    kv = block(1, n)
    h = sequence_hashes(toks(0), B)[0]
    assert s.put(h, toks(0), None, kv)
    layers = s.get_layers(h, toks(0))
    assert len(layers) == 3
    assert torch.equal(torch.stack(layers), kv)
    hdr = s.header(h)
    assert hdr["token_ids"] == toks(0) and hdr["parent"] is None and hdr["block_size"] == B
    assert hdr["payload_len"] == kv.numel() * 2
    # file name is the sequence hash, fanned out, under a namespace dir with namespace.json
    p = s.path(h)
    assert os.path.basename(p) == f"{h:016x}.kvb"
    assert os.path.exists(os.path.join(s.dir, "namespace.json"))
    # second put is a no-op
    assert not s.put(h, toks(0), None, kv)
    st = s.snapshot()
    assert st["blocks"] == 1 and st["hits"] == 1 and st["writes"] == 1 and st["write_skips"] == 1


def test_namespace_separates_layouts(tmp_path):
    a = G4Store(tmp_path, ns())
    b = G4Store(tmp_path, ns(tp_rank=1, tp_size=2))
    c = G4Store(tmp_path, ns(dtype="float16"))
    assert len({a.dir, b.dir, c.dir}) == 3
    a.put(5, toks(0), None, block(0, a.ns))
    assert a.contains(5) and not b.contains(5)
    found = dict(open_namespaces(tmp_path))
    assert set(found) == {a.dir, b.dir, c.dir}
    again = store_for_dir(a.dir)
    assert again.ns == a.ns and again.contains(5)


def test_checksum_corruption_detected_and_counted(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    s.put(7, toks(0), None, block(2, n))
    p = s.path(7)
    with open(p, "r+b") as f:
        f.seek(os.path.getsize(p) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(BlockCorrupt, match="checksum"):
        s.read(7)
    assert s.snapshot()["corruptions"] == 1


def test_truncated_and_wrong_block_detected(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    s.put(7, toks(0), None, block(2, n))
    s.put(8, toks(1), 7, block(3, n))
    os.truncate(s.path(7), 1000)
    with pytest.raises(BlockTruncated):
        s.read(7)
    os.truncate(s.path(7), 10)  # not even a header
    with pytest.raises(BlockTruncated):
        s.read(7)
    # a file renamed onto another hash's name is caught by the hash in the header
    os.makedirs(os.path.dirname(s.path(9)), exist_ok=True)
    os.replace(s.path(8), s.path(9))
    with pytest.raises(BlockCorrupt, match="holds block"):
        s.read(9)


def test_a_read_that_returns_short_is_continued_not_taken_for_a_truncated_block(tmp_path, monkeypatch):
    """One read(2) may return fewer bytes than asked (FUSE and network mounts, a signal): the store reads on
    to the end of the file. Taking the short read for a truncated block made the connector remove a good
    one. (The short-reading file is a stand-in: no mount here returns short reads on demand.)"""
    import io

    import cache_tier.store as store_mod

    n = ns()
    s = G4Store(tmp_path, n)
    kv = block(4, n)
    s.put(11, toks(0), None, kv)

    class ShortReads(io.FileIO):
        def readinto(self, b):
            return super().readinto(memoryview(b)[:1000])

    monkeypatch.setattr(store_mod, "open", lambda p, *a, **k: ShortReads(p, "rb"), raising=False)
    assert torch.equal(torch.stack(s.get_layers(11, toks(0))), kv)
    monkeypatch.undo()
    os.truncate(s.path(11), 5000)  # a file that really is short is still caught
    with pytest.raises(BlockTruncated):
        s.read(11)


def test_a_block_of_another_namespace_is_foreign_even_with_the_same_shape(tmp_path):
    """Sequence hashes depend on token ids only: another model's block of the same shape, copied to this
    namespace's file name, would pass every size check and the checksum; the header's namespace digest
    refuses it."""
    mine, other = G4Store(tmp_path, ns()), G4Store(tmp_path, ns(model="org/other"))
    other.put(7, toks(0), None, block(2, other.ns))
    os.makedirs(os.path.dirname(mine.path(7)), exist_ok=True)
    os.replace(other.path(7), mine.path(7))
    with pytest.raises(BlockForeign, match="namespace"):
        mine.read(7, toks(0))
    assert BlockForeign.reason == "foreign" and issubclass(BlockForeign, BlockCorrupt)
    bigger = G4Store(tmp_path, ns(model="org/big", layer_shapes=((8, B, 128),) * 3))
    bigger.put(8, toks(0), None, block(3, bigger.ns))
    os.replace(bigger.path(8), mine.path(8))
    with pytest.raises(BlockForeign):  # named for what it is, not for its other size
        mine.read(8)


def test_unreadable_path_is_an_io_error_and_reasons_name_each_failure(tmp_path):
    s = G4Store(tmp_path, ns())
    d = os.path.dirname(s.path(5))
    os.makedirs(os.path.dirname(d), exist_ok=True)
    open(d, "w").close()  # a file where the fan-out directory should be: ENOTDIR
    with pytest.raises(BlockIOError):
        s.read(5)
    with pytest.raises(OSError) as e:
        s.put(5, toks(0), None, block(0, s.ns))
    assert save_failure_reason(e.value) == "io_error"
    import errno

    assert save_failure_reason(OSError(errno.ENOSPC, "full")) == "disk_full"
    assert save_failure_reason(OSError(errno.EDQUOT, "quota")) == "disk_full"
    for code in (errno.EACCES, errno.EROFS, errno.EPERM):
        assert save_failure_reason(OSError(code, "no")) == "unwritable"
    assert save_failure_reason(ValueError()) == "error"


def test_a_removed_directory_is_recreated_with_its_namespace_by_the_next_write(tmp_path):
    import shutil

    s = G4Store(tmp_path / "g4", ns())
    s.put(1, toks(1), None, block(1, s.ns))
    shutil.rmtree(tmp_path / "g4")
    with pytest.raises(BlockMissing):
        s.read(1)
    assert s.snapshot()["blocks"] == 0  # the miss forgot it
    assert s.put(2, toks(2), None, block(2, s.ns))
    again = store_for_dir(s.dir)
    assert again.ns == s.ns and again.contains(2)


def test_a_store_that_cannot_be_created_opens_and_fails_each_read_and_write(tmp_path):
    """A vLLM server whose G4 directory cannot be made at start keeps running: reads fail (recomputed),
    writes fail (counted), nothing raises at construction."""
    (tmp_path / "file").write_text("")
    s = G4Store(tmp_path / "file" / "g4", ns())  # below a file: ENOTDIR, as root too
    assert isinstance(s.init_error, NotADirectoryError)
    with pytest.raises(BlockIOError):
        s.read(1)
    with pytest.raises(OSError) as e:
        s.put(1, toks(1), None, block(1, s.ns))
    assert save_failure_reason(e.value) == "io_error"


def test_a_full_disk_fails_the_write_with_enospc_and_leaves_no_temp_file(tmp_path):
    """A real full filesystem: a 1 MiB tmpfs (mount needs CAP_SYS_ADMIN, as root here and in CI)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.decode().strip()}")
    try:
        s = G4Store(mnt, ns())
        fits = 0
        with pytest.raises(OSError) as e:
            for h in range(1, 100):
                s.put(h, toks(h), None, block(h, s.ns))
                fits += 1
        assert save_failure_reason(e.value) == "disk_full" and fits > 0
        assert [f for _, _, fs in os.walk(s.dir) for f in fs if f.endswith(".tmp")] == []
        s.remove([1])  # room again: the same write now succeeds
        assert s.put(fits + 1, toks(fits + 1), None, block(fits + 1, s.ns))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_token_id_mismatch_detected(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    s.put(11, toks(0), None, block(4, n))
    with pytest.raises(BlockCorrupt, match="token"):
        s.read(11, toks(1))
    s.read(11, np.array(toks(0)))  # the right ids pass


def test_missing_block(tmp_path):
    s = G4Store(tmp_path, ns())
    with pytest.raises(BlockMissing):
        s.read(123)
    assert s.snapshot()["misses"] == 1


def test_bad_payload_size_rejected(tmp_path):
    s = G4Store(tmp_path, ns())
    with pytest.raises(ValueError):
        s.put(1, toks(0), None, torch.zeros(10))
    with pytest.raises(ValueError):
        s.put(1, toks(0)[:5], None, block(0, s.ns))


def test_concurrent_writers_same_and_different_blocks(tmp_path):
    """Two store handles (as two nodes) write the same blocks from several threads at once."""
    n = ns()
    stores = [G4Store(tmp_path, n), G4Store(tmp_path, n)]
    payloads = {h: block(h, n) for h in range(1, 9)}
    errors = []

    def writer(s, order):
        try:
            for h in order:
                s.put(h, toks(h), None, payloads[h], overwrite=True)
        except Exception as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(e)

    threads = [
        threading.Thread(target=writer, args=(stores[i % 2], list(range(1, 9))[:: 1 if i % 2 else -1]))
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    r = G4Store(tmp_path, n)
    assert r.snapshot()["blocks"] == 8
    for h, kv in payloads.items():
        assert torch.equal(torch.stack(r.get_layers(h, toks(h))), kv)
    leftovers = [f for _, _, fs in os.walk(r.dir) for f in fs if f.endswith(".tmp")]
    assert leftovers == []


def test_gc_evicts_least_recently_used_and_reports(tmp_path):
    n = ns()
    evicted: list[int] = []
    s = G4Store(tmp_path, n, on_evict=evicted.extend)
    for h in range(1, 6):
        s.put(h, toks(h), None, block(h, n))
    s.read(1)  # 1 becomes most recently used; 2 is now the oldest
    s.capacity_bytes = 3 * s.file_bytes
    s.low_watermark = 1.0
    s.put(6, toks(6), None, block(6, n))  # over capacity -> GC
    assert evicted == [2, 3, 4]
    assert all(not s.contains(h) for h in evicted)
    assert all(s.contains(h) for h in (1, 5, 6))
    st = s.snapshot()
    assert st["blocks"] == 3 and st["bytes"] <= s.capacity_bytes and st["evictions"] == 3


def test_lru_order_survives_restart_by_mtime(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    for h in (1, 2, 3):
        s.put(h, toks(h), None, block(h, n))
        os.utime(s.path(h), (1000 + h, 1000 + h))
    os.utime(s.path(1), (2000, 2000))  # read recently by another node
    evicted: list[int] = []
    r = G4Store(tmp_path, n, capacity_bytes=2 * s.file_bytes, low_watermark=1.0, on_evict=evicted.extend)
    assert r.gc() == [2] and evicted == [2]


def test_inventory_scan_after_restart(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    hs = sequence_hashes(list(range(4 * B)), B)
    for i, h in enumerate(hs):
        s.put(h, toks(i), hs[i - 1] if i else None, block(i, n))
    # a stale temp file from a crashed writer and a stray file are ignored
    open(s.path(hs[0]) + ".99.1.tmp", "wb").close()
    open(os.path.join(s.dir, "README"), "w").close()
    r = G4Store(tmp_path, n)
    assert sorted(r.hashes()) == sorted(hs)
    assert r.snapshot()["blocks"] == 4


def test_stats_throughput(tmp_path):
    n = ns()
    s = G4Store(tmp_path, n)
    for h in range(1, 4):
        s.put(h, toks(h), None, block(h, n))
        s.read(h)
    st = s.snapshot()
    assert st["write_bytes"] == 3 * s.file_bytes and st["read_bytes"] == 3 * s.file_bytes
    assert st["read_bytes_per_s"] > 0 and st["write_bytes_per_s"] > 0


def test_read_throttle_paces_all_threads_together(tmp_path):
    """``read_bytes_per_s`` (emulating a slow shared filesystem) caps the handle's reads, all threads
    together: the bytes read can never exceed rate x elapsed, whatever the threads overlap."""
    n = ns()
    s = G4Store(tmp_path, n, read_bytes_per_s=2_000_000)  # 24 KiB blocks: about 80 a second
    for h in range(1, 17):
        s.put(h, toks(h), None, block(h, n))
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda i=i: [s.read(h) for h in range(i, 17, 4)]) for i in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert s.snapshot()["read_bytes"] == 16 * s.file_bytes
    assert elapsed >= (16 - 1) * s.file_bytes / 2_000_000  # a lower bound that sleep() guarantees


def test_presence_cache_saves_stats_and_expires(tmp_path):
    from cache_tier.store import PresenceCache

    n = ns()
    s = G4Store(tmp_path, n)
    s.put(1, toks(1), None, block(1, n))
    pc = PresenceCache(s, ttl_s=60.0, max_entries=2)
    assert pc.contains(1) and pc.contains(1)
    assert pc.stats_calls == 1  # the second answer came from the cache
    assert not pc.contains(2) and pc.stats_calls == 2  # misses are never cached
    pc.add(3)
    pc.add(4)  # bounded: 1 falls out
    assert pc.contains(1) and pc.stats_calls == 3
    pc.discard(1)
    s.remove([1])
    assert not pc.contains(1)
    expired = PresenceCache(s, ttl_s=0.0)
    expired.add(5)
    assert not expired.contains(5)  # expired entries are checked again
