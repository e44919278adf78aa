"""Checksums of array contents that do not depend on the layout.

A checkpoint keeps, per array, two 32-bit sums over its elements of ``bits(x[i]) * w(i)``
(modulo 2**32), with odd weights ``w`` that depend on the element's global position ``i``.
Addition modulo 2**32 does not care about order, so each process sums the shards it holds (one
copy of each) and the processes add their sums: the saver and a loader on any other layout
compute the same numbers from what they hold, and neither reads a byte more than it has.  A
changed element always changes the first sum (an odd weight is invertible modulo 2**32), and an
element at the wrong place changes its weight; storage damaged in ways tensorstore does not
notice (a flipped bit in compressed data decodes to wrong numbers) is caught on load.

>>> import numpy as np
>>> x = np.arange(12, dtype=np.float32).reshape(3, 4)
>>> whole = block_sums(x, (0, 0), x.shape)
>>> top, bottom = block_sums(x[:1], (0, 0), x.shape), block_sums(x[1:], (1, 0), x.shape)
>>> combine([top, bottom]) == whole
True
>>> y = x.copy(); y[2, 3] = np.nextafter(y[2, 3], 100)
>>> block_sums(y, (0, 0), y.shape) == whole
False
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

MOD = 1 << 32
BLOCK = 1 << 18  # elements summed at a time: the temporaries stay near 16 MiB
_M1, _A1 = np.uint64(0x9E3779B1), np.uint64(0x85EBCA6B)
_M2, _A2 = np.uint64(0xC2B2AE35), np.uint64(0x27D4EB2F)
_LOW = np.uint64(MOD - 1)

Sums = tuple[int, int]


def summable(x: Any) -> bool:
    """Whether the sums cover ``x``: numbers of 1, 2, 4, 8 or 16 bytes (not strings)."""
    dtype = np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)
    return dtype.kind in "biufcV" and dtype.itemsize in (1, 2, 4, 8, 16)


def _words(x: np.ndarray) -> np.ndarray:
    """The elements' bits as unsigned 64-bit integers (wider types folded to 32 bits)."""
    size = x.dtype.itemsize
    if size >= 8:
        u = x.view(np.uint64).reshape(*x.shape, size // 8)
        folded = u[..., 0]
        for k in range(1, size // 8):  # complex128: both halves
            folded = (folded * _M1) ^ u[..., k]
        return (folded & _LOW) ^ ((folded >> np.uint64(32)) * _M2 & _LOW)
    kind = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    return x.view(kind).astype(np.uint64)


def _mix(v: np.ndarray, m: np.uint64, shift: int) -> np.ndarray:
    """Spreads the bits of 32-bit words (a bijection, so no change is lost): float bit patterns
    end in zeros that a plain product would keep out of the low bits."""
    x = v * m & _LOW
    return x ^ (x >> np.uint64(shift))


def block_sums(block: np.ndarray, start: Sequence[int], shape: Sequence[int]) -> Sums:
    """The two sums over ``block``, which sits at ``start`` of an array of ``shape``."""
    if not block.flags.c_contiguous:
        block = block.copy(order="C")
    if block.size == 0:
        return (0, 0)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    s1 = s2 = 0
    rows = max(1, BLOCK // max(1, math.prod(block.shape[1:]))) if block.ndim else 1
    for r0 in range(0, block.shape[0] if block.ndim else 1, rows):
        part = block[r0:r0 + rows] if block.ndim else block
        index = np.zeros(part.shape, np.uint64)
        for d in range(part.ndim):
            offset = start[d] + (r0 if d == 0 else 0)
            coords = np.arange(offset, offset + part.shape[d], dtype=np.uint64)
            index += (coords * np.uint64(strides[d])).reshape(
                [-1 if k == d else 1 for k in range(part.ndim)])
        v = _words(part)
        w1 = (index * _M1 + _A1) & _LOW | np.uint64(1)
        w2 = (index * _M2 + _A2) & _LOW | np.uint64(1)
        s1 += int(np.sum(_mix(v, _M2, 13) * w1 & _LOW, dtype=np.uint64)) % MOD
        s2 += int(np.sum(_mix(v, _M1, 15) * w2 & _LOW, dtype=np.uint64)) % MOD
    return (s1 % MOD, s2 % MOD)


def combine(parts: Sequence[Sums]) -> Sums:
    return (sum(p[0] for p in parts) % MOD, sum(p[1] for p in parts) % MOD)


def local_sums(x: Any) -> Sums:
    """This process's share of the sums of ``x``: each shard it holds once (replica 0); a value
    every process has whole (host values, arrays on this process's devices only) is counted by
    process 0."""
    if isinstance(x, jax.Array) and not (jax.process_count() > 1 and x.is_fully_addressable):
        parts = []
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            start = [s.start or 0 for s in shard.index] if x.ndim else []
            parts.append(block_sums(np.asarray(shard.data), start, x.shape))
        return combine(parts)
    if jax.process_index() != 0:
        return (0, 0)
    value = np.asarray(x)
    return block_sums(value, [0] * value.ndim, value.shape)


def tree_sums(leaves: Sequence[Any]) -> list[Sums | None]:
    """The sums of every leaf (``None`` for strings and other non-numbers), added over all
    processes (one small all-gather)."""
    local = np.array([local_sums(x) if summable(x) else (0, 0) for x in leaves],
                     dtype=np.uint64).reshape(-1, 2)
    if jax.process_count() > 1 and len(leaves):
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(local.astype(np.uint32)))
        local = every.reshape(jax.process_count(), -1, 2).astype(np.uint64).sum(axis=0)
    return [(int(a) % MOD, int(b) % MOD) if summable(x) else None
            for (a, b), x in zip(local, leaves, strict=True)]
