"""``gather`` and the ``scatter`` family, with embedding lookups in mind.

For ``table[ids]`` (operand ``[V, D]``, indices ``[B, T, 1]``, result ``[B, T, D]``):

* the index batch dimensions B, T are shared by the indices and the result;
* D is a slice dimension taken whole, shared by the table and the result;
* V, the gathered dimension, is a reduction factor: with the vocabulary split, each device looks
  up the rows it holds (the rest read as zero) and an all-reduce sums the pieces.

For the scatter-add that is the embedding gradient, the roles swap: splitting the update batch
leaves partial tables that an all-reduce sums; splitting V needs nothing (each device applies the
updates that land in its rows).  Other scatters (``set``, ``mul``, ``min``, ``max``) keep their
update batch whole.
"""

from __future__ import annotations

import math

from jaxpar._src.rules.factors import FactorRule, OpCategory, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule, replicated_rule


@register_rule("gather", category=OpCategory.INDEXING)
def _gather_rule(op: OpView) -> FactorRule:
    (operand, indices), (out,) = op.in_shapes, op.out_shapes
    dn = op.params["dimension_numbers"]
    slice_sizes = op.params["slice_sizes"]
    offset_dims = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    start_map = tuple(dn.start_index_map)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    b = RuleBuilder()
    # Index batch dimensions: every index dimension but the last (the index vector).
    idx_dims: list = [None] * len(indices)
    batch_out = [d for d in range(len(out)) if d not in offset_dims]
    idx_batch_positions = list(range(len(indices) - 1))
    if len(batch_out) != len(idx_batch_positions):
        return replicated_rule(op)
    out_dims: list = [None] * len(out)
    for pos, od in zip(idx_batch_positions, batch_out, strict=True):
        f = b.factor(indices[pos])
        idx_dims[pos] = f
        out_dims[od] = f
    op_dims: list = [None] * len(operand)
    for od_b, id_b in zip(op_batch, idx_batch, strict=True):
        op_dims[od_b] = idx_dims[id_b]
    reductions = {}
    offset_operand = [d for d in range(len(operand)) if d not in collapsed and d not in op_batch]
    if len(offset_operand) != len(offset_dims):
        return replicated_rule(op)
    for d, od in zip(offset_operand, offset_dims, strict=True):
        if slice_sizes[d] == operand[d] and d not in start_map:
            f = b.factor(operand[d])
            op_dims[d] = f
            out_dims[od] = f
        else:
            op_dims[d] = b.factor(operand[d], blocked=True)
            out_dims[od] = b.factor(out[od], blocked=True)
    looked_up = [d for d in start_map if d in collapsed]
    for d in collapsed:
        if op_dims[d] is None:
            vocab_ok = len(looked_up) == 1 and d == looked_up[0] and slice_sizes[d] == 1
            f = b.factor(operand[d], blocked=not vocab_ok)
            op_dims[d] = f
            if vocab_ok:
                reductions[f] = "sum"
    return b.build([op_dims, idx_dims], [out_dims], reductions=reductions,
                   flops=math.prod(out))


_SCATTER = ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
            "scatter_min", "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")


@register_rule(*_SCATTER, category=OpCategory.INDEXING)
def _scatter_rule(op: OpView) -> FactorRule:
    operand, indices, updates = op.in_shapes[:3]
    dn = op.params["dimension_numbers"]
    window = tuple(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims)
    to_operand = tuple(dn.scatter_dims_to_operand_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    is_add = op.name.replace("_", "-") in ("scatter-add", "scatter-sub")
    b = RuleBuilder()
    op_dims = b.factors(operand)
    up_dims: list = [None] * len(updates)
    idx_dims: list = [None] * len(indices)
    # Update scatter dimensions pair with the index batch dimensions (all but the last).
    up_scatter = [d for d in range(len(updates)) if d not in window]
    idx_positions = list(range(len(indices) - 1))
    if len(up_scatter) != len(idx_positions):
        return replicated_rule(op)
    reductions = {}
    batch_pairs = dict(zip(idx_batch, op_batch, strict=True))
    for ud, pos in zip(up_scatter, idx_positions, strict=True):
        if pos in batch_pairs:
            f = op_dims[batch_pairs[pos]]
        else:
            f = b.factor(updates[ud], blocked=not is_add)
            if is_add:
                reductions[f] = "sum"
        up_dims[ud] = f
        idx_dims[pos] = f
    window_operand = [d for d in range(len(operand)) if d not in inserted and d not in op_batch]
    if len(window_operand) != len(window):
        return replicated_rule(op)
    for d, ud in zip(window_operand, window, strict=True):
        if updates[ud] == operand[d] and d not in to_operand:
            up_dims[ud] = op_dims[d]
        else:
            b.blocked.add(op_dims[d])
            up_dims[ud] = b.factor(updates[ud], blocked=True)
    if not is_add:
        b.blocked.update(op_dims[d] for d in to_operand)
    return b.build([op_dims, idx_dims, up_dims], [op_dims], reductions=reductions,
                   flops=math.prod(updates))
