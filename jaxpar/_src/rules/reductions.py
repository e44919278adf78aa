"""Reductions, scans along an axis, sorting and windowed reductions (pooling)."""

from __future__ import annotations

import math

from jaxpar._src.rules.factors import FactorRule, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule

_KIND = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
         "reduce_and": "and", "reduce_or": "or", "reduce_xor": "xor"}


@register_rule(*_KIND)
def _reduce_rule(op: OpView) -> FactorRule:
    """Reduced dimensions are reduction factors: split, they leave partial results."""
    ins = op.in_shapes[0]
    axes = set(op.params["axes"])
    b = RuleBuilder()
    in_dims = b.factors(ins)
    kind = _KIND[op.name]
    return b.build([in_dims], [[f for d, f in enumerate(in_dims) if d not in axes]],
                   reductions={in_dims[d]: kind for d in axes}, flops=math.prod(ins))


@register_rule("argmax", "argmin")
def _arg_reduce_rule(op: OpView) -> FactorRule:
    """The reduced axis stays whole: combining partial arg-results needs value-index pairs."""
    ins = op.in_shapes[0]
    axes = set(op.params["axes"])
    b = RuleBuilder()
    in_dims = [b.factor(n, blocked=d in axes) for d, n in enumerate(ins)]
    return b.build([in_dims], [[f for d, f in enumerate(in_dims) if d not in axes]],
                   flops=math.prod(ins))


@register_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative_rule(op: OpView) -> FactorRule:
    ins = op.in_shapes[0]
    axis = op.params["axis"] % len(ins)
    b = RuleBuilder()
    dims = [b.factor(n, blocked=d == axis) for d, n in enumerate(ins)]
    return b.build([dims], [dims], flops=math.prod(ins))


@register_rule("sort")
def _sort_rule(op: OpView) -> FactorRule:
    shape = op.in_shapes[0]
    axis = op.params["dimension"] % len(shape)
    b = RuleBuilder()
    dims = [b.factor(n, blocked=d == axis) for d, n in enumerate(shape)]
    return b.build([dims] * len(op.in_shapes), [dims] * len(op.out_shapes),
                   flops=math.prod(shape) * max(1, math.ceil(math.log2(max(shape[axis], 2)))))


@register_rule("top_k")
def _top_k_rule(op: OpView) -> FactorRule:
    ins = op.in_shapes[0]
    axis = op.params.get("axis", len(ins) - 1) % len(ins)
    b = RuleBuilder()
    in_dims = [None if d == axis else b.factor(n) for d, n in enumerate(ins)]
    return b.build([in_dims], [in_dims] * len(op.out_shapes), flops=math.prod(ins))


def _window_trivial(op: OpView, d: int) -> bool:
    p = op.params
    checks = [p["window_dimensions"][d] == 1]
    if p.get("window_strides") is not None:
        checks.append(p["window_strides"][d] == 1)
    if p.get("padding") is not None:
        checks.append(tuple(p["padding"][d]) == (0, 0))
    for key in ("base_dilation", "window_dilation"):
        if p.get(key) is not None:
            checks.append(p[key][d] == 1)
    return all(checks)


@register_rule("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
               "select_and_gather_add", "select_and_scatter_add")
def _window_rule(op: OpView) -> FactorRule:
    """Pooling: dimensions the window does not touch (batch, channels) split; windowed ones not."""
    main = op.in_shapes[0]
    out = op.out_shapes[0]
    b = RuleBuilder()
    dims: list = []
    out_dims: list = []
    for d, n in enumerate(main):
        if _window_trivial(op, d) and out[d] == n:
            f = b.factor(n)
            dims.append(f)
            out_dims.append(f)
        else:
            dims.append(b.factor(n, blocked=True))
            out_dims.append(b.factor(out[d], blocked=True))
    operands = []
    for s in op.in_shapes:
        if s == main:
            operands.append(dims)
        elif s == out:
            operands.append(out_dims)
        else:
            operands.append([None] * len(s))
    return b.build(operands, [out_dims if s == out else [None] * len(s) for s in op.out_shapes],
                   flops=math.prod(main) * math.prod(op.params["window_dimensions"]))
