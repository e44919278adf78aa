"""``stack`` and ``unstack``: JAX's primitives for ``jnp.stack`` and its transpose.

``stack[axis]`` puts its ``k`` equal-shaped operands side by side along a new dimension
``axis`` of size ``k``; ``unstack[axis]`` cuts that dimension off again into ``k`` results.  Every
other dimension passes through, so it may stay split as it is; the new dimension holds one
operand per index, and is kept whole.  (Meta-style interleaved RoPE, ``jnp.stack([re, im], -1)``,
emits both in a train step.)

>>> from jaxpar._src.rules.registry import OpView
>>> rule = _stack_rule(OpView("stack", ((4, 8), (4, 8)), ("f32",) * 2, ((4, 8, 2),), ("f32",),
...                           {"axis": 2}))
>>> [len(d) for d in rule.operands], len(rule.results[0])
([2, 2], 3)
"""

from __future__ import annotations

from jaxpar._src.rules.factors import FactorRule, RuleBuilder
from jaxpar._src.rules.registry import OpView, register_rule


def _shared(b: RuleBuilder, shape: tuple[int, ...], axis: int) -> tuple[list, list]:
    """Factors of the stacked shape: ``(with the new axis whole, without it)``."""
    full = [b.factor(n, blocked=True) if d == axis else b.factor(n) for d, n in enumerate(shape)]
    return full, [f for d, f in enumerate(full) if d != axis]


@register_rule("stack")
def _stack_rule(op: OpView) -> FactorRule:
    out = op.out_shapes[0]
    axis = op.params["axis"] % len(out)
    b = RuleBuilder()
    full, each = _shared(b, out, axis)
    return b.build([each] * len(op.in_shapes), [full])


@register_rule("unstack")
def _unstack_rule(op: OpView) -> FactorRule:
    ins = op.in_shapes[0]
    axis = op.params["axis"] % len(ins)
    b = RuleBuilder()
    full, each = _shared(b, ins, axis)
    return b.build([full], [each] * len(op.out_shapes))
