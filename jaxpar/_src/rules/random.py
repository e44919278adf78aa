"""Random-number primitives.

With ``jax_threefry_partitionable`` (JAX's default since 0.5), the bits of ``random_bits`` depend
only on the key and each element's position, so any split of the result gives the same numbers as
one device: the generated dimensions are free factors of the result.
"""

from __future__ import annotations

import math

import jax

from jaxpar._src.rules.factors import FactorRule, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule, replicated_rule


def _partitionable() -> bool:
    return bool(getattr(jax.config, "jax_threefry_partitionable", False))


@register_rule("random_bits", "random_split")
def _random_bits_rule(op: OpView) -> FactorRule:
    keys, out = op.in_shapes[0], op.out_shapes[0]
    if not _partitionable():
        return replicated_rule(op)
    b = RuleBuilder()
    key_dims = b.factors(keys)
    gen = b.factors(out[len(keys):])
    return b.build([key_dims], [key_dims + gen], flops=math.prod(out))


@register_rule("random_wrap")
def _random_wrap_rule(op: OpView) -> FactorRule:
    data, out = op.in_shapes[0], op.out_shapes[0]
    b = RuleBuilder()
    dims = b.factors(out)
    return b.build([dims + [None] * (len(data) - len(out))], [dims])


@register_rule("random_unwrap")
def _random_unwrap_rule(op: OpView) -> FactorRule:
    keys, out = op.in_shapes[0], op.out_shapes[0]
    b = RuleBuilder()
    dims = b.factors(keys)
    return b.build([dims], [dims + [None] * (len(out) - len(keys))])
