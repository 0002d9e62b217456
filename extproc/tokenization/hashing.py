"""Chained hashes over full blocks of token ids, the unit of the engines' KV prefix cache.

Block i's hash covers its parent's hash (block i-1's, or `seed` for the first) and the block's ids,
so equal hashes mean equal prefixes up to and including that block, as in vLLM's prefix caching.
blake2b (8-byte digests) over little-endian uint32 ids: stable across processes, unlike `hash()`,
and cheap enough to hash every block of a prompt.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

_LITTLE = sys.byteorder == "little"


def ids_array(ids: Sequence[int] | array[int]) -> array[int]:
    """`ids` as array('I') (uint32), without a copy when it already is one."""
    if isinstance(ids, array) and ids.typecode == "I":
        return ids
    return array("I", ids)


def block_hashes(
    token_ids: Sequence[int] | array[int],
    block_size: int,
    max_blocks: int | None = None,
    *,
    seed: bytes = b"",
) -> list[bytes]:
    """Chained 8-byte hashes of the full `block_size` blocks of `token_ids` (a trailing partial
    block is never hashed: the engine cannot share it), at most `max_blocks` of them. `seed`
    namespaces the chain (e.g. by model) so that equal ids under different models never match."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
    ids = ids_array(token_ids)
    count = len(ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    if count == 0:
        return []
    if ids.itemsize != 4:  # 'I' is 4 bytes on every mainstream platform; stay correct elsewhere
        raise ValueError("array('I') is not 32-bit on this platform")
    if not _LITTLE:
        ids = ids[: count * block_size]  # a copy, swapped to little-endian
        ids.byteswap()
    data = memoryview(ids).cast("B")
    step = block_size * 4
    out: list[bytes] = []
    parent = seed
    for start in range(0, count * step, step):
        parent = blake2b(parent + data[start : start + step], digest_size=8).digest()
        out.append(parent)
    return out
