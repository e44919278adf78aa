"""Contractions: ``dot_general`` and ``conv_general_dilated``.

``dot_general`` has batch factors (in both operands and the result), free factors (in one operand
and the result) and contracting factors (in both operands only: splitting them leaves partial
sums, combined by an all-reduce, or a reduce-scatter when the result is split further).

``conv_general_dilated`` splits the batch, the output features and, when there is one feature
group, the input features (a reduction, as in the kernel gradient); spatial dimensions stay whole
because splitting them needs halo exchange.
"""

from __future__ import annotations

import math

from jaxpar._src.rules.factors import FactorRule, OpCategory, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule, replicated_rule


@register_rule("dot_general", category=OpCategory.CONTRACTION)
def _dot_general_rule(op: OpView) -> FactorRule:
    (lhs, rhs), (out,) = op.in_shapes, op.out_shapes
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    b = RuleBuilder()
    lhs_dims: list = [None] * len(lhs)
    rhs_dims: list = [None] * len(rhs)
    out_dims: list = []
    for li, ri in zip(lb, rb, strict=True):
        f = b.factor(lhs[li])
        lhs_dims[li] = rhs_dims[ri] = f
        out_dims.append(f)
    reductions = {}
    for li, ri in zip(lc, rc, strict=True):
        f = b.factor(lhs[li])
        lhs_dims[li] = rhs_dims[ri] = f
        reductions[f] = "sum"
    for i, n in enumerate(lhs):
        if i not in lb and i not in lc:
            lhs_dims[i] = b.factor(n)
            out_dims.append(lhs_dims[i])
    for i, n in enumerate(rhs):
        if i not in rb and i not in rc:
            rhs_dims[i] = b.factor(n)
            out_dims.append(rhs_dims[i])
    if len(out_dims) != len(out):
        return replicated_rule(op)
    contract = math.prod(lhs[i] for i in lc)
    flops = 2.0 * math.prod(out) * contract
    return b.build([lhs_dims, rhs_dims], [out_dims], reductions=reductions, flops=flops)


@register_rule("conv_general_dilated", category=OpCategory.CONTRACTION)
def _conv_rule(op: OpView) -> FactorRule:
    (lhs, rhs), (out,) = op.in_shapes[:2], op.out_shapes
    dn = op.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = op.params.get("feature_group_count", 1)
    batch_groups = op.params.get("batch_group_count", 1)
    b = RuleBuilder()
    lhs_dims: list = [None] * len(lhs)
    rhs_dims: list = [None] * len(rhs)
    out_dims: list = [None] * len(out)
    grouped = groups != 1 or batch_groups != 1
    n = b.factor(lhs[lhs_spec[0]], blocked=batch_groups != 1)
    lhs_dims[lhs_spec[0]] = out_dims[out_spec[0]] = n
    o = b.factor(rhs[rhs_spec[0]], blocked=grouped)
    rhs_dims[rhs_spec[0]] = out_dims[out_spec[1]] = o
    c = b.factor(rhs[rhs_spec[1]], blocked=grouped)
    rhs_dims[rhs_spec[1]] = c
    reductions = {}
    if lhs[lhs_spec[1]] == rhs[rhs_spec[1]]:
        lhs_dims[lhs_spec[1]] = c
        reductions[c] = "sum"
    else:
        b.blocked.add(c)
    kernel = math.prod(rhs[d] for d in rhs_spec[2:])
    flops = 2.0 * math.prod(out) * rhs[rhs_spec[1]] * kernel
    return b.build([lhs_dims, rhs_dims] + [[None] * len(s) for s in op.in_shapes[2:]],
                   [out_dims], reductions=reductions, flops=flops)
