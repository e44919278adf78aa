"""Which rows a shard reads: MindSpore's ``DistributedSampler``.

Shard ``i`` of ``k`` reads rows ``i, i + k, i + 2k, ...``: ``ceil(N / k)`` rows, so every shard
has the same number and a short shard wraps around to the start of the data.  The shards are
disjoint when ``k`` divides ``N`` and always cover it.  With shuffling, every shard applies the
same permutation (the same seed), drawn again for each epoch (seed + epoch), so the shards stay
disjoint from epoch to epoch.

>>> shard_indices(10, num_shards=4, shard_id=3).tolist()  # wraps around: row 1 again
[3, 7, 1]
>>> sorted(sum((shard_indices(8, 4, i).tolist() for i in range(4)), []))
[0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import numpy as np

from jaxpar._src.errors import DatasetError


def check_shards(num_shards: int | None, shard_id: int | None, where: str) -> None:
    if (num_shards is None) != (shard_id is None):
        raise DatasetError(
            f"{where}: give num_shards and shard_id together (e.g. num_shards="
            f"jaxpar.get_group_size(), shard_id=jaxpar.get_rank()), or neither.")
    if num_shards is None:
        return
    if not isinstance(num_shards, int) or num_shards < 1:
        raise DatasetError(f"{where}: num_shards must be a positive int, got {num_shards!r}.")
    if not isinstance(shard_id, int) or not 0 <= shard_id < num_shards:
        raise DatasetError(
            f"{where}: shard_id must be an int in [0, num_shards={num_shards}), got "
            f"{shard_id!r}.")


def shard_indices(n: int, num_shards: int | None = None, shard_id: int | None = None, *,
                  shuffle: bool = False, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The row indices one shard reads in one epoch.

    >>> from jaxpar import dataset as ds
    >>> ds.shard_indices(10, num_shards=3, shard_id=2).tolist()  # ceil(10 / 3) rows, wrapping
    [2, 5, 8, 1]
    """
    order = np.arange(n)
    if shuffle:
        order = np.random.default_rng(seed + epoch).permutation(n)
    if num_shards is None:
        return order
    per = -(-n // num_shards)
    return order[(np.arange(per) * num_shards + (shard_id or 0)) % n]
