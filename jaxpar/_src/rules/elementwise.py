"""Elementwise operators: every operand dimension is the result's dimension.

Operands have the result's shape, are scalars, or have size-1 dimensions that broadcast against
the result (those stay whole); anything else is replicated rather than guessed.
"""

from __future__ import annotations

import math

from jaxpar._src.rules.factors import FactorRule, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule, replicated_rule

UNARY = (
    "neg", "sign", "floor", "ceil", "round", "is_finite", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
    "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "abs", "not", "imag", "real", "conj", "erf", "erfc",
    "erf_inv", "lgamma", "digamma", "bessel_i0e", "bessel_i1e", "integer_pow", "square",
    "convert_element_type", "reduce_precision", "copy", "copy_p", "population_count", "clz",
    "reshard", "mesh_cast", "stop_gradient", "one_minus_square",  # JAX 0.11: tanh's derivative
)
BINARY = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "and",
    "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "complex", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad",
    "polygamma", "zeta",
)
NARY = ("select_n", "clamp", "regularized_incomplete_beta", "threefry2x32", "random_seed",
        "random_fold_in", "random_clone", "platform_index")


@register_rule(*UNARY, *BINARY, *NARY)
def _elementwise_rule(op: OpView) -> FactorRule:
    shape = op.out_shapes[0] if op.out_shapes else ()
    if any(s != shape for s in op.out_shapes):
        return replicated_rule(op)
    b = RuleBuilder()
    dims = b.factors(shape)
    operands = []
    for s in op.in_shapes:
        if len(s) == 0:
            operands.append([])
        elif len(s) == len(shape) and all(n in (m, 1) for n, m in zip(s, shape, strict=True)):
            # size-1 dimensions broadcast against the result and stay whole
            operands.append([f if n == m else None for f, n, m in zip(dims, s, shape,
                                                                       strict=True)])
        else:
            return replicated_rule(op)
    size = math.prod(shape) if shape else 1
    return b.build(operands, [dims] * len(op.out_shapes), flops=size * len(op.out_shapes))


@register_rule("device_put", "optimization_barrier")
def _per_operand_identity_rule(op: OpView) -> FactorRule:
    b = RuleBuilder()
    tensors = [b.factors(s) for s in op.in_shapes]
    return b.build(tensors, tensors[: len(op.out_shapes)])


@register_rule("bitcast_convert_type")
def _bitcast_rule(op: OpView) -> FactorRule:
    (ins,), (outs,) = op.in_shapes, op.out_shapes
    b = RuleBuilder()
    lead = b.factors(ins[: min(len(ins), len(outs))])
    # A size change adds or removes a trailing dimension, which stays whole.
    return b.build([lead + [None] * (len(ins) - len(lead))],
                   [lead + [None] * (len(outs) - len(lead))])


@register_rule("debug_callback", "debug_print")
def _host_callback_rule(op: OpView) -> FactorRule:
    return replicated_rule(op)
