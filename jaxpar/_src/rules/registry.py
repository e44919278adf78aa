"""The per-primitive rule registry: one pure rule per primitive, registered by decorator.

A rule reads the operator's operand and result shapes and its parameters (an :class:`OpView`)
and returns a :class:`FactorRule`.  It never looks at the mesh or at global state.  A primitive
without a rule is replicated, with one warning naming it.

>>> from jaxpar._src.rules.factors import RuleBuilder
>>> @register_rule("my_identity_prim")
... def _my_identity_rule(op):
...     b = RuleBuilder()
...     dims = b.factors(op.out_shapes[0])
...     return b.build([dims], [dims])
>>> "my_identity_prim" in registered_primitives()
True
>>> _ = _RULES.pop("my_identity_prim")  # not left registered: the rules key the plan cache
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxpar._src.errors import StrategyError, warn_once
from jaxpar._src.rules.factors import FactorRule, OpCategory, RuleBuilder


@dataclasses.dataclass(frozen=True)
class OpView:
    """What a rule may read about an operator: the primitive's name, its operands' and
    results' shapes and dtypes, and the equation's parameters.

    >>> import numpy as np
    >>> f32 = np.dtype("float32")
    >>> op = OpView("dot_general", ((8, 16), (16, 4)), (f32, f32), ((8, 4),), (f32,),
    ...             {"dimension_numbers": (((1,), (0,)), ((), ()))})
    >>> op.in_shapes[1], rule_of(op).category
    ((16, 4), <OpCategory.CONTRACTION: 'contraction'>)
    """

    name: str
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[Any, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[Any, ...]
    params: Mapping[str, Any]


RuleFn = Callable[[OpView], FactorRule]
_RULES: dict[str, tuple[RuleFn, OpCategory]] = {}
_BUILT: dict[tuple, FactorRule] = {}  # rules already built, by view


def register_rule(*names: str, category: OpCategory | str = OpCategory.OTHER
                  ) -> Callable[[RuleFn], RuleFn]:
    """Registers ``fn`` as the rule of the primitives ``names``.

    ``category`` says what kind of work the operator is (:class:`OpCategory`): a new matrix
    product registered as ``"contraction"`` is split and priced as ``dot_general`` is.

    Registering a primitive again replaces its rule, so a notebook cell can be re-run; when the
    new rule is another function than the one it replaces (not the same one re-defined), a
    :class:`~jaxpar.JaxparWarning` says so.  Functions traced afterwards use the new rule.

    >>> import numpy as np
    >>> @register_rule("doc_matmul", category="contraction")
    ... def _my_matmul(op):
    ...     b = RuleBuilder()
    ...     (m, k), (_, n) = op.in_shapes
    ...     fm, fk, fn = b.factor(m), b.factor(k), b.factor(n)
    ...     return b.build([[fm, fk], [fk, fn]], [[fm, fn]], reductions={fk: "sum"})
    >>> f32 = np.dtype("float32")
    >>> rule_of(OpView("doc_matmul", ((8, 16), (16, 4)), (f32, f32), ((8, 4),), (f32,), {})
    ...         ).category
    <OpCategory.CONTRACTION: 'contraction'>
    >>> _ = _RULES.pop("doc_matmul")  # not left registered: the rules key the plan cache
    """
    try:
        kind = OpCategory(category)
    except ValueError:
        raise StrategyError(f"jaxpar.register_rule{names}: category {category!r} is not one of "
                            f"{[c.value for c in OpCategory]}.") from None

    def deco(fn: RuleFn) -> RuleFn:
        for name in names:
            old = _RULES.get(name)
            if old is not None and _qualname(old[0]) != _qualname(fn):
                warn_once(f"rule:{name}:{_qualname(fn)}",
                          f"jaxpar.register_rule: the rule of primitive {name!r} "
                          f"({_qualname(old[0])}) is replaced by {_qualname(fn)}.")
            _RULES[name] = (fn, kind)
        for key in [k for k in _BUILT if k[0] in names]:  # built by the rules replaced
            del _BUILT[key]
        return fn

    return deco


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def registered_primitives() -> frozenset[str]:
    return frozenset(_RULES)


def replicated_rule(op: OpView) -> FactorRule:
    """Every dimension whole: the always-correct fallback."""
    b = RuleBuilder()
    return b.build([[None] * len(s) for s in op.in_shapes],
                   [[None] * len(s) for s in op.out_shapes])


def rule_of(op: OpView) -> FactorRule:
    """The rule for ``op``; an unknown primitive is replicated and warned about once.

    A rule depends on the view only, so repeated layers build each rule once."""
    entry = _RULES.get(op.name)
    if entry is None:
        warn_once(
            f"unsupported:{op.name}",
            f"jaxpar has no sharding rule for primitive '{op.name}'; it is computed replicated "
            f"(correct, but every device does all of its work). Register one with "
            f"jaxpar.register_rule('{op.name}') if it matters.")
        return replicated_rule(op)
    fn, category = entry
    try:
        key = (op.name, op.in_shapes, op.in_dtypes, op.out_shapes, op.out_dtypes,
               tuple(op.params.items()))  # same primitive, same order: no sort needed
        rule = _BUILT.get(key)
    except TypeError:  # parameters that cannot be hashed (arrays): build it afresh
        return _categorised(fn(op), category)
    if rule is None:
        if len(_BUILT) > 65536:
            _BUILT.clear()
        rule = _BUILT[key] = _categorised(fn(op), category)
    return rule


def _categorised(rule: FactorRule, category: OpCategory) -> FactorRule:
    """The rule with its primitive's registered category (one a rule set itself wins)."""
    if rule.category is OpCategory.OTHER and category is not OpCategory.OTHER:
        return dataclasses.replace(rule, category=category)
    return rule
