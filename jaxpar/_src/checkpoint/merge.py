"""``jaxpar.merge_sliced_parameter``: one array from the slices the ranks of a layout hold.

MindSpore saves a distributed parameter as one slice per rank and merges them with the
parameter's layout; jaxpar checkpoints hold global arrays and never need this, but slices from
elsewhere (``[s.data for s in x.addressable_shards]``, another framework's per-rank files) do.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from jaxpar._src.checkpoint.layouts import ParameterLayouts
from jaxpar._src.errors import CheckpointError
from jaxpar._src.layout import Layout
from jaxpar._src.spec import MeshShape, Spec

API = "jaxpar.merge_sliced_parameter"


def merge_sliced_parameter(sliced_parameters: Sequence[Any], strategy: Any = None, *,
                           name: str | None = None) -> np.ndarray:
    """Merges per-rank slices into the whole array (MindSpore's ``merge_sliced_parameter``).

    Args:
      sliced_parameters: the slices, in rank order: rank ``r`` sits at row-major position ``r``
        of the device matrix (or where ``Layout(..., rank_list=...)`` puts it).
      strategy: the parameter's layout: a ``jaxpar.Layout`` called with its tensor map, a
        ``NamedSharding``, or a :class:`ParameterLayouts` with ``name``.  ``None``: the slices
        are concatenated along dimension 0.
      name: the parameter's path in a :class:`ParameterLayouts` strategy.

    Returns:
      The merged array.  Slices of the same block (replicas) must agree.

    >>> import numpy as np, jaxpar
    >>> x = np.arange(16.0).reshape(4, 4)
    >>> layout = jaxpar.Layout((2, 2), ("dp", "mp"))("mp", "None")   # rows over mp only
    >>> slices = [x[:2], x[2:], x[:2], x[2:]]                        # ranks 0..3
    >>> bool((jaxpar.merge_sliced_parameter(slices, layout) == x).all())
    True
    """
    slices = [np.asarray(s) for s in sliced_parameters]
    if not slices:
        raise CheckpointError(f"{API}: no slices given.")
    if strategy is None:
        return np.concatenate(slices, axis=0)
    mesh, spec, ranks = _layout(strategy, name, slices[0].ndim)
    if len(slices) != mesh.num_devices:
        raise CheckpointError(f"{API}: {len(slices)} slices for a device matrix of "
                              f"{mesh.num_devices} ranks {mesh}.")
    shape0 = slices[0].shape
    if any(s.shape != shape0 for s in slices):
        raise CheckpointError(f"{API}: the slices have different shapes "
                              f"{sorted({s.shape for s in slices})}.")
    counts = spec.split_counts(mesh)
    out = np.empty([d * c for d, c in zip(shape0, counts, strict=True)], slices[0].dtype)
    filled: dict[tuple[int, ...], int] = {}
    for position, coords in enumerate(itertools.product(*(range(s) for s in mesh.sizes))):
        rank = ranks[position]
        block = []
        for axes in spec.dims:
            index = 0
            for a in axes:
                index = index * mesh.size(a) + coords[mesh.names.index(a)]
            block.append(index)
        where = tuple(slice(b * d, (b + 1) * d) for b, d in zip(block, shape0, strict=True))
        key = tuple(block)
        if key in filled:
            if not np.array_equal(out[where], slices[rank], equal_nan=True):
                raise CheckpointError(f"{API}: ranks {filled[key]} and {rank} hold the same "
                                      f"block {key} with different values.")
            continue
        out[where] = slices[rank]
        filled[key] = rank
    return out


def _layout(strategy: Any, name: str | None, ndim: int) -> tuple[MeshShape, Spec, list[int]]:
    if isinstance(strategy, ParameterLayouts):
        if name is None or name not in strategy:
            raise CheckpointError(f"{API}: give name= of one of the strategy's arrays "
                                  f"({', '.join(list(strategy)[:4])}, ...).")
        return strategy.mesh, Spec.from_partition_spec(strategy[name], ndim), \
            list(range(strategy.mesh.num_devices))
    if isinstance(strategy, NamedSharding):
        mesh = MeshShape.of(strategy.mesh)
        return mesh, Spec.from_partition_spec(strategy.spec, ndim), \
            list(range(mesh.num_devices))
    if isinstance(strategy, Layout):
        mesh = MeshShape(strategy.alias_name, strategy.device_matrix)
        n = math.prod(strategy.device_matrix)
        ranks = list(strategy.rank_list) if strategy.rank_list is not None else list(range(n))
        return mesh, Spec.from_partition_spec(strategy.partition_spec(), ndim), ranks
    raise CheckpointError(f"{API}: strategy must be a jaxpar.Layout, a NamedSharding or a "
                          f"ParameterLayouts; got {type(strategy).__name__}.")
