"""Moving whole blocks between vLLM's paged KV tensors and host memory, for any KV layout.

vLLM gives the connector one tensor per layer whose shape depends on the attention backend: the CPU
backend's ``[num_blocks, kv_heads, block, 2*head]``, FlashAttention's ``[2, num_blocks, block, kv_heads,
head]``, and so on. The block dimension is the one whose size is the number of KV blocks; a block is the
slice at one index of it. Everything here is a torch op on the tensors' own device (no Python loop over
elements), so the same code runs on CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def block_dim(t: torch.Tensor, num_blocks: int) -> int:
    """The dimension of ``t`` that indexes KV blocks (the first of size ``num_blocks``)."""
    for d, s in enumerate(t.shape):
        if s == num_blocks:
            return d
    raise ValueError(f"no block dimension of size {num_blocks} in KV tensor of shape {tuple(t.shape)}")


def gather_blocks(kv: Sequence[torch.Tensor], bdim: int, block_ids: Sequence[int]) -> torch.Tensor:
    """``[n, layers, elems]`` on the host: every layer's slice of each block, one contiguous row per block."""
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=kv[0].device)
    parts = [t.index_select(bdim, ids).movedim(bdim, 0).reshape(len(block_ids), -1) for t in kv]
    return torch.stack(parts, dim=1).to("cpu")


def scatter_block(kv: Sequence[torch.Tensor], bdim: int, block_id: int, raw: torch.Tensor) -> int:
    """Copy one block's payload (``raw``: uint8, layers back to back) into the paged KV; returns bytes."""
    off = 0
    for t in kv:
        dst = t.select(bdim, block_id)
        nb = dst.numel() * dst.element_size()
        if off + nb > raw.numel():
            raise ValueError("payload shorter than a block")
        src = raw[off : off + nb].view(dst.dtype).view(dst.shape)
        dst.copy_(src)
        off += nb
    return off
