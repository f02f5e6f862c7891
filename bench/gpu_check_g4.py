"""GPU check of the G4 data path (cache_tier.kv_copy + cache_tier.store) on a CUDA device.

Run on a machine with a GPU: ``python -m bench.gpu_check_g4 [--out results.json]``. It builds paged KV
tensors in FlashAttention's layout ``[2, num_blocks, block, kv_heads, head]`` on the GPU, gathers blocks
to the host, writes them to a G4 store in a temp dir, reads them back, scatters them into other blocks of a
second KV cache on the GPU and checks bit equality. It also times gather (device->host) and scatter
(host->device) against a plain contiguous copy of the same bytes measured in the same run (the baseline),
and reports ratios. Nothing here runs in ``make test`` (CI has no GPU).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from cache_tier.kv_copy import block_dim, gather_blocks, scatter_block
from cache_tier.store import G4Store, Namespace


def _timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=64, help="blocks moved per measurement")
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    shape = (2, a.blocks, a.block_size, a.kv_heads, a.head_dim)
    g = torch.Generator(device=dev).manual_seed(0)
    src = [torch.randn(shape, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
           for _ in range(a.layers)]
    dst = [torch.zeros_like(t) for t in src]
    bdim = block_dim(src[0], a.blocks)
    per_block = src[0].select(bdim, 0).numel()
    ids = list(range(3, 3 + 2 * a.n, 2))
    targets = list(range(a.blocks - a.n, a.blocks))
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "shape": list(shape), "layers": a.layers, "blocks_moved": a.n}
    with tempfile.TemporaryDirectory() as root:
        ns = Namespace(model="gpu-check", dtype="bfloat16", block_size=a.block_size,
                       layer_shapes=((per_block,),) * a.layers, kv_layout="flash-attn")
        st = G4Store(root, ns)
        host = gather_blocks(src, bdim, ids)
        for j, h in enumerate(ids):
            st.put(1000 + h, list(range(a.block_size)), None, host[j])
        for h, t in zip(ids, targets):
            scatter_block(dst, bdim, t, st.read(1000 + h, list(range(a.block_size))))
        torch.cuda.synchronize()
        ok = all(torch.equal(d.select(bdim, t), s.select(bdim, h))
                 for s, d in zip(src, dst) for h, t in zip(ids, targets))
        untouched = all(int(d.select(bdim, 0).abs().sum().item()) == 0 for d in dst)
        res["round_trip_bit_exact"] = ok
        res["other_blocks_untouched"] = untouched
        nbytes = host.numel() * host.element_size()
        res["bytes_per_block"] = nbytes // a.n
        flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        base_d2h = _timed(lambda: pinned.copy_(flat, non_blocking=True))
        base_h2d = _timed(lambda: flat.copy_(pinned, non_blocking=True))
        t_gather = _timed(lambda: gather_blocks(src, bdim, ids))
        raws = [st.read(1000 + h, list(range(a.block_size))).clone() for h in ids]
        t_scatter = _timed(lambda: [scatter_block(dst, bdim, t, r) for t, r in zip(targets, raws)])
        gb = nbytes / 1e9
        res.update({
            "baseline_d2h_GBps": gb / base_d2h, "baseline_h2d_GBps": gb / base_h2d,
            "gather_GBps": gb / t_gather, "scatter_GBps": gb / t_scatter,
            "gather_vs_baseline": base_d2h / t_gather, "scatter_vs_baseline": base_h2d / t_scatter,
        })
    print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if (res["round_trip_bit_exact"] and res["other_blocks_untouched"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
