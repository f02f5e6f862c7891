"""G4 store throughput vs the raw throughput of the same directory, measured in the same run.

``python -m bench.bench_g4_store [--dir PATH] [--mib 256] [--rounds 3]``

For each realistic block size it writes N blocks through :class:`cache_tier.store.G4Store` (header,
XXH3 checksum, temp file + rename) and N plain files of the same size with bare ``open/write/close``
(the baseline), then reads both back: the store with its verified single ``readinto`` into a reused
buffer, the baseline with a bare ``readinto``. Rounds alternate which side goes first; the best round of
each is reported (the machine is shared and noisy). Goal: store >= 80% of raw.

Default (disk) mode: each side's write time includes ``sync()`` of what it wrote, and files are evicted
from the page cache before reading, so the figures are the disk's. ``--cached`` measures the page cache instead (memory bandwidth), where the
store's per-block fixed costs (checksum, rename, syscalls) show most.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from cache_tier.store import G4Store, Namespace

# (label, layers, per-layer block shape, dtype, block size)
SIZES = [
    ("152M llama, B=32 (this repo's bench model)", 12, (4, 32, 128), "bfloat16", 32),
    ("8B-class (32 layers, 8 KV heads, d128), B=16", 32, (2, 16, 8, 128), "bfloat16", 16),
    ("70B-class (80 layers, 8 KV heads, d128), B=16", 80, (2, 16, 8, 128), "bfloat16", 16),
]


def _raw_write(d: str, n: int, data: memoryview, sync: bool) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(os.path.join(d, f"{i:08d}.raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
    if sync:
        os.sync()
    return time.perf_counter() - t0


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def _drop_cache(paths) -> None:
    """Evict files from the page cache (fdatasync + POSIX_FADV_DONTNEED), so reads come from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_read(d: str, n: int, size: int) -> float:
    buf = bytearray(size)
    view = memoryview(buf)
    t0 = time.perf_counter()
    for i in range(n):
        with open(os.path.join(d, f"{i:08d}.raw"), "rb", buffering=0) as f:
            f.readinto(view)
    return time.perf_counter() - t0


def _store_write(s: G4Store, n: int, payload: torch.Tensor, toks: list[int], sync: bool) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        s.put(i + 1, toks, i or None, payload, overwrite=True)
    if sync:
        os.sync()
    return time.perf_counter() - t0


def _store_read(s: G4Store, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        s.read(i + 1)  # verified payload, ready for the copy into the paged KV (which raw reads need too)
    return time.perf_counter() - t0


def run(root: str, mib: int, rounds: int, disk: bool = True) -> list[dict]:
    results = []
    for label, layers, shape, dtype, bs in SIZES:
        ns = Namespace(model="bench", dtype=dtype, block_size=bs, layer_shapes=(shape,) * layers)
        d = tempfile.mkdtemp(dir=root, prefix="g4bench-")
        raw_dir = os.path.join(d, "raw")
        os.makedirs(raw_dir)
        s = G4Store(os.path.join(d, "store"), ns, touch_on_read=False)
        size = s.file_bytes
        n = max(8, (mib << 20) // size)
        payload = torch.randn(layers, *shape).to(getattr(torch, dtype))
        data = memoryview(payload.view(torch.uint8).reshape(-1).numpy())
        raw_data = bytes(size)  # same file size as a store file
        toks = list(range(bs))
        best = {"raw_w": 1e9, "raw_r": 1e9, "st_w": 1e9, "st_r": 1e9}
        for r in range(rounds):
            order = ["raw", "st"] if r % 2 == 0 else ["st", "raw"]
            for side in order:
                if side == "raw":
                    for i in range(n):  # both sides create new files, as the store does for new blocks
                        _unlink(os.path.join(raw_dir, f"{i:08d}.raw"))
                    best["raw_w"] = min(best["raw_w"], _raw_write(raw_dir, n, memoryview(raw_data), disk))
                    if disk:
                        _drop_cache(os.path.join(raw_dir, f"{i:08d}.raw") for i in range(n))
                    best["raw_r"] = min(best["raw_r"], _raw_read(raw_dir, n, size))
                else:
                    s.remove([i + 1 for i in range(n)])
                    best["st_w"] = min(best["st_w"], _store_write(s, n, payload, toks, disk))
                    if disk:
                        _drop_cache(s.path(i + 1) for i in range(n))
                    best["st_r"] = min(best["st_r"], _store_read(s, n))
        total = n * size
        res = {
            "blocks": label,
            "block_bytes": size,
            "n": n,
            "raw_write_MBps": total / best["raw_w"] / 1e6,
            "store_write_MBps": total / best["st_w"] / 1e6,
            "raw_read_MBps": total / best["raw_r"] / 1e6,
            "store_read_MBps": total / best["st_r"] / 1e6,
        }
        res["write_ratio"] = res["store_write_MBps"] / res["raw_write_MBps"]
        res["read_ratio"] = res["store_read_MBps"] / res["raw_read_MBps"]
        results.append(res)
        shutil.rmtree(d, ignore_errors=True)
        del data
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory to benchmark (default: a temp dir)")
    ap.add_argument("--mib", type=int, default=256, help="data per size and side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--cached",
        action="store_true",
        help="page-cache mode: no sync() after writes, no cache eviction before reads",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    root = a.dir or tempfile.gettempdir()
    res = run(root, a.mib, a.rounds, disk=not a.cached)
    print(
        f"mode: {'page cache' if a.cached else 'disk (writes include sync(), cache evicted before reads)'}; dir {root}"
    )
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print("| blocks | block file | raw write | store write | ratio | raw read | store read | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res:
        print(
            f"| {r['blocks']} | {r['block_bytes'] / 1024:.0f} KiB | {r['raw_write_MBps']:.0f} MB/s | "
            f"{r['store_write_MBps']:.0f} MB/s | {r['write_ratio']:.0%} | {r['raw_read_MBps']:.0f} MB/s | "
            f"{r['store_read_MBps']:.0f} MB/s | {r['read_ratio']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
