"""Operators that move, reshape, cut or create dimensions without arithmetic."""

from __future__ import annotations

import math

from jaxpar._src.rules.factors import FactorRule, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule, replicated_rule


@register_rule("broadcast_in_dim")
def _broadcast_in_dim_rule(op: OpView) -> FactorRule:
    ins, out = op.in_shapes[0], op.out_shapes[0]
    bdims = op.params["broadcast_dimensions"]
    b = RuleBuilder()
    out_dims = b.factors(out)
    in_dims = [out_dims[o] if ins[i] == out[o] else None for i, o in enumerate(bdims)]
    extra = [[None] * len(s) for s in op.in_shapes[1:]]  # dynamic-shape operands
    return b.build([in_dims] + extra, [out_dims])


@register_rule("transpose")
def _transpose_rule(op: OpView) -> FactorRule:
    perm = op.params["permutation"]
    b = RuleBuilder()
    in_dims = b.factors(op.in_shapes[0])
    return b.build([in_dims], [[in_dims[p] for p in perm]])


@register_rule("squeeze")
def _squeeze_rule(op: OpView) -> FactorRule:
    ins = op.in_shapes[0]
    drop = {d % len(ins) for d in op.params["dimensions"]}
    b = RuleBuilder()
    in_dims = [None if i in drop else b.factor(n) for i, n in enumerate(ins)]
    return b.build([in_dims], [[d for d in in_dims if d is not None]])


@register_rule("reshape")
def _reshape_rule(op: OpView) -> FactorRule:
    """Splits and merges of dimensions share factors; anything else stays whole.

    ``[B, T, H*D] -> [B, T, H, D]`` gives factors B, T, H, D, where the input's last dimension is
    the compound (H, D); only its major factor H may be split.
    """
    if op.params.get("dimensions") is not None:
        return replicated_rule(op)
    ins, out = op.in_shapes[0], op.out_shapes[0]
    b = RuleBuilder()
    in_dims: list = []
    out_dims: list = []
    i = j = 0
    while i < len(ins) or j < len(out):
        if i < len(ins) and ins[i] == 1:
            in_dims.append(None)
            i += 1
            continue
        if j < len(out) and out[j] == 1:
            out_dims.append(None)
            j += 1
            continue
        gi, gj = [i], [j]
        pi, pj = ins[i], out[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= ins[i]
            else:
                j += 1
                gj.append(j)
                pj *= out[j]
        i += 1
        j += 1
        if len(gi) == 1:  # one input dimension split into several outputs
            fs = [b.factor(out[k]) for k in gj]
            in_dims.append(tuple(fs))
            out_dims.extend(fs)
        elif len(gj) == 1:  # several input dimensions merged into one output
            fs = [b.factor(ins[k]) for k in gi]
            in_dims.extend(fs)
            out_dims.append(tuple(fs))
        else:  # a reshuffle with no common refinement: keep the group whole
            in_dims.extend(b.factor(ins[k], blocked=True) for k in gi)
            out_dims.extend(b.factor(out[k], blocked=True) for k in gj)
    return b.build([in_dims], [out_dims])


def _keep_or_block(b: RuleBuilder, n_in: int, n_out: int, keep: bool) -> tuple[int, int]:
    if keep:
        f = b.factor(n_in)
        return f, f
    return b.factor(n_in, blocked=True), b.factor(n_out, blocked=True)


@register_rule("slice")
def _slice_rule(op: OpView) -> FactorRule:
    ins, out = op.in_shapes[0], op.out_shapes[0]
    starts, strides = op.params["start_indices"], op.params.get("strides")
    b = RuleBuilder()
    pairs = [_keep_or_block(b, n, m, n == m and starts[d] == 0 and (not strides or strides[d] == 1))
             for d, (n, m) in enumerate(zip(ins, out, strict=True))]
    return b.build([[p[0] for p in pairs]], [[p[1] for p in pairs]])


@register_rule("rev")
def _rev_rule(op: OpView) -> FactorRule:
    ins = op.in_shapes[0]
    rev = set(op.params["dimensions"])
    b = RuleBuilder()
    pairs = [_keep_or_block(b, n, n, d not in rev) for d, n in enumerate(ins)]
    return b.build([[p[0] for p in pairs]], [[p[1] for p in pairs]])


@register_rule("pad")
def _pad_rule(op: OpView) -> FactorRule:
    ins, out = op.in_shapes[0], op.out_shapes[0]
    config = op.params["padding_config"]
    b = RuleBuilder()
    pairs = [_keep_or_block(b, n, m, tuple(config[d]) == (0, 0, 0))
             for d, (n, m) in enumerate(zip(ins, out, strict=True))]
    return b.build([[p[0] for p in pairs], []], [[p[1] for p in pairs]])


@register_rule("dynamic_slice")
def _dynamic_slice_rule(op: OpView) -> FactorRule:
    ins, out = op.in_shapes[0], op.out_shapes[0]
    b = RuleBuilder()
    pairs = [_keep_or_block(b, n, m, n == m) for n, m in zip(ins, out, strict=True)]
    indices = [[None] * len(s) for s in op.in_shapes[1:]]
    return b.build([[p[0] for p in pairs]] + indices, [[p[1] for p in pairs]])


@register_rule("dynamic_update_slice")
def _dynamic_update_slice_rule(op: OpView) -> FactorRule:
    operand, update = op.in_shapes[0], op.in_shapes[1]
    b = RuleBuilder()
    op_dims, up_dims = [], []
    for n, m in zip(operand, update, strict=True):
        if n == m:
            f = b.factor(n)
            op_dims.append(f)
            up_dims.append(f)
        else:
            op_dims.append(b.factor(n, blocked=True))
            up_dims.append(None)
    indices = [[None] * len(s) for s in op.in_shapes[2:]]
    return b.build([op_dims, up_dims] + indices, [op_dims])


@register_rule("concatenate")
def _concatenate_rule(op: OpView) -> FactorRule:
    axis = op.params["dimension"]
    out = op.out_shapes[0]
    b = RuleBuilder()
    shared = [None if d == axis else b.factor(n) for d, n in enumerate(out)]
    operands = [[None if d == axis else shared[d] for d in range(len(out))]
                for _ in op.in_shapes]
    return b.build(operands, [shared])


@register_rule("split")
def _split_rule(op: OpView) -> FactorRule:
    axis = op.params["axis"]
    ins = op.in_shapes[0]
    b = RuleBuilder()
    shared = [None if d == axis else b.factor(n) for d, n in enumerate(ins)]
    return b.build([shared], [shared] * len(op.out_shapes))


@register_rule("iota")
def _iota_rule(op: OpView) -> FactorRule:
    b = RuleBuilder()
    out = op.out_shapes[0]
    return b.build([], [b.factors(out)], flops=math.prod(out))


@register_rule("empty", "empty2")
def _empty_rule(op: OpView) -> FactorRule:
    """Uninitialised memory (``empty2``: the scalar the gradient of ``lax.cond`` broadcasts
    for a branch's unused outputs): any split of the result, no work."""
    b = RuleBuilder()
    return b.build([[None] * len(s) for s in op.in_shapes],
                   [b.factors(s) for s in op.out_shapes])
