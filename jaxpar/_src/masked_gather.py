"""``take_along_axis`` over a split dimension inside ``shard_map``, as a masked sum.

A gather with explicit batching dimensions (``jnp.take_along_axis``, optax's
``softmax_cross_entropy_with_integer_labels``: the label's logit, ``logits[b, t, y[b, t]]``)
whose looked-up dimension is split (the vocabulary over ``tp``) aborts the whole process when
XLA's SPMD partitioner meets it in a partially manual computation (the pipeline loop's
``shard_map`` over ``pp``): ``PartitionGather`` → ``PartitionGatherExplicitBatchDimensions`` →
``PartitionGatherParallelDimensions`` → ``PartitionGatherTrivialSlicedOperandDimensions`` →
``AllReduceAlongShardingDims`` fails ``Check failed: partition_group_list.num_replica_groups() *
partition_group_list.num_devices_per_group() == device_groups.num_devices_per_group()``
(``spmd_partitioner_util.cc``, ``ExpandDeviceGroupsWithIota``; jaxlib 0.10.1).  Plain
``jax.jit`` with the same layouts under ``shard_map(axis_names={"pp"})`` aborts the same way:
XLA's bug, which jaxpar must not walk into.  Outside ``shard_map`` it partitions fine.

So inside such a region the gather is evaluated as what the partitioner would have done: each
device compares its slice of the looked-up dimension with the index and sums, and the sum over
the split dimension becomes the all-reduce of the result that the gather rule prices
(``rules/indexing.py``: the looked-up dimension is a ``sum`` reduction factor).  One term of the
sum is the value and the rest are exact zeros, so the result is the gather's, bit for bit.

>>> import jax.numpy as jnp
>>> x = jnp.arange(12.0).reshape(2, 6)
>>> i = jnp.array([[5], [0]])
>>> eqn = jax.make_jaxpr(lambda x, i: jnp.take_along_axis(x, i, -1))(x, i).eqns[-1]
>>> eqn = eqn.params["jaxpr"].eqns[-1]  # the gather inside take_along_axis's jit
>>> idx = jnp.array([[[5]], [[0]]])
>>> masked_gather(eqn.params, x, idx).tolist()
[[5.0], [6.0]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._src.spec import Spec


def looked_up_dim(params: Mapping[str, Any], operand_ndim: int, index_ndim: int) -> int | None:
    """The operand dimension a batched gather looks up, when :func:`masked_gather` can do it:
    every other operand dimension is a batching dimension, one index per result element (the
    index vector last and of length one, no offset dimensions); else ``None``."""
    dn = params["dimension_numbers"]
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    starts = tuple(dn.start_index_map)
    if not batching or len(starts) != 1 or tuple(dn.offset_dims):
        return None
    (v,) = starts
    if (tuple(dn.collapsed_slice_dims) != (v,) or params["slice_sizes"][v] != 1
            or sorted((*batching, v)) != list(range(operand_ndim))):
        return None
    if params["mode"] not in (jax.lax.GatherScatterMode.CLIP,
                              jax.lax.GatherScatterMode.FILL_OR_DROP,
                              jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS):
        return None
    if len(tuple(dn.start_indices_batching_dims)) != len(batching) or index_ndim < 1:
        return None
    return v


def needs_masked_gather(params: Mapping[str, Any], operand_spec: Spec | None, index_ndim: int,
                        dtype: Any) -> bool:
    """Whether a gather bound inside ``shard_map`` must be :func:`masked_gather`: a batched
    gather (``take_along_axis``) whose looked-up dimension is split in the plan."""
    if operand_spec is None:
        return False
    v = looked_up_dim(params, len(operand_spec.dims), index_ndim)
    return (v is not None and bool(operand_spec.dims[v])
            and np.dtype(dtype) != np.dtype(bool))


def masked_gather(params: Mapping[str, Any], operand: Any, indices: Any) -> Any:
    """The gather ``params`` describe (one :func:`looked_up_dim`), as a compare-select-sum over
    the looked-up dimension, with the gather's ``mode`` for indices out of bounds."""
    dn = params["dimension_numbers"]
    v = looked_up_dim(params, operand.ndim, indices.ndim)
    assert v is not None, params
    size = operand.shape[v]
    out_shape = indices.shape[:-1]
    batching: Sequence[int] = tuple(dn.operand_batching_dims)
    positions: Sequence[int] = tuple(dn.start_indices_batching_dims)
    # the operand's batching dimensions in the result's order, the looked-up one last
    order = sorted(range(len(batching)), key=lambda j: positions[j])
    moved = jnp.transpose(operand, [batching[j] for j in order] + [v])
    wide = jax.lax.broadcast_in_dim(moved, (*out_shape, size),
                                    [positions[j] for j in order] + [len(out_shape)])
    index = indices[..., 0]
    if params["mode"] is not jax.lax.GatherScatterMode.FILL_OR_DROP:
        index = jnp.clip(index, 0, size - 1)  # XLA's gather clamps the start index
    hit = jax.lax.broadcasted_iota(index.dtype, (*out_shape, size), len(out_shape)) \
        == index[..., None]
    out = jnp.sum(jnp.where(hit, wide, jnp.zeros((), operand.dtype)), axis=-1,
                  dtype=operand.dtype)
    if params["mode"] is jax.lax.GatherScatterMode.FILL_OR_DROP:
        inside = (index >= 0) & (index < size)
        out = jnp.where(inside, out, _fill(params.get("fill_value"), operand.dtype))
    return out


def _fill(value: Any, dtype: Any) -> Any:
    """``lax.gather``'s fill for indices out of bounds: ``fill_value``, else NaN for inexact
    types and the lowest (signed) or highest (unsigned) integer."""
    dtype = np.dtype(dtype)
    if value is not None:
        return jnp.asarray(value, dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(np.nan, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max, dtype)
