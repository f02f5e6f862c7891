"""Block identity: the chained XXH3-64 key space that NVIDIA Dynamo and Mooncake share.

- local hash of block i: ``xxh3_64(token ids of block i as little-endian uint32, seed_i)``;
- sequence hash: ``s_0 = local_0``, ``s_i = xxh3_64(le_u64(s_{i-1}) || le_u64(local_i), seed=1337)``;
- full blocks only.

Seed rule (kvgate's, documented in the README):
``seed_i = (1337 + [xxh3_64(lora_name)] + [xxh3_64(cache_salt) if i == 0]) mod 2**64``.
The LoRA name salts every block (as Dynamo does); a cache_salt salts block 0 only, exactly where vLLM
puts it (``("cache_salt", salt)`` in block 0's extra keys) -- the chain carries it into every later block,
so a BlockStored event that continues a chain needs no salt to be re-hashed.

vLLM's own block hashes are not reproduced (they depend on the hash algorithm, PYTHONHASHSEED and LoRA
paths); they are opaque handles mapped onto these hashes by the event ingestion.
"""
from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

SEED = 1337
_MASK = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest


def salt_seed(lora_name: str | None = None) -> int:
    """Seed of every block's local hash for a LoRA adapter (1337 without one)."""
    if not lora_name:
        return SEED
    return (SEED + _xxh3(lora_name.encode())) & _MASK


def first_block_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Seed of block 0's local hash: the LoRA seed plus the cache_salt."""
    seed = salt_seed(lora_name)
    if cache_salt:
        seed = (seed + _xxh3(cache_salt.encode())) & _MASK
    return seed


_pair = struct.Struct("<QQ").pack
_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def as_u32(tokens: Sequence[int] | np.ndarray) -> np.ndarray | array.array:
    """Token ids as contiguous little-endian uint32 (zero-copy for an ``array('I')`` or a u4 array).
    A list goes through ``array('I')``, about 4x faster than numpy's conversion; ids outside uint32 raise
    OverflowError."""
    if isinstance(tokens, array.array) and tokens.typecode == "I" and _NATIVE_U32:
        return tokens
    if isinstance(tokens, list) and _NATIVE_U32:
        try:
            return array.array("I", tokens)
        except TypeError:
            pass
    arr = np.asarray(tokens)
    if arr.dtype != np.dtype("<u4"):
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise OverflowError("token id outside uint32")
        arr = arr.astype("<u4", copy=False)
    return np.ascontiguousarray(arr)


def local_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """Content hash of each full block of ``tokens`` (a partial tail is ignored)."""
    return _local(as_u32(tokens), block_size, 0, lora_name, cache_salt, max_blocks)


def _local(arr, block_size: int, start: int, lora_name, cache_salt, max_blocks) -> list[int]:
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(arr) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= start:
        return []
    view = memoryview(arr).cast("B")
    step = block_size * 4
    seed = salt_seed(lora_name)
    out = []
    i = start * step
    if start == 0:
        out.append(_xxh3(view[0:step], first_block_seed(lora_name, cache_salt)))
        i = step
    out.extend(_xxh3(view[j : j + step], seed) for j in range(i, n * step, step))
    return out


def chain(local: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes for ``local`` hashes, continuing from ``parent`` (None: the chain starts here)."""
    out: list[int] = []
    prev = parent
    for h in local:
        prev = h if prev is None else _xxh3(_pair(prev, h), SEED)
        out.append(prev)
    return out


def sequence_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """kvgate's block keys for a prompt: the chained sequence hash of every full block."""
    return chain(local_hashes(tokens, block_size, lora_name, cache_salt, max_blocks))


def sequence_hashes_from(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    start_block: int,
    parent: int | None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """Sequence hashes of blocks ``start_block`` onwards, given block ``start_block - 1``'s (``parent``):
    a prompt that extends a known prefix hashes only its new blocks."""
    if (start_block == 0) != (parent is None):
        raise ValueError("parent is the hash of block start_block - 1 (None only from block 0)")
    return chain(_local(as_u32(tokens), block_size, start_block, lora_name, cache_salt, max_blocks), parent)


def routable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks vLLM can hit for a prompt: it never serves the last prompt token from cache."""
    return max(0, (num_prompt_tokens - 1) // block_size)


def chained_run(start: int, n: int, holds) -> int:
    """The end of the run of positions ``start..n-1`` for which ``holds(i)`` is true, where a true position
    proves every one before it (chained hashes: equal, or known, at ``i`` means at ``0..i`` too). ``start``
    when it does not hold there; a probe at each end, then bisection."""
    if start >= n or not holds(start):
        return start
    if holds(n - 1):
        return n
    lo, hi = start, n - 1  # lo holds, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo + 1
