"""Block copies between paged KV tensors and the store, for the CPU layout and a GPU-style layout."""

from __future__ import annotations

import pytest
import torch

from cache_tier.kv_copy import block_dim, gather_blocks, scatter_block
from cache_tier.store import G4Store, Namespace

N, B, H, D, L = 9, 32, 2, 64, 3
LAYOUTS = {
    "cpu [blocks, heads, block, 2*head]": (N, H, B, 2 * D),
    "flash-attn [2, blocks, block, heads, head]": (2, N, B, H, D),
}


@pytest.mark.parametrize("shape", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_blocks_round_trip_through_the_store(tmp_path, shape):
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(L)]
    dst = [torch.zeros_like(t) for t in src]
    bdim = block_dim(src[0], N)
    per_block = src[0].select(bdim, 0).numel()
    st = G4Store(
        tmp_path, Namespace(model="m", dtype="bfloat16", block_size=B, layer_shapes=((per_block,),) * L)
    )
    host = gather_blocks(src, bdim, [4, 7])
    assert host.shape == (2, L, per_block)
    for j, (bid, h) in enumerate([(4, 100), (7, 101)]):
        st.put(h, list(range(B)), None, host[j])
    # load block 4's file into block 1 and block 7's into block 8 of empty caches
    for h, bid in [(100, 1), (101, 8)]:
        assert scatter_block(dst, bdim, bid, st.read(h, list(range(B)))) == L * per_block * 2
    for s, d in zip(src, dst):
        assert torch.equal(d.select(bdim, 1), s.select(bdim, 4))
        assert torch.equal(d.select(bdim, 8), s.select(bdim, 7))
        assert d.select(bdim, 0).abs().sum() == 0  # nothing else was touched


def test_block_dim_missing():
    with pytest.raises(ValueError):
        block_dim(torch.zeros(3, 4), 9)
